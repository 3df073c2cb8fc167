"""KServe's LLMInferenceService preset command, rendered and run the way the controller and the
container do it (tests/data/kserve-llmisvc/README.md): `bash -c SCRIPT -- ARGS...` with the
LoRA flags in front of the user's args and the tracing flags after them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).parent.parent / "data" / "kserve-llmisvc" / "preset_command.sh.tmpl"
LORA_ROOT = "/mnt/lora"


@dataclass
class Preset:
    """What of an LLMInferenceService spec reaches the main container's command."""

    name: str
    namespace: str
    model_dir: str = "/mnt/models"  # where the storage initializer puts spec.model.uri
    termination_grace_s: int = 60
    tensor: int | None = None
    tls: tuple[str, str] | None = None  # (cert, key) files; the preset's paths otherwise
    adapters: dict[str, str] = field(default_factory=dict)  # name -> mounted folder
    max_lora_rank: int | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    tracing_endpoint: str | None = None
    user_args: list[str] = field(default_factory=list)

    def script(self) -> str:
        """The template with its Go fields filled as config_merge.go fills them."""
        text = TEMPLATE.read_text()
        text = "\n".join(line for line in text.splitlines() if not line.startswith("# "))
        shutdown = max(0, self.termination_grace_s - 15 - min(5, self.termination_grace_s))
        text = text.replace("{{ shutdownTimeout .Spec.Template 15 }}", str(shutdown))
        text = text.replace("{{ kvTransferConfig .Spec.KVCacheOffloading }}", "")
        text = text.replace("{{ .Spec.Model.Name }}", self.name)
        text = text.replace("{{ .ObjectMeta.Namespace }}", self.namespace)
        tp = f" --tensor-parallel-size {self.tensor}" if self.tensor else ""
        # `{{-` trims the white space before it, as Go's text/template does.
        text = re.sub(r"\s*\{\{- if and \.Spec\.Parallelism .*?\{\{- end \}\}",
                      lambda _: tp, text)
        cert, key = self.tls or ("", "")
        for flag, value in (("--enable-ssl-refresh", ""), ("--ssl-certfile", cert),
                            ("--ssl-keyfile", key)):
            pattern = re.compile(r"\{\{ if \.GlobalConfig\.EnableTLS \}\}" + re.escape(flag)
                                 + r"[^{]*\{\{- end \}\}")
            text = pattern.sub(lambda _, f=flag, v=value: f"{f} {v}".rstrip() if self.tls
                               else "", text)
        return text.replace("/mnt/models", self.model_dir)

    def args(self) -> list[str]:
        """The container's args: LoRA flags (workload_lora.go), the user's, tracing's."""
        args: list[str] = []
        if self.adapters:
            args.append("--enable-lora")
            for flag, value in (("--max-lora-rank", self.max_lora_rank),
                                ("--max-loras", self.max_loras),
                                ("--max-cpu-loras", self.max_cpu_loras)):
                if value is not None:
                    args.append(f"{flag}={value}")
            args.append("--lora-modules")
            for name, path in self.adapters.items():
                for served in (name, f"publishers/{self.namespace}/models/{name}"):
                    module = json.dumps({"name": served, "path": path}, separators=(",", ":"))
                    args.append(f"'{module}'")
        args += self.user_args
        if self.tracing_endpoint:
            args += ["--otlp-traces-endpoint", self.tracing_endpoint,
                     "--collect-detailed-traces", "all"]
        return args

    def command(self) -> list[str]:
        return ["/bin/bash", "-c", self.script(), "--", *self.args()]

    @classmethod
    def of(cls, llmisvc: dict[str, Any], **overrides: Any) -> Preset:
        """What the controller takes from an LLMInferenceService object: the model's name, the
        namespace, spec.model.lora, spec.tracing and the main container's args."""
        spec = llmisvc["spec"]
        lora = spec["model"].get("lora") or {}
        (main,) = [c for c in spec.get("template", {}).get("containers", [])
                   if c["name"] == "main"]
        values: dict[str, Any] = dict(
            name=spec["model"]["name"], namespace=llmisvc["metadata"]["namespace"],
            adapters={a["name"]: f"{LORA_ROOT}/{a['name']}" for a in lora.get("adapters", [])},
            max_lora_rank=lora.get("maxRank"), max_loras=lora.get("maxAdapters"),
            max_cpu_loras=lora.get("maxCpuAdapters"),
            tracing_endpoint=(spec.get("tracing") or {}).get("exporterEndpoint"),
            user_args=list(main.get("args", [])))
        return cls(**{**values, **overrides})


def recording_vllm(folder: Path, version: str) -> Path:
    """A folder with a `vllm` that answers --version like ours and prints the argv of
    `serve` as `ARGV=<json>`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "vllm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "if sys.argv[1:] == ['--version']:\n"
        f"    print('kserve-paged 0.1.0, vLLM command line {version}')\n"
        "else:\n"
        "    print('ARGV=' + json.dumps(sys.argv[1:]))\n")
    script.chmod(0o755)
    return folder


def preset_argv(preset: Preset, folder: Path, version: str) -> list[str]:
    """The argv the preset's script hands `vllm` (after `vllm`), run with bash."""
    proc = run_with_vllm(preset, recording_vllm(folder, version), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"the preset's script failed: {err}")
    (line,) = [x for x in out.splitlines() if x.startswith("ARGV=")]
    return json.loads(line[len("ARGV="):])


def run_with_vllm(preset: Preset, vllm_dir: Path, env: dict[str, str] | None = None,
                  **popen: object) -> subprocess.Popen:
    """Start the preset's command with `vllm_dir` first on PATH."""
    full = {**os.environ, **(env or {}),
            "PATH": f"{vllm_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.Popen(preset.command(), env=full, **popen)  # type: ignore[arg-type]
