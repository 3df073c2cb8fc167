"""`kubectl kustomize` builds every kustomization offline, and what it builds validates.

kubectl comes from Debian's kubernetes-client (scripts/setup.sh installs it when missing). The
tests skip only when no kubectl is available, and say so. The kustomizations stay compatible with
kubectl 1.20's kustomize v2.0 (Debian bookworm) as well as current kustomize v5."""

from __future__ import annotations

import json

import pytest

from tests.helpers import manifests as h
from tests.helpers import monitoring_checks as mon

needs_kubectl = pytest.mark.skipif(
    h.kubectl() is None,
    reason="kubectl not found: scripts/setup.sh installs it (apt-get install kubernetes-client) "
           "and could not here (no apt-get, no root/sudo, or the install failed)")

DIRS = h.kustomization_dirs()
OVERLAYS = h.overlay_dirs()


def _rel(p):
    return str(p.relative_to(h.REPO))


@pytest.fixture(scope="module")
def builds():
    return {d: h.kustomize_build(d) for d in DIRS}


def test_overlays_exist():
    assert {p.name for p in OVERLAYS} == {"gpu", "gpu-tp", "cpu", "cpu-lora", "cpu-embed"}


@needs_kubectl
@pytest.mark.parametrize("directory", DIRS, ids=[_rel(d) for d in DIRS])
def test_kustomize_builds_and_validates(directory, builds):
    objects = builds[directory]
    assert objects, f"{_rel(directory)} builds nothing"
    for obj in objects:
        if h.is_kserve(obj):
            assert h.crd_errors(obj) == [], h.describe(obj)
        elif h.is_core(obj):
            assert h.core_errors(obj) == [], h.describe(obj)
        elif obj["kind"] == "PodMonitor":
            assert mon.podmonitor_errors(obj) == []
        else:
            pytest.fail(f"unexpected object {h.describe(obj)}")


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[o.name for o in OVERLAYS])
def test_overlay_contents(overlay, builds):
    objects = builds[overlay]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ClusterServingRuntime", "InferenceService", "PodMonitor",
                            "ConfigMap"])
    by_kind = {o["kind"]: o for o in objects}
    runtime, isvc = by_kind["ClusterServingRuntime"], by_kind["InferenceService"]
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    image = runtime["spec"]["containers"][0]["image"]
    assert "/" in image and ":" in image, f"runtime image not set by the overlay: {image}"
    ns = by_kind["Namespace"]["metadata"]["name"]
    for kind in ("InferenceService", "PodMonitor", "ConfigMap"):
        assert by_kind[kind]["metadata"]["namespace"] == ns, kind
    assert h.deployment_mode_errors(isvc) == []
    dashboard = (h.MANIFESTS / "monitoring" / "kserve-paged-dashboard.json").read_text()
    (body,) = by_kind["ConfigMap"]["data"].values()
    assert json.loads(body) == json.loads(dashboard)
    # The sources, as the tests without kubectl check them, are what kustomize emits.
    sources = {h.describe(o): o for _, o in h.all_objects()}
    for obj in objects:
        if obj["kind"] != "ClusterServingRuntime":  # its image is set by the overlay
            assert obj == sources[h.describe(obj)], h.describe(obj)


@needs_kubectl
def test_overlays_agree_on_the_cluster_wide_runtime(builds):
    runtimes = [next(o for o in builds[d] if o["kind"] == "ClusterServingRuntime")
                for d in OVERLAYS]
    assert all(r == runtimes[0] for r in runtimes), (
        "applying one overlay after the other would change the shared ClusterServingRuntime")
