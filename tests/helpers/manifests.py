"""Loading and checking the Kubernetes manifests in manifests/.

Every check is a function returning a list of error strings (empty: fine), so the tests can show
both that the shipped manifests pass and that a broken variant fails.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CRD_DIR = REPO / "tests" / "data" / "kserve-crds"

KSERVE_GROUP = "serving.kserve.io"
# Core objects are validated against these Kubernetes versions' schemas (oldest KServe 0.20
# supports, and the newest kubernetes-validate bundles).
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
DEPLOYMENT_MODES = ("Standard", "Knative")  # explicit, current names (not RawDeployment/Serverless)
PROTOCOL_VERSIONS = ("v1", "v2", "grpc-v2")
STORAGE_URI = re.compile(r"^(hf|s3|gs|pvc|https?|oci)://\S+$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# --- loading -------------------------------------------------------------------------------------

def load_yaml_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]


class _StrictLoader(yaml.SafeLoader):
    """Rejects duplicate mapping keys (PyYAML keeps the last one silently; the API server's
    strict field validation rejects them)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = sorted({str(k) for k in keys if keys.count(k) > 1})
        if duplicates:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {duplicates}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml_docs_strict(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc is not None]


def yaml_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.rglob("*") if p.suffix in (".yaml", ".yml"))


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml"))


def overlay_dirs() -> list[Path]:
    return sorted(p.parent for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))


def is_kustomization(doc: dict) -> bool:
    return str(doc.get("apiVersion", "")).startswith("kustomize.config.k8s.io/")


def source_objects() -> list[tuple[Path, dict]]:
    """Every Kubernetes object written in manifests/ (kustomization files excluded)."""
    return [(path, doc) for path in yaml_files()
            for doc in load_yaml_docs(path.read_text()) if not is_kustomization(doc)]


def generated_configmaps() -> list[tuple[Path, dict]]:
    """The ConfigMaps that the kustomizations' configMapGenerators produce, built here as kustomize
    does (so they are validated even where kubectl is unavailable)."""
    out = []
    for directory in kustomization_dirs():
        kz = yaml.load((directory / "kustomization.yaml").read_text(), Loader=_Loader)
        options = kz.get("generatorOptions") or {}
        for gen in kz.get("configMapGenerator") or []:
            assert options.get("disableNameSuffixHash"), (
                f"{directory}: the generated ConfigMap names must be stable (disableNameSuffixHash)")
            data = {}
            for entry in gen.get("files") or []:
                key, _, rel = entry.rpartition("=") if "=" in entry else ("", "", entry)
                data[key or Path(rel).name] = (directory / rel).read_text()
            for entry in gen.get("literals") or []:
                key, _, value = entry.partition("=")
                data[key] = value
            meta: dict[str, Any] = {"name": gen["name"]}
            if gen.get("namespace"):
                meta["namespace"] = gen["namespace"]
            for field in ("labels", "annotations"):
                if options.get(field):
                    meta[field] = dict(options[field])
            out.append((directory / "kustomization.yaml",
                        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}))
    return out


def all_objects() -> list[tuple[Path, dict]]:
    return source_objects() + generated_configmaps()


def objects_of_kind(kind: str, objects: Iterable[tuple[Path, dict]] | None = None) -> list[dict]:
    return [doc for _, doc in (all_objects() if objects is None else objects)
            if doc.get("kind") == kind]


def describe(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('namespace', '-')}/{meta.get('name')}"


# --- KServe CRD schemas --------------------------------------------------------------------------

def _int_bounds(fmt: str | None) -> dict:
    if fmt == "int32":
        return {"minimum": -(2**31), "maximum": 2**31 - 1}
    if fmt == "int64":
        return {"minimum": -(2**63), "maximum": 2**63 - 1}
    return {}


