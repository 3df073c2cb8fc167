"""End to end: the real server process (e2e/conftest.py) through the clients users use.

Greedy outputs are compared with the offline ``LLM``; requests are short (CPU budget).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kserve_paged_engine import SamplingParams
from tests.helpers.e2e_server import ENGINE_OPTS, MODEL, Server, wait_idle
from tests.helpers.metrics_contract import CONTRACT_NAMES, HISTOGRAMS

PROMPTS = ["The capital of France is", "1, 2, 3,"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
METRIC_NAMES = CONTRACT_NAMES  # one list of the contract's names, kept in the unit tests


@pytest.fixture(scope="module")
def reference(offline_llm):
    outs = offline_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].text for o in outs], outs


@pytest.fixture(scope="module")
def chat_reference(offline_llm):
    return offline_llm.chat(CHAT, GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def oai(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused", timeout=120,
                         max_retries=0)


def metrics(server: Server) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    labels.setdefault("model_name", MODEL)
    for key, v in samples.get(name, {}).items():
        if all((k, labels[k]) in key for k in labels):
            return v
    raise KeyError(name)


# -- readiness ----------------------------------------------------------------------------------

def test_readiness_goes_from_not_ready_to_ready(server: Server):
    codes = [code for _, code in server.ready_history]
    assert codes[-1] == 200
    assert 503 in codes, f"never saw the model not ready: {server.ready_history[:20]}"
    assert codes.index(503) < codes.index(200)
    assert all(c in (0, 503) for c in codes[:-1])
    r = httpx.get(f"{server.url}/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["ready"] is True
    meta = httpx.get(f"{server.url}/v2/models/{MODEL}").json()
    assert meta["inputs"][0]["name"] == "text_input" and meta["inputs"][0]["datatype"] == "BYTES"
    assert meta["outputs"][0]["name"] == "text_output"


# -- v2 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_http(server: Server, reference, binary: bool):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_host, network_timeout=120)
    assert client.is_model_ready(MODEL)
    tensor = httpclient.InferInput("text_input", [len(PROMPTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object),
                               binary_data=binary)
    out = httpclient.InferRequestedOutput("text_output", binary_data=binary)
    result = client.infer(MODEL, [tensor], outputs=[out],
                          parameters={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    texts = [t.decode() if isinstance(t, bytes) else t for t in result.as_numpy("text_output")]
    assert texts == reference[0]


GRPC_CLIENT = """
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient

host, model, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
client = grpcclient.InferenceServerClient(host)
tensor = grpcclient.InferInput("text_input", [len(prompts)], "BYTES")
tensor.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object))
result = client.infer(model, [tensor], client_timeout=120,
                      parameters={"max_tokens": max_tokens, "temperature": 0.0})
print(json.dumps({"ready": client.is_model_ready(model),
                  "texts": [t.decode() for t in result.as_numpy("text_output")]}))
