"""The server as KServe's LLMInferenceService runs it: the preset's own bash command
(tests/helpers/llmisvc_preset.py renders it by the controller's rules) with our `vllm` on
PATH, `spec.model.lora` with two PEFT adapters made here, `spec.tracing` pointing at an
in-test OTLP receiver (gRPC, then HTTP), TLS on with a self-signed certificate made here, and
the API key from `VLLM_API_KEY` in the container's env.

Checked: both adapters answer under both of their names with PEFT's own greedy continuation,
the base under both of its names; a span per request arrives at the receiver; the server
speaks HTTPS only; 401 without the key, /health open.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kserve_paged.testing import ServerProcess, free_port
from tests.helpers.llmisvc_preset import Preset
from tests.helpers.lora import make_adapter, peft_greedy, tiny_base
from tests.helpers.otlp_receivers import GrpcReceiver, HttpReceiver
from tests.helpers.tls import self_signed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAME, NAMESPACE, KEY = "tiny", "team-a", "e2e-key"
PROMPT = list(range(100, 116))
NEW = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The model as the storage initializer leaves it in /mnt/models, the adapters as in
    /mnt/lora/<name>, and the `vllm` command of our image (manifests/image/Dockerfile)."""
    root = tmp_path_factory.mktemp("llmisvc")
    tiny_base(root / "models")
    make_adapter(root / "models", root / "lora" / "sql", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    make_adapter(root / "models", root / "lora" / "chat", seed=2, r=8, lora_alpha=8,
                 target_modules=["o_proj", "up_proj"])
    bin_dir = root / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec {sys.executable} -m kserve_paged.vllm_cli "$@"\n')
    vllm.chmod(0o755)
    return {"model": root / "models", "sql": root / "lora" / "sql",
            "chat": root / "lora" / "chat", "bin": bin_dir, "tls": root / "tls"}


@pytest.fixture(scope="module")
def reference(folders) -> dict[str | None, list[int]]:
    return {name: peft_greedy(folders["model"], folders[name] if name else None, [PROMPT],
                              NEW)[0] for name in (None, "sql", "chat")}


def _preset(folders: dict[str, Path], port: int, cert, endpoint: str) -> Preset:
    return Preset(
        NAME, NAMESPACE, model_dir=str(folders["model"]), termination_grace_s=30,
        tls=(str(cert.cert), str(cert.key)),
        adapters={"sql": str(folders["sql"]), "chat": str(folders["chat"])},
        max_lora_rank=8, max_loras=2, tracing_endpoint=endpoint,
        # The port and host a test on a shared machine needs; the last value wins.
        user_args=["--port", str(port), "--host", "127.0.0.1", "--max-model-len", "128",
                   "--num-kv-blocks", "64"])


def _wait_healthy(process: ServerProcess, url: str, cert: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        assert process.proc is not None and process.proc.poll() is None, (
            f"server exited\n{process.tail(60)}")
        try:
            if httpx.get(url, verify=str(cert), timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy\n{process.tail(60)}"
        time.sleep(0.2)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_preset_command_serves_adapters_traces_https_and_the_key(
        folders, reference, protocol, tmp_path):
    """Long because it is one server's whole life: start by the preset, every check, stop."""
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    cert = self_signed(folders["tls"] / protocol.replace("/", "-"))
    port = free_port()
    preset = _preset(folders, port, cert, receiver.endpoint)
    env = {**os.environ, "PATH": f"{folders['bin']}{os.pathsep}{os.environ['PATH']}",
           "VLLM_API_KEY": KEY, "OTEL_SERVICE_NAME": f"{NAME}-{NAMESPACE}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    process = ServerProcess(preset.command(), [], env=env, log_path=tmp_path / "server.log")
    base = f"https://127.0.0.1:{port}"
    try:
        process.start()
        _wait_healthy(process, f"{base}/health", cert.cert)
        _check_names_and_key(base, cert.cert, folders, reference)
        with pytest.raises(httpx.HTTPError):  # HTTPS only
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        code = process.stop(grace_s=40)  # SIGTERM: drains, flushes the spans, exits 0
        receiver.stop()
    assert code == 0, process.tail(60)
    spans = receiver.spans
    ids = [s["attributes"]["gen_ai.request.id"] for s in spans]
    assert len(ids) == len(set(ids)) == 6, spans  # one per completion below
    models = sorted(s["attributes"]["gen_ai.response.model"] for s in spans)
    # An adapter's spans name the adapter as it was asked for; the base's, the model's name.
    assert models == sorted([NAME, NAME, "sql", "chat", *(f"publishers/{NAMESPACE}/models/{a}"
                                                         for a in ("sql", "chat"))])
    for s in spans:
        a = s["attributes"]
        assert a["gen_ai.usage.prompt_tokens"] == len(PROMPT)
        assert a["gen_ai.usage.completion_tokens"] == NEW
        assert a["gen_ai.latency.time_in_model_decode"] >= 0  # detailed: all


def _check_names_and_key(base: str, cert: Path, folders: dict[str, Path],
                         reference: dict[str | None, list[int]]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["model"])
    want = {k: tok.decode(v) for k, v in reference.items()}
    assert len(set(want.values())) == 3  # each adapter changes the continuation
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120,
                           http_client=httpx.Client(verify=str(cert)))
    names = {m.id for m in client.models.list()}
    served = {None: NAME, "sql": "sql", "chat": "chat"}
    assert names == {n for short in served.values()
                     for n in (short, f"publishers/{NAMESPACE}/models/{short}")}
    for adapter, short in served.items():
        for name in (short, f"publishers/{NAMESPACE}/models/{short}"):
            r = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert (r.model, r.choices[0].text) == (name, want[adapter]), name
    with httpx.Client(verify=str(cert), timeout=30) as c:
        for path in ("/v1/completions", "/tokenize", f"/v2/models/{NAME}/infer"):
            r = c.post(f"{base}{path}", json={"model": NAME, "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"], path
        assert c.get(f"{base}/health").status_code == 200
        assert c.get(f"{base}/metrics").status_code == 200
        r = c.post(f"{base}/tokenize", json={"prompt": "Hello"},
                   headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode("Hello")
