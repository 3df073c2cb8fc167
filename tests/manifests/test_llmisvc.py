"""manifests/llmisvc: the LLMInferenceService against KServe's v0.20 CRD (test_schemas.py and
test_kustomize.py validate it with every other manifest) and against the server and the
presets it is merged over: the flags parse, the port is the one the InferencePool and the
HTTPRoute target, the probes hit the model's routes, the picker scores on metrics the server
exports, the PodMonitor scrapes the pods."""

from __future__ import annotations

import copy

import pytest

from kserve_paged import args as server_args
from kserve_paged import metric_families as server_metrics
from tests.helpers import manifests as h

# The single-pod service (llmisvc-multinode/ has its own tests, test_llmisvc_multinode.py).
(LLMISVC,) = [o for o in h.objects_of_kind("LLMInferenceService")
              if o["metadata"]["name"] == "kserve-paged"]
(PODMONITOR,) = h.objects_of_kind("PodMonitor")
# KServe v0.20's presets (config/llmisvcconfig/): the InferencePool's targetPorts and the
# HTTPRoute's backend port are 8000, and the route rewrites to vLLM's /v1 paths.
PRESET_PORT = 8000
ROUTED_PATHS = {"/v1/completions": {"prompt": "x"},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]}}
# What the Gateway API Inference Extension's picker reads from a vLLM-compatible server.
PICKER_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running",
                  "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"}


def main_container(obj: dict = LLMISVC) -> dict:
    (container,) = [c for c in obj["spec"]["template"]["containers"] if c["name"] == "main"]
    return container


def test_validates_against_the_crd():
    assert LLMISVC["apiVersion"] == "serving.kserve.io/v1alpha2"
    assert h.crd_errors(LLMISVC) == []


def test_the_kv_offloading_spec_has_a_disk_tier_the_server_can_use():
    """spec.kvCacheOffloading as the CRD has it: a file-system tier (the CPU server's second
    tier; `cpu` alone would be refused at start-up) and an eviction policy the server takes."""
    spec = LLMISVC["spec"]["kvCacheOffloading"]
    assert spec["evictionPolicy"] in ("lru", "arc")
    assert any("fileSystem" in tier for tier in spec["secondary"])
    broken = copy.deepcopy(LLMISVC)
    broken["spec"]["kvCacheOffloading"]["evictionPolicy"] = "fifo"
    assert h.crd_errors(broken)


@pytest.mark.parametrize("breakage", ["no_uri", "replicas_text", "unknown_field"])
def test_broken_llmisvc_fails_validation(breakage):
    broken = copy.deepcopy(LLMISVC)
    if breakage == "no_uri":
        del broken["spec"]["model"]["uri"]
    elif breakage == "replicas_text":
        broken["spec"]["replicas"] = "two"
    else:
        broken["spec"]["model"]["uris"] = broken["spec"]["model"]["uri"]
    assert h.crd_errors(broken)


def test_the_presets_own_command_runs_our_server_with_lora_tracing_and_tls(tmp_path):
    """No command or probes of our own: the preset's script (tests/helpers/llmisvc_preset.py)
    runs `vllm serve` with this spec's adapters, tracing and args, and our `vllm` parses it;
    TLS as the preset adds it where the cluster turns it on."""
    from kserve_paged.vllm_cli import serve_argv
    from kserve_paged.vllm_flags import VLLM_CLI_VERSION
    from tests.helpers.llmisvc_preset import Preset, preset_argv

    container = main_container()
    assert "command" not in container and container["image"] == "kserve-paged"
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(container)
    assert [p["containerPort"] for p in container["ports"]] == [PRESET_PORT]
    spec = LLMISVC["spec"]
    preset = Preset.of(LLMISVC, tls=("/var/run/kserve/tls/tls.crt",
                                     "/var/run/kserve/tls/tls.key"))
    argv = preset_argv(preset, tmp_path, VLLM_CLI_VERSION)
    parsed = server_args.parse_args(serve_argv(argv[1:]))
    name, namespace = spec["model"]["name"], LLMISVC["metadata"]["namespace"]
    assert parsed.served_model_name == [name, f"publishers/{namespace}/models/{name}"]
    assert parsed.model_name == name and parsed.model_dir == "/mnt/models"
    assert parsed.http_port == PRESET_PORT
    adapters = [a["name"] for a in spec["model"]["lora"]["adapters"]]
    assert len(adapters) == 2
    assert parsed.lora_modules == [
        (served, f"/mnt/lora/{a}") for a in adapters
        for served in (a, f"publishers/{namespace}/models/{a}")]
    assert parsed.max_loras >= len(adapters)  # the two names of an adapter are one
    assert parsed.max_lora_rank == spec["model"]["lora"]["maxRank"]
    assert parsed.otlp_traces_endpoint == spec["tracing"]["exporterEndpoint"]
    assert parsed.collect_detailed_traces == "all"
    assert parsed.enable_ssl_refresh and parsed.ssl_certfile.endswith("tls.crt")
    assert parsed.max_num_seqs == 128
    env = {e["name"] for e in container["env"]}
    assert "VLLM_API_KEY" in env


