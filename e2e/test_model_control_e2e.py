"""Issue 49 item 9 on the real server (the session's, gRPC on, no --model_control_key): KServe's
model repository load and unload are off, over HTTP (403) and over gRPC (PERMISSION_DENIED),
and the model goes on serving. KServe's gRPC server has no authentication, so before the fix
any client reaching its port could unload the model (kserve_paged/model_control.py)."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.helpers.e2e_server import MODEL, Server

GRPC_CONTROL = """
import sys
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

client = grpcclient.InferenceServerClient(sys.argv[1])
for call in (client.unload_model, client.load_model):
    try:
        call(sys.argv[2])
        print("ALLOWED")
    except InferenceServerException as exc:
        print(exc.status())
print("READY", client.is_model_ready(sys.argv[2]))
"""


def test_no_client_loads_or_unloads_the_model_over_http_or_grpc(server: Server):
    for action in ("unload", "load"):
        r = httpx.post(f"{server.url}/v2/repository/models/{MODEL}/{action}", timeout=30)
        assert r.status_code == 403, r.text
        assert "--model_control_key" in r.json()["error"]
    # In a subprocess: tritonclient.grpc's protos and KServe's cannot share one process.
    proc = subprocess.run([sys.executable, "-c", GRPC_CONTROL, server.grpc_host, MODEL],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines == ["StatusCode.PERMISSION_DENIED"] * 2 + ["READY True"], proc.stdout
    assert httpx.get(f"{server.url}/v2/models/{MODEL}/ready", timeout=30).status_code == 200
    r = httpx.post(f"{server.url}/openai/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
