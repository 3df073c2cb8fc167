"""``kserve-paged plan --write-overlay DIR``: a kustomize overlay carrying a plan's flags.

The overlay is the shipped one for the device kind (manifests/overlays/gpu or cpu) with the
InferenceService's engine args and resources replaced, so it inherits the runtime, monitoring
and (GPU) KEDA scaling, and the manifest tests validate it as they do the shipped overlays.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kserve_paged.plan import Plan, keda_target, resources

REPO_MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


def write_overlay(plan: Plan, directory: Path, manifests: Path = REPO_MANIFESTS) -> Path:
    """Write DIR/kustomization.yaml and DIR/inferenceservice.yaml; refuse a plan the engine
    could not serve (not one sequence fits). Tensor parallelism on GPUs starts from the
    gpu-tp overlay (N GPUs in one pod)."""
    if not plan.fits:
        raise ValueError("--write-overlay: the plan does not fit the device")
    if plan.nnodes > 1:  # an InferenceService is one pod per replica
        raise ValueError("--write-overlay writes single-pod InferenceServices; a multi-node "
                         "layout starts from manifests/llmisvc-multinode (its flags above)")
    kind = "cpu" if plan.device.kind != "cuda" else "gpu-tp" if plan.tp > 1 else "gpu"
    source = manifests / "overlays" / kind
    if not (source / "inferenceservice.yaml").is_file():
        raise ValueError(f"--write-overlay needs the repository's manifests/ (not found: {source})")
    isvc = yaml.safe_load((source / "inferenceservice.yaml").read_text())
    model = isvc["spec"]["predictor"]["model"]
    model["args"] = plan.server_flags()
    model["resources"] = resources(plan)
    if plan.device.kind == "cuda":
        (metric,) = isvc["spec"]["predictor"]["autoScaling"]["metrics"]
        name, ns = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
        selector = f'{{namespace="{ns}", pod=~"{name}-predictor-.*"}}'
        metric["external"]["metric"]["query"] = (
            f"sum(vllm:num_requests_running{selector}) + "
            f"sum(vllm:num_requests_waiting{selector})")
        # KServe hands target.value to KEDA as the threshold: replicas = ceil(query / value).
        metric["external"]["target"] = {"type": "Value", "value": str(keda_target(plan))}
    kustomization = yaml.safe_load((source / "kustomization.yaml").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(manifests, directory.resolve())
    kustomization["bases"] = [f"{rel}/base", f"{rel}/monitoring"]
    header = (f"# Written by `kserve-paged plan` for {plan.device.name}, max_model_len "
              f"{plan.max_model_len}, workload {plan.workload[0]}:{plan.workload[1]}.\n")
    (directory / "kustomization.yaml").write_text(header + yaml.safe_dump(kustomization,
                                                                          sort_keys=False))
    (directory / "inferenceservice.yaml").write_text(header + yaml.safe_dump(isvc,
                                                                             sort_keys=False))
    return directory
