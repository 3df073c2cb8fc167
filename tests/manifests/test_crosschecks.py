"""The manifests against the code: the runtime's args through the server's real argument
parser, every metric name in the dashboard and the KEDA query against the metrics the server
registers, and the PodMonitor / KEDA fields against what their operators expect."""

from __future__ import annotations

import copy
import json
import re

import pytest

from kserve_paged import args as server_args
from kserve_paged import metric_families as server_metrics
from tests.helpers import manifests as h
from tests.helpers import monitoring_checks as mon

RUNTIMES = {o["metadata"]["name"]: o for o in h.objects_of_kind("ClusterServingRuntime")}
ISVCS = h.objects_of_kind("InferenceService")
PODMONITORS = h.objects_of_kind("PodMonitor")
DASHBOARD_PATH = h.MANIFESTS / "monitoring" / "kserve-paged-dashboard.json"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
EXPOSED = server_metrics.exposed_sample_names()
COUNTER_SAMPLES = {n for n in server_metrics.metric_names() if n.endswith("_total")} - {
    "vllm:iteration_tokens_total"}  # a histogram whose name ends in _total, as in vLLM
KNATIVE_PORT_NAME = "user-port"  # Knative renames the user container's port to this


def _isvc_ids(isvcs):
    return [i["metadata"]["name"] for i in isvcs]


def _by_mode(mode):
    return [i for i in ISVCS if i["metadata"]["annotations"][
        "serving.kserve.io/deploymentMode"] == mode]


def _runtime_for(isvc):
    model = isvc["spec"]["predictor"]["model"]
    runtime = RUNTIMES.get(model.get("runtime"))
    assert runtime is not None, f"{h.describe(isvc)}: runtime {model.get('runtime')!r} not shipped"
    return runtime


def _parse(argv):
    try:
        return server_args.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"the server's parser rejects {argv}") from exc


# --- the runtime container against the server --------------------------------------------------

@pytest.mark.parametrize("isvc", ISVCS, ids=_isvc_ids(ISVCS))
def test_runtime_args_are_accepted_by_the_server_parser(isvc):
    runtime = _runtime_for(isvc)
    container = h.rendered_container(runtime, isvc)
    assert container["command"] == ["python", "-m", "kserve_paged"]
    parsed = _parse(container["args"])
    name = isvc["metadata"]["name"]
    assert parsed.model_name == name
    assert parsed.model_dir == "/mnt/models"
    port = parsed.http_port
    assert port == 8080
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(port)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == f"/v2/models/{name}/ready", probe
        assert get["port"] == port, probe
    # Sized for large model loads: at least 20 minutes before the kubelet gives up.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60


def test_runtime_shape():
    for runtime in RUNTIMES.values():
        spec = runtime["spec"]
        assert spec["protocolVersions"] == ["v2", "v1"]
        assert set(spec["protocolVersions"]) <= set(h.PROTOCOL_VERSIONS)
        assert [f["name"] for f in spec["supportedModelFormats"]] == ["paged-llm"]
        (main,) = [c for c in spec["containers"] if c["name"] == "kserve-container"]
        assert main["resources"]["requests"]["cpu"] and main["resources"]["requests"]["memory"]
        shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in main["volumeMounts"]
        assert main["securityContext"]["runAsNonRoot"] is True


def test_a_misspelt_runtime_arg_is_rejected():
    isvc = ISVCS[0]
    runtime = copy.deepcopy(_runtime_for(isvc))
    runtime["spec"]["containers"][0]["args"].append("--max_num_seq=8")
    with pytest.raises(AssertionError, match="rejects"):
        _parse(h.rendered_container(runtime, isvc)["args"])


@pytest.mark.parametrize("isvc", ISVCS, ids=_isvc_ids(ISVCS))
def test_inference_service_uses_the_runtime(isvc):
    model = isvc["spec"]["predictor"]["model"]
    runtime = _runtime_for(isvc)
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    uris = ([model["storageUri"]] if "storageUri" in model
            else [u["uri"] for u in isvc["spec"]["predictor"]["storageUris"]])
    for uri in uris:
        assert h.STORAGE_URI.match(uri), uri
    assert isvc["metadata"]["name"][0].isalpha()  # KServe: DNS-1035 label


