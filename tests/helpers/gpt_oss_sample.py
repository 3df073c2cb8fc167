"""KServe's gpt-oss LLMInferenceService sample (`docs/samples/llmisvc/e2e-gpt-oss`): the main
container's command as its LLMInferenceServiceConfig writes it, run the way the container does
(`/bin/sh -c ARGS`, with `$VLLM_ADDITIONAL_ARGS` from the environment).

Source: https://github.com/kserve/kserve, `docs/samples/llmisvc/e2e-gpt-oss/`
`llmisvc_config_default.yaml` (commit 00bb7297) and `inference_default.yaml` (commit 213cfe34),
Apache-2.0. The sample runs `RedHatAI/gpt-oss-20b` on one GPU per replica; the single-node layout
here keeps that (no tensor or data parallelism flags; the multi-node data/expert layouts are the
parallelism work's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MODEL_NAME = "RedHatAI/gpt-oss-20b"  # inference_default.yaml: spec.model.name
COMMAND = ["/bin/sh", "-c"]  # the main container's command
# The main container's single arg (a folded YAML scalar: one line), its Go field unfilled.
ARGS = ('vllm serve /mnt/models --served-model-name "{{ .Spec.Model.Name }}" --port 8000 '
        "--disable-uvicorn-access-log --disable-log-requests $VLLM_ADDITIONAL_ARGS")
# What a gpt-oss deployment adds through VLLM_ADDITIONAL_ARGS for Harmony chat (vLLM's flags).
HARMONY_ARGS = ["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                "--enable-auto-tool-choice"]


def sample_command(model_dir: Path) -> list[str]:
    """The container's command with the controller's field filled and the model mounted at
    `model_dir` instead of /mnt/models."""
    script = ARGS.replace("{{ .Spec.Model.Name }}", MODEL_NAME)
    return [*COMMAND, script.replace("/mnt/models", str(model_dir))]


def vllm_bin(folder: Path) -> Path:
    """A folder with the `vllm` command of our image (manifests/image/Dockerfile)."""
    folder.mkdir(parents=True, exist_ok=True)
    vllm = folder / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec {sys.executable} -m kserve_paged.vllm_cli "$@"\n')
    vllm.chmod(0o755)
    return folder


def sample_env(bin_dir: Path, additional: list[str]) -> dict[str, str]:
    """The container's environment: our `vllm` first on PATH, `VLLM_ADDITIONAL_ARGS`."""
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "VLLM_ADDITIONAL_ARGS": " ".join(additional), "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def sample_argv(model_dir: Path, additional: list[str], folder: Path) -> list[str]:
    """The argv the sample's shell hands `vllm` (after `vllm`), recorded by a stand-in."""
    import json

    from kserve_paged.vllm_cli import VLLM_CLI_VERSION
    from tests.helpers.llmisvc_preset import recording_vllm

    bin_dir = recording_vllm(folder, VLLM_CLI_VERSION)
    out = subprocess.run(sample_command(model_dir), env=sample_env(bin_dir, additional),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("ARGV=")]
    return json.loads(line[len("ARGV="):])
