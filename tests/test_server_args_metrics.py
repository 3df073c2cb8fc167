"""kserve_paged.args (the server's flags) and kserve_paged.metrics (its Prometheus metrics)."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kserve_paged import args as server_args
from kserve_paged import metric_families as mf
from kserve_paged import metrics as m
from kserve_paged_engine.config.engine import EngineConfig
from tests.helpers.metrics_contract import CONTRACT_NAMES, HISTOGRAMS, OWN_NAMES

# What Prometheus 2.x sends when scraping (it prefers OpenMetrics).
PROMETHEUS2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                      "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


# --- args ---------------------------------------------------------------------------------------

def test_defaults_follow_engine_config():
    args = server_args.parse_args([])
    config = EngineConfig()
    for name in server_args.ENGINE_FLAGS:
        assert getattr(args, name) == getattr(config, name), name
    assert args.model_dir == "/mnt/models"
    assert args.http_port == 8080 and args.model_name == "model"  # KServe's own flags


def test_runtime_style_args():
    args = server_args.parse_args([
        "--model_name=paged-llm", "--model_dir=/mnt/models", "--http_port=8080",
        "--grpc_port", "9000", "--dtype=bfloat16", "--block_size=32", "--max_model_len=4096",
        "--max_num_seqs=64", "--max_num_batched_tokens=4096", "--num_kv_blocks=1000",
        "--scheduling_policy=priority", "--no_enable_prefix_caching"])
    assert (args.model_name, args.grpc_port, args.dtype, args.block_size) == (
        "paged-llm", 9000, "bfloat16", 32)
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (4096, 64, 4096)
    assert args.num_kv_blocks == 1000 and args.kv_cache_memory is None
    assert args.scheduling_policy == "priority" and args.enable_prefix_caching is False
    EngineConfig(**server_args.engine_kwargs(args))


@pytest.mark.parametrize("argv,expected", [
    ([], True), (["--enable_prefix_caching"], True), (["--no_enable_prefix_caching"], False),
    (["--enable_prefix_caching=false"], False), (["--enable_prefix_caching", "true"], True),
    (["--no_enable_prefix_caching", "--enable_prefix_caching"], True),
])
def test_prefix_caching_flag(argv, expected):
    assert server_args.parse_args(argv).enable_prefix_caching is expected


@pytest.mark.parametrize("text,expected", [
    ("0.9", 0.9), ("1", 1.0), ("8e9", 8_000_000_000), ("2147483648", 2**31), ("16GiB", 16 * 2**30),
    ("512Mi", 512 * 2**20), ("2G", 2_000_000_000),
])
def test_kv_cache_memory(text, expected):
    value = server_args.parse_args([f"--kv_cache_memory={text}"]).kv_cache_memory
    assert value == expected and isinstance(value, float if expected <= 1 else int)


@pytest.mark.parametrize("argv", [
    ["--dtype=float64"], ["--block_size=0"], ["--block_size=7"], ["--max_num_seqs=-1"],
    ["--kv_cache_memory=0"], ["--kv_cache_memory=lots"], ["--scheduling_policy=lifo"],
    ["--num_kv_blocks=10", "--kv_cache_memory=0.5"], ["--enable_prefix_caching=maybe"],
    ["--model_nme=x"], ["--max_num_seq=8"],  # misspelt / abbreviated flags fail
])
def test_bad_args_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        server_args.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_parser_is_built_on_kserves():
    from kserve.model_server import parser as kserve_parser

    ours = {s for a in server_args.build_parser()._actions for s in a.option_strings}
    theirs = {s for a in kserve_parser._actions for s in a.option_strings}
    assert theirs <= ours
    assert {"--model_dir", "--kv_cache_memory", "--no_enable_prefix_caching"} <= ours


def test_parse_args_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kserve_paged", "--model_name=x"])
    assert server_args.parse_args().model_name == "x"


# --- metrics ------------------------------------------------------------------------------------

def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(samples, name, **labels):
    found = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_metric_names_match_the_contract():
    assert mf.metric_names() == CONTRACT_NAMES | OWN_NAMES
    exposed = mf.exposed_sample_names()
    for name in (CONTRACT_NAMES | OWN_NAMES) - HISTOGRAMS:
        assert name in exposed
    for name in HISTOGRAMS:
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= exposed


def test_exposed_names_in_a_scrape():
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("paged-llm", registry=registry)
    metrics.update({"num_running": 2, "num_waiting": 5, "kv_usage": 0.25,
                    "prefix_cache_queries": 100, "prefix_cache_hits": 60, "num_preemptions": 1,
                    "prompt_tokens": 100, "generation_tokens": 10, "kv_blocks_shared": 21,
                    "kv_cow_copies": 3})
    metrics.set_cache_config(block_size=16, num_gpu_blocks=4096)
    for observe in (metrics.observe_time_to_first_token, metrics.observe_inter_token_latency,
                    metrics.observe_e2e_request_latency, metrics.observe_request_queue_time):
        observe(0.05)
    metrics.observe_iteration_tokens(256)
    text = generate_latest(registry).decode()
    samples = _samples(text)
    names = set(samples)
    assert names >= CONTRACT_NAMES - HISTOGRAMS
    for name in HISTOGRAMS:
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= names
    assert names <= mf.exposed_sample_names()
    # No doubled suffix, no colon lost.
    assert not [n for n in names if "_total_total" in n or n.startswith("vllm_")]
    assert _value(samples, "vllm:num_requests_waiting", model_name="paged-llm") == 5
    assert _value(samples, "vllm:kv_cache_usage_perc", model_name="paged-llm") == 0.25
    assert _value(samples, "vllm:prefix_cache_hits_total", model_name="paged-llm") == 60
    assert _value(samples, "kserve_paged:kv_blocks_shared", model_name="paged-llm") == 21
    assert _value(samples, "kserve_paged:kv_cow_copies_total", model_name="paged-llm") == 3
    assert _value(samples, "vllm:cache_config_info", model_name="paged-llm", block_size="16",
                  num_gpu_blocks="4096") == 1
    assert _value(samples, "vllm:time_to_first_token_seconds_count", model_name="paged-llm") == 1
    assert _value(samples, "vllm:iteration_tokens_total_sum", model_name="paged-llm") == 256


def test_counters_take_increases_of_cumulative_stats():
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("a", registry=registry)

    def prompt_tokens():
        return _value(_samples(generate_latest(registry).decode()), "vllm:prompt_tokens_total",
                      model_name="a")

    metrics.update({"prompt_tokens": 10})
    metrics.update({"prompt_tokens": 25})
    assert prompt_tokens() == 25
    metrics.update({"num_running": 1})  # counters left alone
    assert prompt_tokens() == 25
    metrics.update({"prompt_tokens": 4})  # the engine restarted: counts from 0 again
    assert prompt_tokens() == 29


def test_gauge_only_updates_never_touch_counters():
    """start_engine's snapshot may be older than the step callback's latest: applied as a
    counter update it would read as a restart and count everything twice."""
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("a", registry=registry)
    metrics.update({"prompt_tokens": 50, "num_waiting": 1})
    metrics.update({"prompt_tokens": 20, "num_waiting": 4}, counters=False)  # stale snapshot
    metrics.update({"prompt_tokens": 60})
    samples = _samples(generate_latest(registry).decode())
    assert _value(samples, "vllm:prompt_tokens_total", model_name="a") == 60
    assert _value(samples, "vllm:num_requests_waiting", model_name="a") == 4


def test_cache_config_info_keeps_one_series():
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("a", registry=registry)
    metrics.set_cache_config(16, 100)
    metrics.set_cache_config(16, 200)
    samples = _samples(generate_latest(registry).decode())["vllm:cache_config_info"]
    assert [s.labels["num_gpu_blocks"] for s in samples] == ["200"]


def test_two_instances_and_two_models_share_the_registry():
    registry = CollectorRegistry()
    first, second = m.EngineMetrics("a", registry=registry), m.EngineMetrics("a", registry=registry)
    other = m.EngineMetrics("b", registry=registry)
    first.update({"num_waiting": 3})
    other.update({"num_waiting": 7})
    samples = _samples(generate_latest(registry).decode())
    assert _value(samples, "vllm:num_requests_waiting", model_name="a") == 3
    assert _value(samples, "vllm:num_requests_waiting", model_name="b") == 7
    assert second.model_name == "a"


def test_default_registry_is_what_kserve_serves():
    m.EngineMetrics("default-registry-test")
    m.EngineMetrics("default-registry-test")  # no duplicate-registration error
    names = set(_samples(generate_latest(REGISTRY).decode()))
    assert "vllm:num_requests_running" in names and "vllm:prompt_tokens_total" in names


def test_render_keeps_vllm_names_whatever_the_scraper_asks():
    registry = CollectorRegistry()
    m.EngineMetrics("a", registry=registry).update({"num_waiting": 1, "prompt_tokens": 3})
    for accept in (None, "", "text/plain;version=0.0.4", PROMETHEUS2_ACCEPT,
                   "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
                   "text/plain;version=1.0.0;escaping=underscores"):
        body, content_type = mf.render(accept, registry)
        text = body.decode()
        assert "vllm:num_requests_waiting{" in text and "vllm:prompt_tokens_total{" in text, accept
        assert "vllm_" not in text, (accept, content_type)


def test_model_id_names_a_packaged_model_and_excludes_model_dir(capsys):
    assert server_args.parse_args(["--model_id=gemma3-270m"]).model_id == "gemma3-270m"
    assert server_args.parse_args([]).model_id is None
    with pytest.raises(SystemExit):
        server_args.parse_args(["--model_id=gpt-5"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_args.parse_args(["--model_id=gemma3-270m", "--model_dir=/mnt/models"])
    assert "give one" in capsys.readouterr().err