def test_lora_service_mounts_each_adapter_it_serves():
    """Each --lora_modules path is a storageUris mountPath, the base model at /mnt/models."""
    from kserve_paged.args import parse_args

    (isvc,) = [i for i in ISVCS if i["metadata"]["name"] == "paged-llm-lora"]
    pred = isvc["spec"]["predictor"]
    mounts = {u.get("mountPath", "/mnt/models") for u in pred["storageUris"]}
    args = parse_args(pred["model"]["args"])
    assert args.lora_modules and "/mnt/models" in mounts
    assert {path for _, path in args.lora_modules} == mounts - {"/mnt/models"}


# --- autoscaling -------------------------------------------------------------------------------

GPU_ISVCS = _by_mode("Standard")


@pytest.mark.parametrize("isvc", GPU_ISVCS, ids=_isvc_ids(GPU_ISVCS))
def test_gpu_service_scales_with_keda_on_requests_in_flight(isvc):
    assert mon.keda_errors(isvc) == []
    (metric,) = isvc["spec"]["predictor"]["autoScaling"]["metrics"]
    query = metric["external"]["metric"]["query"]
    assert mon.promql_metric_names(query) == {"vllm:num_requests_running",
                                            "vllm:num_requests_waiting"}
    assert mon.promql_errors(query, EXPOSED, COUNTER_SAMPLES) == []
    assert mon.keda_query_scope_errors(isvc, query) == []


@pytest.mark.parametrize("isvc", GPU_ISVCS, ids=_isvc_ids(GPU_ISVCS))
def test_gpu_count_is_the_tensor_parallel_size(isvc):
    """One GPU per rank: nvidia.com/gpu (requests and limits) equals --tensor_parallel_size,
    the engine's heads split over it, and /dev/shm (NCCL) is memory-backed with room per GPU
    inside the pod's memory limit."""
    runtime = _runtime_for(isvc)
    parsed = _parse(h.rendered_container(runtime, isvc)["args"])
    resources = isvc["spec"]["predictor"]["model"]["resources"]
    gpus = int(resources["limits"]["nvidia.com/gpu"])
    assert int(resources["requests"].get("nvidia.com/gpu", gpus)) == gpus
    assert parsed.tensor_parallel_size == gpus
    (shm,) = [v for v in runtime["spec"]["volumes"]
              if v.get("emptyDir", {}).get("medium") == "Memory"]
    shm_bytes = mon.quantity(shm["emptyDir"]["sizeLimit"])
    assert shm_bytes >= gpus * 2**30
    assert shm_bytes < mon.quantity(resources["limits"]["memory"])


def test_the_tensor_parallel_overlay_shards_over_several_gpus():
    assert any(_parse(h.rendered_container(_runtime_for(i), i)["args"]).tensor_parallel_size > 1
               for i in GPU_ISVCS)


