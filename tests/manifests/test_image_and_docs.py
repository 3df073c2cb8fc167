"""The runtime image's Dockerfile (docker is not available here, so it is read, not built) and
the "Deploy on KServe" documentation."""

from __future__ import annotations

import json
import re

import pytest

from kserve_paged import args as server_args
from tests.helpers import manifests as h
from tests.helpers.layout import PACKAGES

DOCKERFILE = h.MANIFESTS / "image" / "Dockerfile"
README = h.MANIFESTS / "README.md"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        part = stripped.removesuffix("\\").strip()
        current = f"{current} {part}" if current else part
        if not stripped.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


INSTR = instructions(DOCKERFILE.read_text())


def _final_stage() -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(INSTR) if k == "FROM")
    return INSTR[last_from:]


def test_variant_build_argument_selects_cpu_or_cuda():
    first_from = next(i for i, (k, _) in enumerate(INSTR) if k == "FROM")
    global_args = dict(a.partition("=")[::2] for k, a in INSTR[:first_from] if k == "ARG")
    assert global_args.get("VARIANT") in ("cpu", "cuda")
    stages = {m.group(1) for k, a in INSTR if k == "FROM"
              for m in [re.search(r"\bAS\s+(\S+)", a, re.I)] if m}
    assert {"torch-cpu", "torch-cuda"} <= stages
    assert _final_stage()[0][1].split()[0] == "torch-${VARIANT}"
    text = DOCKERFILE.read_text()
    assert "download.pytorch.org/whl/cpu" in text and "download.pytorch.org/whl/cu" in text


def test_runs_as_non_root_on_port_8080():
    users = [a for k, a in INSTR if k == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root uid (runAsNonRoot)"
    assert [a for k, a in _final_stage() if k == "EXPOSE"] == ["8080"]


def test_entrypoint_matches_the_runtime_and_its_args_parse():
    final = dict(_final_stage())
    entrypoint, cmd = json.loads(final["ENTRYPOINT"]), json.loads(final["CMD"])
    (runtime,) = h.objects_of_kind("ClusterServingRuntime")
    assert entrypoint == runtime["spec"]["containers"][0]["command"]
    args = server_args.parse_args(cmd)
    assert args.model_dir == "/mnt/models" and args.http_port == 8080


def test_copies_every_package_of_the_project_and_the_lock():
    # The top folder of each package (pyproject's source roots: engine/, kernels/, the root).
    folders = {folder.relative_to(h.REPO).parts[0] for folder in PACKAGES.values()}
    assert folders == {"engine", "kernels", "kserve_paged"}
    copied = {src.rstrip("/") for k, a in INSTR if k == "COPY"
              for src in a.split()[:-1] if not src.startswith("--")}
    assert "pyproject.toml" in copied
    for folder in folders:
        assert folder in copied, f"{folder}/ not copied into the image"
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    for folder in folders:
        assert f"!{folder}/" in ignore
    assert "!requirements.lock" in ignore


def test_every_pip_install_takes_the_lock():
    """Both torch stages make /tmp/constraints.txt from requirements.lock (the CUDA one without
    Triton, which its torch build pins); every pip install takes it."""
    for stage in ("torch-cpu", "torch-cuda"):
        start = next(i for i, (k, a) in enumerate(INSTR) if k == "FROM" and a.endswith(stage))
        body = INSTR[start + 1:next(i for i, (k, _) in enumerate(INSTR) if k == "FROM" and i > start)]
        made = [a for k, a in body if "requirements.lock" in a and "/tmp/constraints.txt" in a]
        assert made, f"{stage} does not make /tmp/constraints.txt from requirements.lock"
    installs = [a for k, a in INSTR if k == "RUN" and "pip install" in a]
    assert len(installs) == 3  # torch (cpu), torch (cuda), the project
    for run in installs:
        assert re.search(r"pip install [^&]*-c /tmp/constraints\.txt", run), run


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_readme_deploy_section(readme):
    assert re.search(r"^#+ Deploy on KServe", readme, re.M)
    for needle in ("kubectl apply -k manifests/overlays/gpu", "storageUri", "KEDA",
                   "Prometheus", "Grafana", "grafana_dashboard", "docker build -f",
                   "manifests/image/Dockerfile", "KServe 0.20"):
        assert needle in readme, needle
    for heading in ("Prerequisites", "Set the model", "Watch the dashboard", "Build the image"):
        assert re.search(rf"^#+ {heading}", readme, re.M), heading


def test_readme_paths_exist(readme):
    for rel in set(re.findall(r"`((?:manifests/|overlays/|monitoring/|base/|image/)[\w./-]*[\w/])",
                              readme)):
        if "<" in rel:
            continue
        path = h.REPO / rel if rel.startswith("manifests/") else h.MANIFESTS / rel
        assert path.exists(), rel
