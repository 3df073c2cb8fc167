"""A client that leaves a multi-prompt request, against the real server process: every prompt
is aborted, those already generating and those not yet submitted (issue 49: a completions
request of 2,000 prompts kept the engine busy for minutes after its client left, since the
prompts went on being submitted one engine step apart). Measured in engine steps
(`vllm:iteration_tokens_total`'s count) from the moment the socket closes (or the gRPC
client's process dies) until the engine is idle."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.helpers.e2e_server import MODEL, Server, record, scrape, wait_idle

PROMPTS = 300  # submitted one engine step apart: hundreds of steps if the server went on
# Steps the engine may take after the socket closes: the server's reaction (a few event loop
# turns while the engine steps) and the step that applies the aborts.
STEPS_AFTER_LEAVING = 4
STEPS = "vllm:iteration_tokens_total_count"


async def _leave_once_running(server: Server, path: str, body: dict[str, Any],
                              running: int) -> float:
    """POST `body` on a raw socket and close it once `running` requests run; the step count
    then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    while True:
        m = await asyncio.to_thread(scrape, server)
        if m["vllm:num_requests_running"] >= running:
            break
        assert not reader.at_eof(), "the server answered before the client left"
        await asyncio.sleep(0.02)
    writer.close()
    return m[STEPS]


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_a_multi_prompt_completion_aborts_every_prompt(server: Server, stream: bool):
    wait_idle(server, timeout=30)
    prompts_before = scrape(server)["vllm:prompt_tokens_total"]
    body = {"model": MODEL, "prompt": ["Tell me a long story"] * PROMPTS, "max_tokens": 200,
            "ignore_eos": True, "stream": stream}
    at_leave = asyncio.run(_leave_once_running(server, "/v1/completions", body, running=4))
    seconds, m = wait_idle(server, timeout=120)
    steps = m[STEPS] - at_leave
    record("leave_multi_prompt_completion", stream=stream, prompts=PROMPTS,
           steps_after_leaving=steps, seconds_to_idle=round(seconds, 2),
           prompt_tokens_computed=m["vllm:prompt_tokens_total"] - prompts_before)
    assert steps <= STEPS_AFTER_LEAVING


# In a subprocess (tritonclient.grpc's protos cannot share a process with KServe's): a v2 call
# of many prompts over gRPC, left running until the test kills the process.
GRPC_LEAVER = """
import sys, time
import numpy as np
import tritonclient.grpc as grpcclient

host, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = grpcclient.InferenceServerClient(host)
tensor = grpcclient.InferInput("text_input", [n], "BYTES")
tensor.set_data_from_numpy(np.array([b"Tell me a long story"] * n, dtype=object))
client.async_infer(model, [tensor], callback=lambda result, error: None,
                   parameters={"max_tokens": 200, "ignore_eos": True})
time.sleep(600)
"""


def test_a_killed_grpc_client_aborts_every_prompt(server: Server):
    wait_idle(server, timeout=30)
    proc = subprocess.Popen([sys.executable, "-c", GRPC_LEAVER, server.grpc_host, MODEL,
                             str(PROMPTS)])
    try:
        while (m := scrape(server))["vllm:num_requests_running"] < 4:
            assert proc.poll() is None, "the gRPC client ended before it was killed"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(10)
    seconds, after = wait_idle(server, timeout=120)
    steps = after[STEPS] - m[STEPS]
    record("leave_multi_prompt_grpc", prompts=PROMPTS, steps_after_leaving=steps,
           seconds_to_idle=round(seconds, 2))
    assert steps <= STEPS_AFTER_LEAVING