def test_keda_checks_can_fail():
    (isvc,) = [i for i in GPU_ISVCS if i["metadata"]["name"] == "paged-llm"]
    broken = copy.deepcopy(isvc)
    target = broken["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["target"]
    target.pop("value")
    target["averageValue"] = "4"
    assert mon.keda_errors(broken)
    broken = copy.deepcopy(isvc)
    broken["metadata"]["annotations"].pop("serving.kserve.io/autoscalerClass")
    assert mon.keda_errors(broken)
    query = 'sum(vllm:num_requests_waiting{pod=~".*"})'
    assert len(mon.keda_query_scope_errors(isvc, query)) == 2
    wider = 'sum(vllm:num_requests_waiting{namespace="kserve-paged", pod=~"paged-llm.*"})'
    assert mon.keda_query_scope_errors(isvc, wider)
    assert mon.promql_errors("sum(vllm:num_request_waiting)", EXPOSED, COUNTER_SAMPLES)


def test_cpu_service_scales_on_concurrency_to_zero():
    (isvc,) = [i for i in _by_mode("Knative") if i["metadata"]["name"] == "paged-llm-cpu"]
    pred = isvc["spec"]["predictor"]
    ann = isvc["metadata"]["annotations"]
    assert ann.get("serving.kserve.io/autoscalerClass") in (None, "kpa.autoscaling.knative.dev")
    assert pred["scaleMetric"] == "concurrency"
    assert isinstance(pred["scaleTarget"], int) and pred["scaleTarget"] > 0
    assert pred["minReplicas"] == 0 and pred["maxReplicas"] >= 1
    assert "autoScaling" not in pred
    resources = pred["model"]["resources"]
    assert not any("gpu" in k for part in resources.values() for k in part)
    # Knative's progress deadline must outlast the runtime's startup probe.
    startup = h.rendered_container(_runtime_for(isvc), isvc)["startupProbe"]
    deadline = pred["annotations"]["serving.knative.dev/progress-deadline"]
    assert mon.duration_seconds(deadline) >= startup["periodSeconds"] * startup["failureThreshold"]


# --- monitoring --------------------------------------------------------------------------------

def test_podmonitor_shape():
    assert len(PODMONITORS) == 1
    assert mon.podmonitor_errors(PODMONITORS[0]) == []


def test_podmonitor_scrapes_every_predictor_pod_on_the_metrics_port():
    (pm,) = PODMONITORS
    selector = pm["spec"]["selector"]["matchLabels"]
    ports = {ep["port"]: ep for ep in pm["spec"]["podMetricsEndpoints"]}
    for isvc in ISVCS:
        assert isvc["metadata"]["namespace"] == pm["metadata"]["namespace"]
        assert "namespaceSelector" not in pm["spec"]  # its own namespace
        labels = isvc["spec"]["predictor"].get("labels") or {}
        assert selector.items() <= labels.items(), h.describe(isvc)
        runtime = _runtime_for(isvc)
        container = h.rendered_container(runtime, isvc)
        mode = isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
        port_name = container["ports"][0]["name"] if mode == "Standard" else KNATIVE_PORT_NAME
        assert port_name in ports, f"{h.describe(isvc)}: no endpoint for port {port_name}"
        assert ports[port_name]["path"] == runtime["spec"]["annotations"][
            "prometheus.kserve.io/path"]


def test_podmonitor_checks_can_fail():
    broken = copy.deepcopy(PODMONITORS[0])
    broken["spec"]["podMetricEndpoints"] = broken["spec"].pop("podMetricsEndpoints")
    assert mon.podmonitor_errors(broken)
    broken = copy.deepcopy(PODMONITORS[0])
    broken["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    broken["spec"]["selector"] = {"app": "x"}
    assert len(mon.podmonitor_errors(broken)) == 2


def _targets():
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def test_dashboard_queries_use_only_metrics_the_server_registers():
    exprs = [t["expr"] for _, t in _targets()]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            expr = mon.grafana_variable_metric_expr(variable["query"])
            assert expr, variable["name"]
            exprs.append(expr)
    assert exprs
    for expr in exprs:
        assert mon.promql_errors(expr, EXPOSED, COUNTER_SAMPLES) == []


def test_dashboard_panels_cover_the_issue():
    used = set()
    for _, target in _targets():
        used |= mon.promql_metric_names(target["expr"])
    assert {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
        "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    } <= used
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        exprs = [t["expr"] for _, t in _targets() if histogram + "_bucket" in t["expr"]]
        for q in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({q},") for e in exprs), (histogram, q)


def test_dashboard_is_well_formed():
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "namespace", "model_name"} <= variables
    for panel, target in _targets():
        assert panel["datasource"]["uid"] == "${datasource}"
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert target["refId"]
        for var in set(re.findall(r"\$(\w+)", target["expr"])) - {
                "__rate_interval", "__interval", "__range"}:
            assert var in variables, (panel["title"], var)


def test_dashboard_checks_can_fail():
    assert mon.promql_errors('sum(vllm:num_requests_wating{namespace="x"})', EXPOSED, COUNTER_SAMPLES)
    assert mon.promql_errors("sum(vllm:prompt_tokens_total)", EXPOSED, COUNTER_SAMPLES)
    assert mon.promql_errors(
        "histogram_quantile(0.5, sum(rate(vllm:time_to_first_token_seconds_bucket[5m])))",
        EXPOSED, COUNTER_SAMPLES)
    assert mon.promql_errors("sum(rat(vllm:prompt_tokens_total[5m]))", EXPOSED, COUNTER_SAMPLES)
    assert mon.promql_errors("process_cpu_seconds_total", EXPOSED, COUNTER_SAMPLES)


def test_dashboard_configmap_carries_the_dashboard():
    (cm,) = h.objects_of_kind("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == PODMONITORS[0]["metadata"]["namespace"]
    (body,) = cm["data"].values()
    assert json.loads(body) == DASHBOARD
    assert len(body.encode()) < 1024 * 1024  # ConfigMap size limit


def test_dashboard_panels_cover_issue_24():
    """Request outcomes, per-request token counts, prefill/decode time and the KV waste gauges."""
    used = set()
    for _, target in _targets():
        used |= mon.promql_metric_names(target["expr"])
    assert {
        "vllm:request_success_total", "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket", "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket", "kserve_paged:kv_slots_reserved",
        "kserve_paged:kv_slots_holding_tokens", "kserve_paged:kv_blocks_shared",
    } <= used
