"""The capacity planner (kserve_paged/plan.py, `kserve-paged plan`).

Llama-3-8B and Llama-3-70B (their config.json files in tests/data/models, no weights) on h100
and h200 with TP 1, 4 and 8 against a hand computation; the planner's KV-block figure against
what the engine allocates at start-up for the same budget; the overlay it writes validated as
the shipped overlays are.
"""

from __future__ import annotations

import pytest

from kserve_paged import args as server_args
from kserve_paged.__main__ import main as cli_main
from kserve_paged.plan import GPUS, make_plan, parse_device
from kserve_paged.plan_overlay import write_overlay
from kserve_paged_engine.model_executor.model_facts import describe_folder
from tests.helpers import manifests as h
from tests.helpers import monitoring_checks as mon

MODELS = h.REPO / "tests" / "data" / "models"
GiB, MiB = 2**30, 2**20


def shape(name: str):
    return describe_folder(MODELS / name)


def test_parameter_counts_are_the_published_ones():
    # Meta's model cards: 8,030,261,248 and 70,553,706,496 parameters.
    assert shape("llama-3-8b").num_params == 8_030_261_248
    assert shape("llama-3-70b").num_params == 70_553_706_496


# (model, params, layers, kv heads) -- and by hand: bf16 is 2 bytes, a KV-cache token holds
# K and V of every layer, the heads split over TP devices (8 KV heads: 8/TP per device), the
# engine takes 85% of what is free once weights and 1 GiB of runtime are in, 16-token blocks.
CASES = [(m, gpu, tp) for m in ("llama-3-8b", "llama-3-70b") for gpu in ("h100-80gb", "h200")
         for tp in (1, 4, 8)]
BY_HAND = {"llama-3-8b": (8_030_261_248, 32), "llama-3-70b": (70_553_706_496, 80)}
MEMORY = {"h100-80gb": 81559 * MiB, "h200": 143771 * MiB}  # nvidia-smi's totals


@pytest.mark.parametrize("model, gpu, tp", CASES)
def test_figures_match_a_hand_computation(model, gpu, tp):
    params, layers = BY_HAND[model]
    plan = make_plan(shape(model), parse_device(gpu), max_model_len=8192, tp=tp)
    weights = -(-params * 2 // tp)
    kv_per_token = 2 * layers * (8 // tp) * 128 * 2
    free = MEMORY[gpu] - weights - 1 * GiB
    blocks = int(0.85 * free) // (16 * kv_per_token) if free > 0 else 0
    assert plan.weights_bytes == weights
    assert plan.kv_bytes_per_token == kv_per_token
    assert plan.free_bytes == free
    assert plan.kv_blocks == blocks
    assert plan.max_full_length_sequences == plan.recommended_blocks // 512  # 8192 / 16
    assert plan.fits == (plan.recommended_blocks >= 512)


def test_readme_hand_check():
    """The worked example in docs/operations.md: Llama-3-8B, one H100 80GB, 8192 tokens."""
    plan = make_plan(shape("llama-3-8b"), parse_device("h100-80gb"), max_model_len=8192,
                     workload=(512, 128))
    assert plan.weights_bytes == 16_060_522_496
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_blocks == 27_717
    assert plan.max_full_length_sequences == 54
    assert plan.workload_sequences == 692 and plan.batch == 256
    # Decode floor, one sequence: 3.35 TB/s over the weights plus 576 tokens of KV.
    assert plan.decode_tokens_per_second(1) == pytest.approx(
        3.35e12 / (16_060_522_496 + 576 * 131_072))
    assert round(plan.decode_tokens_per_second(1)) == 208


def test_70b_needs_more_than_one_h100_and_fits_on_four():
    assert not make_plan(shape("llama-3-70b"), parse_device("h100-80gb"), tp=1).fits
    plan = make_plan(shape("llama-3-70b"), parse_device("h100-80gb"), tp=4, max_model_len=8192)
    assert plan.fits and plan.max_full_length_sequences >= 60


def test_kv_heads_are_replicated_past_their_number():
    """8 KV heads over 16 devices: one per device, as a tensor-parallel runtime replicates."""
    cfg = shape("llama-3-70b")
    assert make_plan(cfg, parse_device("h200"), tp=16).kv_bytes_per_token == \
        make_plan(cfg, parse_device("h200"), tp=8).kv_bytes_per_token


def test_the_engine_allocates_what_the_planner_says(monkeypatch):
    """The default model on CPU: the planner reads only its config.json, the engine loads it.
    Per-block bytes and weights agree with the loaded model, and for the budget the planner
    predicts (cpu:2, i.e. what is free after the weights) the engine's start-up sizing allocates
    the planner's block count; so does an explicit --kv_cache_memory."""
    import torch

    import kserve_paged_engine.core.kv_sizing as kv_sizing
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend import startup
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    model_dir = ensure_default_model(progress=lambda _: None)
    cfg = describe_folder(model_dir)
    plan = make_plan(cfg, parse_device("cpu:2"), max_model_len=1024)
    assert plan.free_bytes > 0 and plan.dtype == torch.float32
    monkeypatch.setattr(kv_sizing, "available_memory", lambda device: plan.free_bytes)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024))
    try:
        assert engine.num_kv_blocks == plan.kv_blocks
        held = sum(c.numel() * c.element_size() for c in engine.runner.slot_caches)
        assert held == plan.kv_bytes_per_block * engine.num_kv_blocks
        assert plan.kv_bytes_per_block == plan.kv_bytes_per_token * 16
        params = {id(p): p for p in engine.model.parameters()}.values()
        assert sum(p.numel() for p in params) == cfg.num_params
        explicit = make_plan(cfg, parse_device("cpu:2"), max_model_len=1024,
                             kv_cache_memory=64 * MiB)
        size = startup.size_cache(EngineConfig(kv_cache_memory=64 * MiB), engine.model, None,
                                  engine.dtype, torch.device("cpu"))
        assert size.num_blocks == explicit.kv_blocks
    finally:
        engine.close()