def structural_to_jsonschema(node: Any) -> Any:
    """A CRD's structural OpenAPI v3 schema as a JSON Schema that rejects what the API server
    (with `kubectl apply`'s strict field validation) rejects:

    - ``x-kubernetes-int-or-string``: an integer or a string;
    - objects with ``properties`` reject unknown fields, unless
      ``x-kubernetes-preserve-unknown-fields`` (which keeps everything);
    - ``nullable``: null allowed; ``format: int32/int64``: range checked;
    - ``x-kubernetes-list-type`` / ``-list-map-keys`` are kept and checked by :data:`K8sValidator`
      (unique set items; unique map keys); ``x-kubernetes-map-type`` needs no check.
    """
    if isinstance(node, list):
        return [structural_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("description", "x-kubernetes-map-type", "x-kubernetes-int-or-string",
                   "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
                   "nullable", "format", "example"):
            continue
        if key == "properties":
            out[key] = {name: structural_to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict) or key in ("anyOf", "allOf", "oneOf"):
            out[key] = structural_to_jsonschema(value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("type") == "integer":
        for bound, value in _int_bounds(node.get("format")).items():
            out.setdefault(bound, value)  # a schema's own minimum/maximum is tighter
    if node.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
    elif node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def _list_type(validator, list_type, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate item {item!r} in a list of type set")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        props = (schema.get("items") or {}).get("properties") or {}
        seen_keys = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            ident = tuple(json.dumps(item.get(k, props.get(k, {}).get("default")), sort_keys=True)
                          for k in keys)
            if ident in seen_keys:
                yield jsonschema.ValidationError(
                    f"duplicate entry for keys {keys} = {[json.loads(i) for i in ident]}")
            seen_keys.add(ident)


K8sValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-kubernetes-list-type": _list_type})


@functools.lru_cache(maxsize=1)
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON Schema, for every served version of the CRDs in CRD_DIR."""
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in load_yaml_docs(path.read_text()):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served", True):
                    raw = version["schema"]["openAPIV3Schema"]
                    schemas[(f"{group}/{version['name']}", kind)] = structural_to_jsonschema(raw)
    return schemas


@functools.cache
def _crd_validator(api_version: str, kind: str):
    schema = crd_schemas().get((api_version, kind))
    if schema is None:
        return None
    K8sValidator.check_schema(schema)
    return K8sValidator(schema)


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<root>"


def metadata_errors(obj: dict) -> list[str]:
    """ObjectMeta, strictly: validated by kubernetes-validate as the metadata of a ConfigMap (a
    CRD schema leaves metadata to the API server, which checks it as ObjectMeta)."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        return ["metadata.name missing"]
    errors = []
    if not DNS1123_LABEL.match(str(meta["name"])) or len(str(meta["name"])) > 63:
        errors.append(f"metadata.name {meta['name']!r} is not a DNS-1123 label")
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    try:
        kubernetes_validate.validate(probe, K8S_VERSIONS[-1], strict=True)
    except kubernetes_validate.ValidationError as exc:
        errors.append(f"metadata.{_path(exc)}: {exc.message}")
    return errors


def crd_errors(obj: dict) -> list[str]:
    """Errors of a KServe object against its CRD's openAPIV3Schema (plus its metadata)."""
    validator = _crd_validator(obj.get("apiVersion", ""), obj.get("kind", ""))
    if validator is None:
        return [f"no CRD schema in {CRD_DIR.relative_to(REPO)} for "
                f"{obj.get('apiVersion')} {obj.get('kind')}"]
    errors = [f"{_path(e)}: {e.message}"
              for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))]
    return errors + metadata_errors(obj)


def core_errors(obj: dict) -> list[str]:
    """Errors of a built-in Kubernetes object against the Kubernetes schemas (strict)."""
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"k8s {version}: {_path(exc)}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"k8s {version}: {exc.message}")
    return errors


def is_kserve(obj: dict) -> bool:
    return str(obj.get("apiVersion", "")).split("/")[0] == KSERVE_GROUP


CORE_GROUPS = frozenset({"apps", "batch", "policy", "autoscaling", "rbac.authorization.k8s.io",
                         "networking.k8s.io", "scheduling.k8s.io", "storage.k8s.io"})


def is_core(obj: dict) -> bool:
    """A built-in Kubernetes kind (core group ``v1`` or a built-in API group)."""
    api_version = str(obj.get("apiVersion", ""))
    return "/" not in api_version or api_version.split("/")[0] in CORE_GROUPS


# --- KServe semantics the schema does not cover ----------------------------------------------

def deployment_mode_errors(isvc: dict) -> list[str]:
    mode = ((isvc.get("metadata") or {}).get("annotations") or {}).get(
        "serving.kserve.io/deploymentMode")
    if mode not in DEPLOYMENT_MODES:
        return [f"{describe(isvc)}: serving.kserve.io/deploymentMode must be set explicitly to one "
                f"of {DEPLOYMENT_MODES}, got {mode!r}"]
    return []


def render_template(text: str, isvc: dict) -> str:
    """KServe renders a runtime container as a Go template over the InferenceService's
    ObjectMeta; we use only ``{{.Name}}`` and ``{{.Namespace}}``."""
    meta = isvc["metadata"]
    out = re.sub(r"\{\{\s*\.Name\s*\}\}", meta["name"], text)
    out = re.sub(r"\{\{\s*\.Namespace\s*\}\}", meta.get("namespace", "default"), out)
    if "{{" in out:
        raise ValueError(f"unsupported template in {text!r}")
    return out


def rendered_container(runtime: dict, isvc: dict, name: str = "kserve-container") -> dict:
    """The runtime's container as KServe renders it for this InferenceService (templates filled
    in, the InferenceService's model args appended)."""
    containers = [c for c in runtime["spec"]["containers"] if c["name"] == name]
    assert len(containers) == 1, f"{describe(runtime)}: one container named {name}"
    container = json.loads(render_template(json.dumps(containers[0]), isvc))
    model = isvc["spec"]["predictor"].get("model") or {}
    container["args"] = list(container.get("args") or []) + list(model.get("args") or [])
    if model.get("image"):
        container["image"] = model["image"]
    return container


# --- PromQL ----------------------------------------------------------------------------------

PROMQL_FUNCTIONS = frozenset([
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count_over_time", "day_of_month", "day_of_week", "day_of_year",
    "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg", "histogram_count",
    "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "predict_linear", "present_over_time", "quantile_over_time", "rate",
    "resets", "round", "scalar", "sgn", "sort", "sort_by_label", "sort_by_label_desc",
    "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time", "time",
    "timestamp", "vector", "year",
])
PROMQL_AGGREGATIONS = frozenset([
    "sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values", "limitk", "limit_ratio",
])
PROMQL_KEYWORDS = frozenset([
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan",
])
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana variables allowed) reads. Raises
    ValueError on an unknown function."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^{}]*\}", " ", s)        # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)      # range / subquery selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)        # Grafana variables
    names = set()
    for match in _IDENT.finditer(s):
        token = match.group(1)
        called = s[match.end():].lstrip().startswith("(")
        if token in PROMQL_KEYWORDS:
            continue
        if called:
            if token not in PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS:
                raise ValueError(f"unknown PromQL function {token!r} in {expr!r}")
            continue
        if token in PROMQL_AGGREGATIONS:  # `sum by (x) (...)`: the call follows the clause
            continue
        names.add(token)
    return names