def test_the_routed_paths_are_served():
    """The preset HTTPRoute rewrites to vLLM's paths; the server registers them."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kserve_paged.openai import register_openai_routes

    app = FastAPI()
    register_openai_routes(app, {})  # no model: a served path answers OpenAI's model 404
    with TestClient(app) as client:
        for path, body in ROUTED_PATHS.items():
            r = client.post(path, json={"model": "paged-llm", **body})
            assert r.status_code == 404 and "paged-llm" in r.json()["error"]["message"], path
        assert "error" not in client.post("/v2/completions", json={}).json()  # a path not served


def test_the_picker_scores_prefix_queue_and_kv_usage():
    config = LLMISVC["spec"]["router"]["scheduler"]["config"]["inline"]
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    for scorer in ("prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"):
        assert scorer in plugins and refs.get(scorer, 0) > 0, scorer
    assert set(refs) <= plugins
    assert "max-score-picker" in refs
    assert server_metrics.metric_names() >= PICKER_METRICS


def test_the_podmonitor_scrapes_the_replicas():
    """KServe labels the pods app.kubernetes.io/name: <metadata.name>; the port name is one of
    the PodMonitor's endpoints, in the same namespace."""
    assert LLMISVC["metadata"]["namespace"] == PODMONITOR["metadata"]["namespace"]
    selector = PODMONITOR["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": LLMISVC["metadata"]["name"]}
    ports = {ep["port"] for ep in PODMONITOR["spec"]["podMetricsEndpoints"]}
    assert main_container()["ports"][0]["name"] in ports


def test_the_image_is_the_runtimes():
    (runtime,) = h.objects_of_kind("ClusterServingRuntime")
    assert main_container()["image"] == runtime["spec"]["containers"][0]["image"]


def test_the_documented_precise_scorer_settings_parse_and_agree():
    """manifests/README.md's switch to llm-d's precise prefix-cache scorer: the flags it adds
    parse together with the shipped ones, the keys are the CBOR ones a Go scorer recomputes,
    the pods connect to the picker, and the pods' seed and block size equal the scorer's."""
    import re

    import yaml

    from kserve_paged_engine.core.kv_event_publisher import binds

    text = (h.MANIFESTS / "README.md").read_text()
    text = re.split(r"To switch the\s+shipped manifest over", text)[1]
    snippet = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S)[1])
    parsed = server_args.parse_args(main_container()["args"] + snippet["args"])
    assert parsed.prefix_caching_hash_algo == "sha256_cbor"
    events = parsed.kv_events_config
    assert events.publishes and not binds(events.endpoint) and events.topic.startswith("kv@")
    env = {e["name"]: e.get("value") for e in snippet["env"]}
    scorer = re.search(r"tokenProcessorConfig`\s+`\{blockSize: (\d+), hashSeed: \"(\w+)\"\}`",
                       text)
    assert scorer, "the scorer's settings are not in the README"
    assert int(scorer[1]) == parsed.block_size and scorer[2] == env["PYTHONHASHSEED"]
