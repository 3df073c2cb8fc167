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