"""


def test_tritonclient_grpc(server: Server, reference):
    # In a subprocess: tritonclient.grpc's protos and KServe's (imported by tests/ in the same
    # pytest run) declare the same protobuf package and cannot share one process.
    proc = subprocess.run([sys.executable, "-c", GRPC_CLIENT, server.grpc_host, MODEL,
                           str(MAX_TOKENS), *PROMPTS], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ready"] is True
    assert result["texts"] == reference[0]


# -- OpenAI ---------------------------------------------------------------------------------------

def test_openai_models(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == ENGINE_OPTS["max_model_len"]


def test_openai_completions(oai, reference):
    texts, outs = reference
    r = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                               temperature=0)
    assert r.choices[0].text == texts[0]
    assert r.choices[0].finish_reason == outs[0].outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(outs[0].prompt_token_ids)
    assert r.usage.completion_tokens == len(outs[0].outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        r.usage.completion_tokens


def test_openai_completions_batch_of_token_ids(oai, reference, offline_llm):
    texts, outs = reference
    r = oai.completions.create(model=MODEL, prompt=[list(o.prompt_token_ids) for o in outs],
                               max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == texts
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)


def test_openai_chat(oai, chat_reference):
    ref = chat_reference.outputs[0]
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(chat_reference.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)

    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == ref.text
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


# -- errors ---------------------------------------------------------------------------------------

def test_bad_requests_get_4xx_and_server_stays_ready(server: Server):
    url = server.url
    long_prompt = "hello " * 1100
    cases = [
        ("post", "/openai/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("post", "/openai/v1/completions", b'{"model": "smol", "prompt": ', 400),
        ("post", "/openai/v1/completions", {"model": MODEL, "prompt": long_prompt}, 400),
        ("post", "/openai/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1024},
         400),
        ("post", "/openai/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, 400),
        ("post", "/openai/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}, 400),
        ("post", "/v2/models/nope/infer",
         {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
         404),
        ("post", f"/v2/models/{MODEL}/infer", b'{"inputs": [', 400),
        ("post", f"/v2/models/{MODEL}/infer",
         {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                      "data": [long_prompt]}]}, 400),
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        for _, path, body, status in cases:
            kwargs = ({"content": body, "headers": {"content-type": "application/json"}}
                      if isinstance(body, bytes) else {"json": body})
            r = client.post(path, **kwargs)
            assert r.status_code == status, (path, body if isinstance(body, bytes) else "", r.text)
            err = r.json()["error"]
            if path.startswith("/openai"):
                assert err["message"] and err["type"], r.text
            else:
                assert isinstance(err, str) and err, r.text
        assert "maximum context length is 1024" in client.post(
            "/openai/v1/completions", json={"model": MODEL, "prompt": long_prompt}
        ).json()["error"]["message"]
        assert client.get(f"/v2/models/{MODEL}/ready").status_code == 200
        ok = client.post("/openai/v1/completions",
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


# -- disconnects and metrics ----------------------------------------------------------------------

def test_killed_streaming_client_frees_the_engine(server: Server):
    # ignore_eos: a sampled story may end after two tokens (about 1 in 12 at temperature 0.8),
    # before the third chunk this test waits for.
    client_code = textwrap.dedent(f"""
        import openai, sys
        c = openai.OpenAI(base_url="{server.url}/openai/v1", api_key="x", max_retries=0)
        for chunk in c.completions.create(model="{MODEL}", prompt="Tell me a long story",
                                          max_tokens=500, stream=True, temperature=0.8,
                                          extra_body={{"ignore_eos": True}}):
            print("chunk", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", client_code], stdout=subprocess.PIPE,
                            text=True)
    try:
        for _ in range(3):
            assert proc.stdout.readline().startswith("chunk")
        assert value(metrics(server), "vllm:num_requests_running") >= 1
    finally:
        proc.kill()
        proc.wait(10)
    wait_idle(server, timeout=15)


@pytest.mark.parametrize("route", ["v2", "openai"])
def test_killed_non_streaming_client_frees_the_engine(server: Server, route: str):
    """A client that gives up on a long non-streaming call must not leave it generating."""
    if route == "v2":
        call = (f"httpx.post('{server.url}/v2/models/{MODEL}/infer', timeout=120, json={{"
                f"'inputs': [{{'name': 'text_input', 'datatype': 'BYTES', 'shape': [1], "
                f"'data': ['Tell me a long story']}}], "
                f"'parameters': {{'max_tokens': 900, 'ignore_eos': True}}}})")
    else:
        call = (f"httpx.post('{server.url}/openai/v1/completions', timeout=120, json={{"
                f"'model': '{MODEL}', 'prompt': 'Tell me a long story', 'max_tokens': 900, "
                f"'ignore_eos': True}})")
    proc = subprocess.Popen([sys.executable, "-c", f"import httpx; {call}"])
    try:
        deadline = time.monotonic() + 30
        while value(metrics(server), "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(10)
    wait_idle(server, timeout=10)


def test_metrics_after_traffic(server: Server, oai):
    oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    m = metrics(server)
    names = set(m)
    for name in METRIC_NAMES:
        if name in HISTOGRAMS:  # their samples are NAME_bucket / _count / _sum
            assert f"{name}_count" in names and f"{name}_bucket" in names, name
        elif name == "vllm:cache_config_info":
            assert value(m, name, block_size="16",
                         num_gpu_blocks=str(ENGINE_OPTS["num_kv_blocks"])) == 1
        else:
            assert name in names, name
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting") == 0
    assert 0 <= value(m, "vllm:kv_cache_usage_perc") <= 1
    assert value(m, "vllm:generation_tokens_total") >= 3
    assert value(m, "vllm:prompt_tokens_total") >= 1
    assert value(m, "vllm:prefix_cache_queries_total") >= value(m, "vllm:prefix_cache_hits_total")
    assert value(m, "vllm:e2e_request_latency_seconds_count") >= 1
    assert value(m, "vllm:time_to_first_token_seconds_count") >= 1
    assert value(m, "vllm:inter_token_latency_seconds_count") >= 2
    assert value(m, "vllm:request_queue_time_seconds_count") >= 1
    assert value(m, "vllm:iteration_tokens_total_count") >= 3
    ttft = value(m, "vllm:time_to_first_token_seconds_sum")
    e2e = value(m, "vllm:e2e_request_latency_seconds_sum")
    assert ttft > 0 and e2e > 0
    # What a Prometheus 2.x scrape (OpenMetrics accepted) receives keeps the vllm: names.
    r = httpx.get(f"{server.url}/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    assert "vllm:num_requests_running{" in r.text
    assert json.dumps(MODEL) in r.text
