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

(LLMISVC,) = h.objects_of_kind("LLMInferenceService")
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


def test_the_server_flags_and_port_fit_the_presets():
    container = main_container()
    assert container["command"] == ["python", "-m", "kserve_paged"]
    parsed = server_args.parse_args(container["args"])
    assert parsed.model_name == LLMISVC["spec"]["model"]["name"]  # what clients send as model
    assert parsed.model_dir == "/mnt/models"  # where the storage initializer puts spec.model.uri
    assert parsed.http_port == PRESET_PORT
    assert [p["containerPort"] for p in container["ports"]] == [PRESET_PORT]
    name = parsed.model_name
    for probe, path in (("startupProbe", f"/v2/models/{name}/ready"),
                        ("readinessProbe", f"/v2/models/{name}/ready"),
                        ("livenessProbe", "/v2/health/live")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == (path, PRESET_PORT, "HTTP"), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


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

    from engine.core.kv_event_publisher import binds

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