def test_cli_prints_the_figures(capsys):
    assert cli_main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpu", "h100-80gb",
                     "--max_model_len", "8192", "--workload", "512:128"]) == 0
    out = capsys.readouterr().out
    for needle in ("weights      14.96 GiB", "KV blocks    27717", "sequences    54",
                   "decode floor 208 tok/s", "--num_kv_blocks=27717", "nvidia.com/gpu"):
        assert needle in out, needle
    flags = out.split("flags        ")[1].splitlines()[0].split()
    server_args.parse_args(flags)  # the server accepts every recommended flag


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "v100"], "--gpu must be one of"),
    (["--gpu", "cpu:x"], "cpu:<GiB>"),
    (["--gpu", "h200", "--workload", "512"], "prompt:output"),
    (["--gpu", "h200", "--max_model_len", "100000"], "max_position_embeddings"),
    (["--gpu", "h200", "--tensor_parallel_size", "12"], "does not divide"),
])
def test_bad_input_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", "--model", str(MODELS / "llama-3-8b"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_every_gpu_of_the_table_plans():
    for gpu in GPUS:
        assert make_plan(shape("llama-3-8b"), parse_device(gpu), max_model_len=4096).fits


@pytest.mark.skipif(h.kubectl() is None, reason="kubectl not found (scripts/setup.sh)")
@pytest.mark.parametrize("gpu", ["h100-80gb", "cpu:64"])
def test_written_overlay_validates_like_the_shipped_ones(gpu, tmp_path):
    model = "llama-3-8b"
    plan = make_plan(shape(model), parse_device(gpu), max_model_len=4096)
    directory = write_overlay(plan, tmp_path / "overlay")
    objects = h.kustomize_build(directory)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ClusterServingRuntime", "InferenceService",
                            "PodMonitor", "ConfigMap"])
    for obj in objects:
        if h.is_kserve(obj):
            assert h.crd_errors(obj) == [], h.describe(obj)
        elif h.is_core(obj):
            assert h.core_errors(obj) == [], h.describe(obj)
        else:
            assert mon.podmonitor_errors(obj) == []
    by_kind = {o["kind"]: o for o in objects}
    isvc = by_kind["InferenceService"]
    assert h.deployment_mode_errors(isvc) == []
    container = h.rendered_container(by_kind["ClusterServingRuntime"], isvc)
    parsed = server_args.parse_args(container["args"])
    assert parsed.num_kv_blocks == plan.recommended_blocks
    assert parsed.max_model_len == 4096
    if plan.device.kind == "cuda":
        assert mon.keda_errors(isvc) == []
        (metric,) = isvc["spec"]["predictor"]["autoScaling"]["metrics"]
        assert mon.keda_query_scope_errors(isvc, metric["external"]["metric"]["query"]) == []
        assert isvc["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_overlay_is_refused_for_what_the_engine_cannot_serve(tmp_path):
    with pytest.raises(ValueError, match="does not fit"):
        write_overlay(make_plan(shape("llama-3-70b"), parse_device("h100-80gb")), tmp_path)


def test_tensor_parallel_plan_shards_as_the_engine_does():
    """The KV heads a rank holds come from the engine's layout: SmolLM2's 3 KV heads over 2
    ranks are 2 + 1, and rank 0 (which sizes the cache) holds 2; 8 over 3 are 3 + 3 + 2."""
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.model_executor.tp_layout import TPLayout

    smol = describe_folder(ensure_default_model(progress=lambda _: None))
    plan = make_plan(smol, parse_device("h200"), max_model_len=2048, tp=2)
    rank0 = TPLayout.of(smol.num_heads, smol.num_kv_heads, smol.head_dim,
                        smol.intermediate_size, smol.vocab_size, 0, 2)
    assert rank0.kv_heads == (0, 2)
    assert plan.kv_bytes_per_token == 2 * smol.num_layers * 2 * smol.head_dim * 2
    assert "--tensor_parallel_size=2" in plan.server_flags()
    eight = make_plan(shape("llama-3-8b"), parse_device("h200"), max_model_len=4096, tp=3)
    assert eight.kv_bytes_per_token == 2 * 32 * 3 * 128 * 2
    with pytest.raises(ValueError, match="does not divide"):
        make_plan(shape("llama-3-8b"), parse_device("h200"), tp=12)


@pytest.mark.skipif(h.kubectl() is None, reason="kubectl not found (scripts/setup.sh)")
def test_tensor_parallel_overlay_validates_with_one_gpu_per_rank(tmp_path):
    plan = make_plan(shape("llama-3-70b"), parse_device("h100-80gb"), tp=4, max_model_len=8192)
    directory = write_overlay(plan, tmp_path / "overlay")
    objects = h.kustomize_build(directory)
    by_kind = {o["kind"]: o for o in objects}
    isvc = by_kind["InferenceService"]
    assert h.crd_errors(isvc) == [] and mon.keda_errors(isvc) == []
    container = h.rendered_container(by_kind["ClusterServingRuntime"], isvc)
    assert server_args.parse_args(container["args"]).tensor_parallel_size == 4
    resources = isvc["spec"]["predictor"]["model"]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "4"