def label_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of every label matcher in ``expr``."""
    return [(m.group(1), m.group(2), m.group(3)) for block in re.findall(r"\{([^{}]*)\}", expr)
            for m in re.finditer(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', block)]


def grafana_variable_metric_expr(query: Any) -> str | None:
    """The PromQL inside a Grafana query variable (``label_values(<expr>, label)``,
    ``query_result(<expr>)``), or None for other variable kinds."""
    text = query.get("query") if isinstance(query, dict) else query
    if not isinstance(text, str):
        return None
    match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", text) or re.fullmatch(
        r"\s*query_result\((.*)\)\s*", text)
    return match.group(1) if match else None


def promql_errors(expr: str, exposed: Iterable[str], counters: Iterable[str]) -> list[str]:
    """A dashboard or KEDA query against the server's exposed sample names: every metric is one
    the server registers; counters only under rate/irate/increase; histogram buckets only under
    histogram_quantile with ``le`` kept."""
    exposed, counters = set(exposed), set(counters)
    try:
        names = promql_metric_names(expr)
    except ValueError as exc:
        return [str(exc)]
    errors = []
    if not names:
        errors.append(f"no metric in {expr!r}")
    for name in sorted(names - exposed):
        errors.append(f"{name!r} is not a metric the server exposes (in {expr!r})")
    if expr.count("(") != expr.count(")"):
        errors.append(f"unbalanced parentheses in {expr!r}")
    for name in sorted(names & counters):
        if not re.search(rf"\b(rate|irate|increase)\(\s*{re.escape(name)}\b", expr):
            errors.append(f"counter {name!r} must be read through rate()/increase() in {expr!r}")
    for name in sorted(n for n in names if n.endswith("_bucket")):
        if "histogram_quantile(" not in expr or not re.search(r"\bby\s*\([^()]*\ble\b", expr):
            errors.append(f"{name!r} needs histogram_quantile(..., sum by (le) (...)) in {expr!r}")
    return errors


# --- PodMonitor and KEDA (hand checks: no schema is available offline) ------------------------

# monitoring.coreos.com/v1 PodMonitor fields (prometheus-operator API reference).
PODMONITOR_SPEC_FIELDS = frozenset([
    "jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "selectorMechanism",
    "namespaceSelector", "sampleLimit", "targetLimit", "labelLimit", "labelNameLengthLimit",
    "labelValueLengthLimit", "keepDroppedTargets", "attachMetadata", "scrapeClass",
    "scrapeProtocols", "fallbackScrapeProtocol", "bodySizeLimit", "scrapeClassicHistograms",
    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
    "convertClassicHistogramsToNHCB",
])
PODMONITOR_ENDPOINT_FIELDS = frozenset([
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
    "honorLabels", "honorTimestamps", "trackTimestampsStaleness", "metricRelabelings",
    "relabelings", "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader",
    "followRedirects", "enableHttp2", "filterRunning", "authorization", "basicAuth", "oauth2",
    "bearerTokenSecret", "tlsConfig",
])
DURATION = re.compile(r"^(([0-9]+)(y|w|d|h|m|s|ms))+$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                   "y": 31536000}


def duration_seconds(text: str) -> float:
    return sum(int(n) * _DURATION_UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|y|w|d|h|m|s)", text))


def podmonitor_errors(pm: dict) -> list[str]:
    errors = []
    if pm.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"apiVersion must be monitoring.coreos.com/v1, got {pm.get('apiVersion')!r}")
    spec = pm.get("spec") or {}
    errors += [f"spec.{k}: unknown PodMonitor field" for k in sorted(set(spec) - PODMONITOR_SPEC_FIELDS)]
    selector = spec.get("selector")
    if not isinstance(selector, dict) or set(selector) - {"matchLabels", "matchExpressions"}:
        errors.append("spec.selector must be a label selector (matchLabels / matchExpressions)")
    else:
        labels = selector.get("matchLabels")
        if not labels or not isinstance(labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            errors.append("spec.selector.matchLabels must be a non-empty map of strings")
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        errors.append("spec.podMetricsEndpoints must be a non-empty list")
        endpoints = []
    for i, ep in enumerate(endpoints):
        where = f"spec.podMetricsEndpoints[{i}]"
        if not isinstance(ep, dict):
            errors.append(f"{where} must be an object")
            continue
        errors += [f"{where}.{k}: unknown field" for k in sorted(set(ep) - PODMONITOR_ENDPOINT_FIELDS)]
        if not isinstance(ep.get("port"), str) and not isinstance(ep.get("portNumber"), int):
            errors.append(f"{where}: needs a port name (port) or portNumber")
        if not str(ep.get("path", "")).startswith("/"):
            errors.append(f"{where}.path must be an absolute path")
        for field in ("interval", "scrapeTimeout"):
            if field in ep and not DURATION.match(str(ep[field])):
                errors.append(f"{where}.{field} {ep[field]!r} is not a Prometheus duration")
        if ("interval" in ep and "scrapeTimeout" in ep and DURATION.match(str(ep["interval"]))
                and DURATION.match(str(ep["scrapeTimeout"]))
                and duration_seconds(ep["scrapeTimeout"]) > duration_seconds(ep["interval"])):
            errors.append(f"{where}: scrapeTimeout exceeds interval")
    return errors


def _quantity(value: Any) -> float | None:
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)(m|k|M|G|Ki|Mi|Gi)?", str(value))
    if not match:
        return None
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024, "Mi": 1024**2,
             "Gi": 1024**3}[match.group(2)]
    return float(match.group(1)) * scale


def keda_errors(isvc: dict) -> list[str]:
    """The fields KServe turns into a KEDA ScaledObject (Standard mode, autoscalerClass keda)."""
    meta, pred = isvc.get("metadata") or {}, (isvc.get("spec") or {}).get("predictor") or {}
    ann = meta.get("annotations") or {}
    errors = []
    if ann.get("serving.kserve.io/autoscalerClass") != "keda":
        errors.append("annotation serving.kserve.io/autoscalerClass must be keda")
    if ann.get("serving.kserve.io/deploymentMode") != "Standard":
        errors.append("KEDA autoscaling needs serving.kserve.io/deploymentMode: Standard")
    if "scaleMetric" in pred or "scaleTarget" in pred:
        errors.append("scaleMetric/scaleTarget configure the HPA/KPA, not KEDA: use autoScaling")
    mn, mx = pred.get("minReplicas"), pred.get("maxReplicas")
    if not isinstance(mn, int) or not isinstance(mx, int) or mn < 1 or mx < mn:
        errors.append(f"need 1 <= minReplicas <= maxReplicas, got {mn}, {mx}")
    metrics = (pred.get("autoScaling") or {}).get("metrics") or []
    if not metrics:
        errors.append("spec.predictor.autoScaling.metrics is empty")
    for i, metric in enumerate(metrics):
        where = f"autoScaling.metrics[{i}]"
        if metric.get("type") != "External":
            errors.append(f"{where}.type must be External")
            continue
        ext = metric.get("external") or {}
        m, target = ext.get("metric") or {}, ext.get("target") or {}
        if m.get("backend") != "prometheus":
            errors.append(f"{where}.external.metric.backend must be prometheus")
        if not re.match(r"^https?://[A-Za-z0-9.-]+(:[0-9]+)?(/\S*)?$", str(m.get("serverAddress"))):
            errors.append(f"{where}.external.metric.serverAddress must be an http(s) URL")
        if not str(m.get("query") or "").strip():
            errors.append(f"{where}.external.metric.query is empty")
        # KServe passes target.value (only it) to KEDA as the threshold.
        if target.get("type") != "Value":
            errors.append(f"{where}.external.target.type must be Value")
        value = _quantity(target.get("value"))
        if value is None or value <= 0:
            errors.append(f"{where}.external.target.value must be a positive quantity")
    return errors


def keda_query_scope_errors(isvc: dict, query: str) -> list[str]:
    """The query must select only this service's predictor pods in its namespace."""
    meta = isvc["metadata"]
    matchers = label_matchers(query)
    errors = []
    if ("namespace", "=", meta.get("namespace")) not in matchers:
        errors.append(f'query must match namespace="{meta.get("namespace")}": {query!r}')
    pod = [value for label, op, value in matchers if label == "pod" and op == "=~"]
    if not pod or not re.fullmatch(pod[0], f"{meta['name']}-predictor-7d9f8c6b5-x2x4z") or any(
            re.fullmatch(pod[0], f"{other}-predictor-7d9f8c6b5-x2x4z")
            for other in (meta["name"] + "-x", "x" + meta["name"])):
        errors.append(f'query must match pod=~"{meta["name"]}-predictor-.*": {query!r}')
    return errors


# --- kubectl -------------------------------------------------------------------------------------

def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize_build(directory: Path, timeout: float = 180) -> list[dict]:
    exe = kubectl()
    assert exe is not None
    proc = subprocess.run([exe, "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return load_yaml_docs(proc.stdout)


