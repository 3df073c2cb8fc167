"""Whether this Python environment can run kserve-paged, checked at start-up before transformers,
torch or KServe is imported.

Two breakages otherwise surface as a traceback from deep inside a dependency:
- an import name of ours that another distribution also provides, where one package's files
  shadow or overwrite the other's (our old top-level `kernels` against Hugging Face's
  `kernels`, which transformers imports; a stale install of ours still declaring it);
- an installed dependency outside the range our distribution declares (pyproject.toml's
  `dependencies`, read here from the installed metadata, so there is one home for them). A
  missing one is left to its import: several load only with the feature that needs them, and
  the GPU image has no kserve or gguf.

Nothing is checked where kserve-paged is not installed (a checkout run from PYTHONPATH, as the
GPU acceptance run does): there is no metadata to hold the environment against.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from importlib import metadata

from packaging.utils import canonicalize_name

DISTRIBUTION = "kserve-paged"
# Our import names: each named for the project, so that no other distribution is likely to own
# one (docs/packaging.md).
PACKAGES = ("kserve_paged", "kserve_paged_engine", "kserve_paged_kernels")
FIX = ("from a checkout, `bash scripts/setup.sh` installs the locked versions "
       "(requirements.lock); elsewhere, `pip install -c requirements.lock kserve-paged`")


class BrokenInstallation(RuntimeError):
    """The environment cannot run kserve-paged; the message says what is wrong and the fix."""


def _ours(dist: metadata.Distribution) -> bool:
    return canonicalize_name(dist.metadata.get("Name") or "") == DISTRIBUTION


def name_clashes(owners: Mapping[str, list[str]] | None = None) -> list[str]:
    """Our import names that another distribution provides too. `owners`: import name ->
    distributions (importlib.metadata.packages_distributions(), the default)."""
    owners = metadata.packages_distributions() if owners is None else owners
    out = []
    for name in PACKAGES:
        others = sorted({d for d in owners.get(name, []) if canonicalize_name(d) != DISTRIBUTION})
        if others:
            out.append(f"the import name `{name}` is provided by {', '.join(others)} as well as "
                       f"by {DISTRIBUTION}: uninstall {others[0]} or rename its package")
    return out


def stale_names(dists: Iterable[metadata.Distribution] | None = None) -> list[str]:
    """Import names an install of ours declares beyond PACKAGES: an older kserve-paged (which
    owned `engine` and `kernels`) still on the path, shadowing what dependencies import."""
    dists = metadata.distributions() if dists is None else dists
    out = []
    for dist in dists:
        if not _ours(dist):
            continue
        declared = set((dist.read_text("top_level.txt") or "").split())
        for name in sorted(declared - set(PACKAGES)):
            where = getattr(dist, "_path", None)  # the dist-info or egg-info folder, when known
            out.append(f"an older {DISTRIBUTION} install declares the import name `{name}`"
                       + (f" ({where}): remove that folder" if where else "")
                       + " and reinstall")
    return out


def version_problems(requirements: Iterable[str] | None = None,
                     installed: Mapping[str, str | None] | None = None) -> list[str]:
    """Installed dependencies outside our declared ranges. `requirements`: Requires-Dist lines
    (ours by default); `installed`: name -> version or None when absent (the environment's, by
    default)."""
    from packaging.requirements import InvalidRequirement, Requirement

    if requirements is None:
        requirements = metadata.requires(DISTRIBUTION) or []
    out = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra's requirement, or another platform's
        if installed is not None:
            version = installed.get(req.name)
        else:
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                version = None
        if version is not None and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} is installed; {DISTRIBUTION} supports "
                       f"{req.name}{req.specifier}")
    return out


def problems() -> list[str]:
    """Everything wrong with this environment, in words; [] when it can run."""
    try:
        metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return []
    return name_clashes() + stale_names() + version_problems()


def check() -> None:
    """Raise BrokenInstallation naming every problem and the fix."""
    found = problems()
    if found:
        raise BrokenInstallation("this Python environment cannot run kserve-paged:\n"
                                 + "\n".join(f"  - {p}" for p in found) + f"\nFix: {FIX}.")


def check_or_exit() -> None:
    """For the command-line entry points: the message on stderr and exit status 2. A check
    that cannot run (metadata it cannot read) warns and lets the process go on."""
    try:
        check()
    except BrokenInstallation as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - the check must never be what stops a server
        print(f"warning: the installation check could not run: {type(exc).__name__}: {exc}",
              file=sys.stderr)
