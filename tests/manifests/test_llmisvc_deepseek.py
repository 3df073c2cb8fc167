"""manifests/llmisvc-deepseek: the single-node DeepSeek LLMInferenceService against KServe's
v0.20 CRD (test_schemas.py and test_kustomize.py validate it with every other manifest), the
preset's command line against our server, and the model against the engine: its architecture
is one the engine serves and the planner fits it on the GPU the pod asks for."""

from __future__ import annotations

import copy

import pytest

from kserve_paged import args as server_args
from tests.helpers import manifests as h

(DEEPSEEK,) = [o for o in h.objects_of_kind("LLMInferenceService")
               if o["metadata"]["name"] == "kserve-paged-deepseek"]
# The model's config.json (DeepSeek-Coder-V2-Lite-Instruct's, no weights).
CONFIG = h.REPO / "tests" / "data" / "models" / "deepseek-coder-v2-lite"


def _main() -> dict:
    (container,) = [c for c in DEEPSEEK["spec"]["template"]["containers"]
                    if c["name"] == "main"]
    return container


def test_validates_against_the_crd_as_one_pod():
    assert DEEPSEEK["apiVersion"] == "serving.kserve.io/v1alpha2"
    assert not {"worker", "parallelism"} & set(DEEPSEEK["spec"])  # single node
    assert h.crd_errors(DEEPSEEK) == []
    assert _main()["image"] == "kserve-paged"
    assert _main()["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("breakage", ["no_uri", "replicas_text"])
def test_broken_variants_fail_validation(breakage):
    broken = copy.deepcopy(DEEPSEEK)
    if breakage == "no_uri":
        del broken["spec"]["model"]["uri"]
    else:
        broken["spec"]["replicas"] = "one"
    assert h.crd_errors(broken)


def test_the_presets_command_runs_our_server_and_the_model_fits_one_gpu(tmp_path):
    """The preset's `vllm serve` with this spec's args parses; the architecture is served
    (multi-head latent attention) and `kserve-paged plan` with the parsed flags fits full-length
    sequences on one 80 GB GPU."""
    from kserve_paged.plan import make_plan, parse_device
    from kserve_paged.vllm_cli import serve_argv
    from kserve_paged.vllm_flags import VLLM_CLI_VERSION
    from kserve_paged_engine.model_executor.model_facts import describe_folder
    from tests.helpers.llmisvc_preset import Preset, preset_argv

    argv = preset_argv(Preset.of(DEEPSEEK), tmp_path, VLLM_CLI_VERSION)
    parsed = server_args.parse_args(serve_argv(argv[1:]))
    assert parsed.model_dir == "/mnt/models" and parsed.model_name == "deepseek-coder-v2-lite"
    facts = describe_folder(CONFIG)
    assert facts.architecture == "DeepseekV2ForCausalLM" and facts.kv_latent_dim == 576
    plan = make_plan(facts, parse_device("h100-80gb"), dtype=parsed.dtype,
                     max_model_len=parsed.max_model_len, max_num_seqs=parsed.max_num_seqs,
                     kv_cache_memory=parsed.kv_cache_memory)
    assert plan.kv_bytes_per_token == 27 * 576 * 2
    assert plan.max_full_length_sequences >= parsed.max_num_seqs // 4
