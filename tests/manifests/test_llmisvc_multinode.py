"""manifests/llmisvc-multinode: the multi-node LLMInferenceService against KServe's v0.20 CRD,
and its two pods' command lines against our server as a LeaderWorkerSet starts them: the
leader's and the worker's argv parse, read their place from the LWS variables, and agree with
spec.parallelism and the GPUs each pod asks for."""

from __future__ import annotations

import copy

import pytest

from kserve_paged import args as server_args
from kserve_paged.multi_node_flags import node_layout
from kserve_paged.vllm_cli import serve_argv
from tests.helpers import manifests as h

(MULTINODE,) = [o for o in h.objects_of_kind("LLMInferenceService")
                if o["metadata"]["name"] == "kserve-paged-multinode"]
LWS_VARIABLES = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def _main(pod: dict) -> dict:
    (container,) = [c for c in pod["containers"] if c["name"] == "main"]
    return container


def _group_size(parallelism: dict) -> int:
    """The pods per group KServe's controller makes (ParallelismSpec.GetSize, v0.20)."""
    if parallelism.get("data") or parallelism.get("dataLocal"):
        return max(max(parallelism.get("data", 1), 1) // max(parallelism.get("dataLocal", 1), 1),
                   1)
    return parallelism.get("pipeline") or 1


def test_validates_against_the_crd_with_a_worker_and_parallelism():
    assert MULTINODE["apiVersion"] == "serving.kserve.io/v1alpha2"
    assert {"worker", "parallelism"} <= set(MULTINODE["spec"])
    assert h.crd_errors(MULTINODE) == []
    for pod in (MULTINODE["spec"]["template"], MULTINODE["spec"]["worker"]):
        assert _main(pod)["image"] == "kserve-paged"  # the kustomization's image


@pytest.mark.parametrize("breakage", ["tensor_zero", "worker_not_a_pod", "port_text"])
def test_broken_variants_fail_validation(breakage):
    broken = copy.deepcopy(MULTINODE)
    if breakage == "tensor_zero":
        broken["spec"]["parallelism"]["tensor"] = 0
    elif breakage == "worker_not_a_pod":
        broken["spec"]["worker"] = "two pods"
    else:
        broken["spec"]["parallelism"]["dataRPCPort"] = "rpc"
    assert h.crd_errors(broken)


def test_each_pod_is_its_part_of_one_tensor_parallel_group(monkeypatch):
    spec = MULTINODE["spec"]
    size = _group_size(spec["parallelism"])
    layouts = []
    for index, pod in enumerate((spec["template"], spec["worker"])):
        main = _main(pod)
        assert main["command"] == ["vllm"] and main["args"][0] == "serve"
        monkeypatch.setenv("LWS_LEADER_ADDRESS", "kserve-paged-multinode-0.lws.svc")
        monkeypatch.setenv("LWS_GROUP_SIZE", str(size))
        monkeypatch.setenv("LWS_WORKER_INDEX", str(index))
        parsed = server_args.parse_args(serve_argv(main["args"][1:]))
        layout = node_layout(parsed)
        assert layout is not None and layout.node_rank == index
        assert layout.nnodes == size and layout.master_addr.startswith("kserve-paged-multinode")
        tp = parsed.tensor_parallel_size
        assert tp == spec["parallelism"]["tensor"]
        gpus = main["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) == layout.ranks_per_node(tp)
        layouts.append(layout)
    leader, worker = layouts
    assert leader.is_leader and not worker.is_leader
    assert leader.master_port == worker.master_port
    ports = {p["containerPort"] for p in _main(spec["template"])["ports"]}
    assert leader.master_port in ports  # the rendezvous is open on the leader pod
