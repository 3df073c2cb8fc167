"""Every manifest parses and validates: KServe objects against the KServe v0.20.0 CRD schemas
(tests/data/kserve-crds), core objects against the Kubernetes schemas (kubernetes-validate).
The negative tests show that the checks can fail."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.helpers import manifests as h

OBJECTS = h.all_objects()
KSERVE = [(p, o) for p, o in OBJECTS if h.is_kserve(o)]
CORE = [(p, o) for p, o in OBJECTS if h.is_core(o)]
# PodMonitor: prometheus-operator's CRD is not available offline; checked by hand in
# test_crosschecks.py (mon.podmonitor_errors).
HAND_CHECKED_KINDS = {"PodMonitor"}
KNOWN_KINDS = {"ClusterServingRuntime", "InferenceService", "LLMInferenceService", "Namespace",
               "ConfigMap", "PodMonitor"}


def _ids(items):
    return [f"{p.relative_to(h.REPO)}:{h.describe(o)}" for p, o in items]


def test_every_yaml_document_parses():
    files = h.yaml_files()
    assert files, "no YAML under manifests/"
    for path in files:
        docs = h.load_yaml_docs_strict(path.read_text())
        assert docs, f"{path}: no document"
        for doc in docs:
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), (
                f"{path}: a document without apiVersion/kind")


def test_duplicate_keys_are_caught():
    with pytest.raises(yaml.YAMLError, match="duplicate"):
        h.load_yaml_docs_strict("kind: A\nspec:\n  x: 1\n  x: 2\n")


def test_json_files_parse():
    for path in sorted(h.MANIFESTS.rglob("*.json")):
        json.loads(path.read_text())


def test_the_expected_objects_are_shipped():
    kinds = {o["kind"] for _, o in OBJECTS}
    assert kinds == KNOWN_KINDS, f"unexpected set of kinds: {kinds}"


@pytest.mark.parametrize("path,obj", KSERVE, ids=_ids(KSERVE))
def test_kserve_objects_validate_against_crds(path, obj):
    assert h.crd_errors(obj) == []


@pytest.mark.parametrize("path,obj", CORE, ids=_ids(CORE))
def test_core_objects_validate_against_kubernetes_schemas(path, obj):
    assert h.core_errors(obj) == []
    assert h.metadata_errors(obj) == []


def test_every_object_is_validated_somewhere():
    unchecked = [h.describe(o) for _, o in OBJECTS
                 if not (h.is_kserve(o) or h.is_core(o) or o["kind"] in HAND_CHECKED_KINDS)]
    assert unchecked == [], "objects that no schema or hand check covers"


def test_crd_copies_cover_what_we_ship():
    schemas = h.crd_schemas()
    assert ("serving.kserve.io/v1beta1", "InferenceService") in schemas
    assert ("serving.kserve.io/v1alpha1", "ClusterServingRuntime") in schemas
    assert ("serving.kserve.io/v1alpha2", "LLMInferenceService") in schemas
    readme = (h.CRD_DIR / "README.md").read_text()
    assert "v0.20.0" in readme and "../shared/kserve-crds" in readme


def test_inference_services_set_deployment_mode_explicitly():
    isvcs = h.objects_of_kind("InferenceService")
    assert isvcs
    for isvc in isvcs:
        assert h.deployment_mode_errors(isvc) == []


# --- the checks can fail ---------------------------------------------------------------------

def _isvc(mode: str) -> dict:
    return copy.deepcopy(next(o for o in h.objects_of_kind("InferenceService") if o["metadata"]
                              ["annotations"]["serving.kserve.io/deploymentMode"] == mode))


def _runtime() -> dict:
    return copy.deepcopy(h.objects_of_kind("ClusterServingRuntime")[0])


def _mutations():
    def wrong_type(o):
        o["spec"]["predictor"]["minReplicas"] = "one"

    def bad_enum(o):
        o["spec"]["predictor"]["scaleMetric"] = "gpu"

    def unknown_field(o):
        o["spec"]["predictor"]["scaleMetrc"] = "concurrency"

    def unknown_nested_field(o):
        o["spec"]["predictor"]["model"]["storageURI"] = o["spec"]["predictor"]["model"].pop("storageUri")

    def bad_backend(o):
        o["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["metric"]["backend"] = "datadog"

    def bad_target_value(o):
        o["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["target"]["value"] = {"n": 4}

    def bad_metric_type(o):
        o["spec"]["predictor"]["autoScaling"]["metrics"][0]["type"] = "Prometheus"

    def int_annotation(o):
        o["metadata"]["annotations"]["prometheus.kserve.io/port"] = 8080

    def missing_model_format_name(o):
        o["spec"]["predictor"]["model"]["modelFormat"] = {"version": "1"}

    return {
        "wrong_type": ("Standard", wrong_type),
        "bad_enum": ("Knative", bad_enum),
        "unknown_field": ("Knative", unknown_field),
        "unknown_nested_field": ("Standard", unknown_nested_field),
        "bad_backend": ("Standard", bad_backend),
        "bad_target_value": ("Standard", bad_target_value),
        "bad_metric_type": ("Standard", bad_metric_type),
        "int_annotation": ("Standard", int_annotation),
        "missing_model_format_name": ("Knative", missing_model_format_name),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_broken_inference_service_fails_validation(name):
    mode, mutate = _mutations()[name]
    obj = _isvc(mode)
    assert h.crd_errors(obj) == []
    mutate(obj)
    assert h.crd_errors(obj), f"{name}: a broken InferenceService passed validation"


@pytest.mark.parametrize("mode", ["Serverless", "RawDeployment", "Raw", None])
def test_unknown_or_legacy_deployment_mode_is_rejected(mode):
    obj = _isvc("Standard")
    if mode is None:
        del obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
    else:
        obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] = mode
    assert h.deployment_mode_errors(obj)


def test_broken_runtime_fails_validation():
    obj = _runtime()
    container = obj["spec"]["containers"][0]
    container["ports"].append(dict(container["ports"][0]))  # list-map keys containerPort+protocol
    assert any("duplicate" in e for e in h.crd_errors(obj))
    obj = _runtime()
    obj["spec"]["containers"][0]["env"].append({"name": "HF_HOME", "value": "/x"})
    assert any("duplicate" in e for e in h.crd_errors(obj))
    obj = _runtime()
    obj["spec"]["supportedModelFormats"][0]["priority"] = 0  # minimum 1
    assert h.crd_errors(obj)
    obj = _runtime()
    obj["spec"]["containers"][0]["startupProbe"]["failureThreshold"] = 2**31  # int32
    assert h.crd_errors(obj)
    obj = _runtime()
    obj["kind"] = "LLMInferenceService"
    assert h.crd_errors(obj)


def test_broken_core_object_fails_validation():
    cm = copy.deepcopy(h.objects_of_kind("ConfigMap")[0])
    cm["data"]["answer"] = 42
    assert h.core_errors(cm)
    ns = copy.deepcopy(h.objects_of_kind("Namespace")[0])
    ns["spec"] = {"finalizer": ["kubernetes"]}
    assert h.core_errors(ns)
    ns = copy.deepcopy(h.objects_of_kind("Namespace")[0])
    ns["metadata"]["name"] = "Not_A_Label"
    assert h.metadata_errors(ns)


def test_x_kubernetes_int_or_string_accepts_both():
    schema = h.structural_to_jsonschema(yaml.safe_load("""
type: object
properties:
  port: {x-kubernetes-int-or-string: true}
  free: {type: object, x-kubernetes-preserve-unknown-fields: true, properties: {a: {type: string}}}
"""))
    v = h.K8sValidator(schema)
    assert not list(v.iter_errors({"port": 8080, "free": {"a": "x", "b": 1}}))
    assert not list(v.iter_errors({"port": "http"}))
    assert list(v.iter_errors({"port": 1.5}))
    assert list(v.iter_errors({"other": 1}))
