"""Our `kernels` package must not be mistaken for Hugging Face's `kernels` hub package.

Why this can break: transformers 5.x asks `is_kernels_available()` before using hub kernels. It
finds *any* importable top-level `kernels` (ours), then reads the version of the distribution
that provides it: `packages_distributions()` maps `kernels` to `kserve-paged`, the project that
ships it. It accepts versions in [0.18.2, 0.19.0). Were our project version in that window,
transformers would take our package for theirs and `from kernels import get_kernel, ...` from
it, failing (or choosing a wrong attention path) while importing or running any model. We keep
the version at 0.1.0, so the check is false. (Measured with transformers 5.24 at 0.18.5: even
`from transformers import LlamaForCausalLM` fails, with `ImportError: cannot import name
'CUDAProperties' from 'kernels'` raised in transformers/integrations/hub_kernels.py.)

The checks run in a fresh interpreter "with this project installed": the real install when there
is one, else a minimal dist-info at pyproject's version (what `pip install -e .` records), so the
result does not depend on how this checkout was set up. `test_project_version_is_below_the_window`
catches a version bump into the window before it ships.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Runs in the child: transformers' own verdict, plus a tiny Llama built, saved, reloaded, run.
_CHILD = r"""
import json, sys, tempfile
import importlib.util, importlib.metadata
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils

spec = importlib.util.find_spec("kernels")
found, version = import_utils._is_package_available("kernels", return_version=True)
result = {"origin": spec.origin if spec else None, "found": found, "version": version,
          "available": import_utils.is_kernels_available(),
          "window": [import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION]}
if sys.argv[1] == "run-model":
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.inference_mode():
        logits = model(ids).logits
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        loaded = LlamaForCausalLM.from_pretrained(d, local_files_only=True).eval()
        with torch.inference_mode():
            out = loaded.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
            same = torch.allclose(loaded(ids).logits, logits)
    result["model"] = {"logits_shape": list(logits.shape), "finite": bool(logits.isfinite().all()),
                       "reload_same": same, "generated_shape": list(out.shape)}
print("RESULT " + json.dumps(result))
"""


def _pyproject_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match, "no version in pyproject.toml"
    return match.group(1)


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("kserve-paged")
    except importlib.metadata.PackageNotFoundError:
        return None


def _fake_install(root: Path, version: str) -> Path:
    """A dist-info like the one `pip install -e .` writes, naming our top-level packages."""
    info = root / f"kserve_paged-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: kserve-paged\nVersion: {version}\n")
    (info / "top_level.txt").write_text("engine\nkernels\nkserve_paged\n")
    return root


def _run_child(mode: str, extra_path: Path | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    paths = [str(extra_path)] if extra_path else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", _CHILD, mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _child(mode: str, extra_path: Path | None) -> dict:
    proc = _run_child(mode, extra_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_project_version_is_below_the_window() -> None:
    from packaging.version import Version
    from transformers.utils import import_utils

    low = Version(import_utils.KERNELS_MIN_VERSION)
    for version in filter(None, (_pyproject_version(), _installed_version())):
        assert Version(version) < low, (
            f"kserve-paged {version} is inside transformers' window for HF `kernels` "
            f"[{import_utils.KERNELS_MIN_VERSION}, {import_utils.KERNELS_MAX_VERSION})")


@pytest.mark.slow
def test_installed_project_is_not_taken_for_hf_kernels(tmp_path: Path) -> None:
    installed = _installed_version()
    extra = None if installed else _fake_install(tmp_path, _pyproject_version())
    result = _child("run-model", extra)
    # transformers does find our `kernels` and reads our distribution's version...
    assert result["origin"] and Path(result["origin"]).resolve().is_relative_to(REPO)
    assert result["found"] is True
    assert result["version"] == (installed or _pyproject_version())
    # ...and rejects it only because that version is outside its window.
    assert result["available"] is False
    assert result["model"] == {"logits_shape": [1, 4, 64], "finite": True, "reload_same": True,
                               "generated_shape": [1, 7]}
