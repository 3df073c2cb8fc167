"""Hand checks of what the monitoring manifests say: PromQL expressions against the metric names
the server exposes, PodMonitor specs, KEDA triggers (no schema for them is available offline).
Each check returns a list of error strings (empty: fine), as tests/helpers/manifests.py's do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

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


def quantity(value: Any) -> float | None:
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
        value = quantity(target.get("value"))
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
