"""The minimal GPU image, as bench/gpu_acceptance.py's children meet it, on this machine: the
packages the image lacks made unimportable, and pytest importable only from outside
site-packages (the copy the acceptance run carries), in every child that puts the returned
folder on PYTHONPATH (the run passes PYTHONPATH on to its children).
"""

from __future__ import annotations

from pathlib import Path

# Not on the image (issue 32): the acceptance run's children must not need them.
ABSENT = ("kserve", "gguf", "fastapi", "xgrammar", "zmq", "cbor2", "uvicorn")
# Maybe not on the image (issue 48): only a copy outside site-packages may serve them.
CARRIED_ONLY = ("pytest", "_pytest", "pluggy", "iniconfig", "pygments", "xdist")

_SITECUSTOMIZE = '''\
import sys
from importlib.machinery import PathFinder

ABSENT = {absent!r}
CARRIED_ONLY = {carried!r}


class _MinimalImage:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (minimal image)")
        if top in CARRIED_ONLY and name == top:
            outside = [p for p in sys.path if "site-packages" not in p]
            spec = PathFinder.find_spec(name, outside)
            if spec is None:
                raise ModuleNotFoundError(f"No module named {{name!r}} (minimal image)")
            return spec
        return None


sys.meta_path.insert(0, _MinimalImage())
'''


def minimal_image_site(folder: Path) -> Path:
    """`folder` with a sitecustomize that makes this interpreter look like the image."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(absent=ABSENT, carried=CARRIED_ONLY))
    return folder
