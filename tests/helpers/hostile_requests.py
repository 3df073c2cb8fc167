"""Malformed, out-of-range and oversized requests for the v2 and OpenAI routes (`BAD`), and the
builders of their bodies: what e2e/test_reliability_input.py sends to a real server."""

from __future__ import annotations

import json
import struct
from typing import Any

from kserve_paged_engine.limits import DEFAULT_MAX_STOP

MODEL = "smol"  # tests/helpers/e2e_server.MODEL
V2 = f"/v2/models/{MODEL}/infer"
CMPL = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
MB = 1 << 20
MAX_MODEL_LEN = 64  # the server's, small: fuzzed requests without max_tokens generate the rest
# A legal regex (under the size limit) that xgrammar 0.2.9 takes ~25 s to compile on a quiet
# Sapphire Rapids core: 39 overlapping counted repetitions. ("[a-z]{1,20000}" compiles in
# under a second there: it was slow only on a loaded machine.)
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i},{i + 300}}}" for i in range(1, 40)) + ")"


def v2(data: Any = None, parameters: dict[str, Any] | None = None, **tensor: Any
       ) -> dict[str, Any]:
    t = {"name": "text_input", "datatype": "BYTES", "shape": [1],
         "data": ["Hi"] if data is None else data, **tensor}
    body: dict[str, Any] = {"inputs": [t]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def chat(content: Any = "Hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **fields}


def binary_v2(raw: bytes, *, size: int | None = None, header_length: str | None = None
              ) -> tuple[bytes, dict[str, str]]:
    """A tritonclient-style binary request: JSON header, then the BYTES tensor."""
    header = json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(raw) if size is None
                                                    else size}}],
                         "parameters": {"max_tokens": 2}}).encode()
    return header + raw, {"inference-header-content-length": header_length or str(len(header)),
                          "content-type": "application/octet-stream"}


def _bytes(s: str) -> bytes:
    return struct.pack("<I", len(s.encode())) + s.encode()


NESTED = b"[" * 100_000 + b"]" * 100_000
LONG = "hello " * 200  # > MAX_MODEL_LEN tokens
MEGA = "x" * MB

# (id, path, body: JSON-able or raw bytes, extra headers)
BAD: list[tuple[str, str, Any, dict[str, str]]] = [
    # v2: body
    ("v2-invalid-json", V2, b'{"inputs": [', {}),
    ("v2-non-utf8-body", V2, b"\xff\xfe\x00", {}),
    ("v2-empty-body", V2, b"", {}),
    ("v2-array-body", V2, b"[]", {}),
    ("v2-nested-bomb", V2, NESTED, {}),
    ("v2-no-inputs", V2, {}, {}),
    ("v2-empty-inputs", V2, {"inputs": []}, {}),
    ("v2-inputs-not-list", V2, {"inputs": "x"}, {}),
    ("v2-input-without-name", V2, {"inputs": [{"datatype": "BYTES", "shape": [1],
                                               "data": ["a"]}]}, {}),
    ("v2-wrong-input-name", V2, v2(name="other"), {}),
    # v2: datatype and shape
    ("v2-int32", V2, v2([1], datatype="INT32"), {}),
    ("v2-fp32", V2, v2([1.5], datatype="FP32"), {}),
    ("v2-bytes-holding-int", V2, v2([1]), {}),
    ("v2-bytes-holding-null", V2, v2([None]), {}),
    ("v2-bytes-holding-object", V2, v2([{"a": 1}]), {}),
    ("v2-shape-too-big", V2, v2(["a"], shape=[2]), {}),
    ("v2-shape-huge", V2, v2(["a"], shape=[10**12]), {}),
    ("v2-shape-negative", V2, v2(["a"], shape=[-1]), {}),
    ("v2-shape-string", V2, v2(["a"], shape=["x"]), {}),
    ("v2-no-data", V2, {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                    "shape": [1]}]}, {}),
    # v2: prompts
    ("v2-empty-string", V2, v2([""]), {}),
    ("v2-lone-surrogate", V2, b'{"inputs": [{"name": "text_input", "datatype": "BYTES", '
                              b'"shape": [1], "data": ["\\ud800"]}]}', {}),
    ("v2-prompt-too-long", V2, v2([LONG]), {}),
    ("v2-megabyte-prompt", V2, v2([MEGA]), {}),
    # v2: parameters
    ("v2-max-tokens-enormous", V2, v2(parameters={"max_tokens": 10**12}), {}),
    ("v2-max-tokens-negative", V2, v2(parameters={"max_tokens": -1}), {}),
    ("v2-max-tokens-float", V2, v2(parameters={"max_tokens": 2.5}), {}),
    ("v2-max-tokens-bool", V2, v2(parameters={"max_tokens": True}), {}),
    ("v2-max-tokens-text", V2, v2(parameters={"max_tokens": "abc"}), {}),
    ("v2-temperature-negative", V2, v2(parameters={"temperature": -1}), {}),
    ("v2-temperature-nan-text", V2, v2(parameters={"temperature": "nan"}), {}),
    ("v2-temperature-NaN", V2, b'{"inputs": [{"name": "text_input", "datatype": "BYTES", '
                               b'"shape": [1], "data": ["a"]}], '
                               b'"parameters": {"temperature": NaN}}', {}),
    ("v2-temperature-inf", V2, v2(parameters={"temperature": "inf"}), {}),
    ("v2-top-p-zero", V2, v2(parameters={"top_p": 0}), {}),
    ("v2-top-p-above-1", V2, v2(parameters={"top_p": 2}), {}),
    ("v2-top-k-negative", V2, v2(parameters={"top_k": -5}), {}),
    ("v2-min-p-above-1", V2, v2(parameters={"min_p": 1.5}), {}),
    ("v2-seed-text", V2, v2(parameters={"seed": "x"}), {}),
    ("v2-min-tokens-over-max", V2, v2(parameters={"max_tokens": 2, "min_tokens": 5}), {}),
    ("v2-stop-empty", V2, v2(parameters={"stop": ""}), {}),
    ("v2-stop-token-ids-text", V2, v2(parameters={"stop_token_ids": "a,b"}), {}),
    ("v2-stop-token-ids-negative", V2, v2(parameters={"stop_token_ids": "-1"}), {}),
    ("v2-priority-text", V2, v2(parameters={"priority": "x"}), {}),
    ("v2-cache-salt-int", V2, v2(parameters={"cache_salt": 5}), {}),
    ("v2-num-beams", V2, v2(parameters={"num_beams": 4}), {}),
    # v2: binary bodies
    ("v2-binary-non-utf8", V2, *binary_v2(struct.pack("<I", 3) + b"\xff\xfe\xfd")),
    ("v2-binary-truncated", V2, *binary_v2(_bytes("hello")[:6], size=9)),
    ("v2-binary-size-past-end", V2, *binary_v2(b"\x01\x00", size=100)),
    ("v2-binary-header-too-long", V2, *binary_v2(_bytes("hi"), header_length="999999")),
    ("v2-binary-header-negative", V2, *binary_v2(_bytes("hi"), header_length="-5")),
    ("v2-binary-header-text", V2, *binary_v2(_bytes("hi"), header_length="abc")),
    # OpenAI: body
    ("oai-invalid-json", CMPL, b'{"model": "smol", "prompt": ', {}),
    ("oai-non-utf8-body", CMPL, b'{"model": "smol", "prompt": "\xff\xfe"}', {}),
    ("oai-empty-body", CMPL, b"", {}),
    ("oai-array-body", CMPL, b"[]", {}),
    ("oai-nested-bomb", CMPL, NESTED, {}),
    ("oai-nested-bomb-in-prompt", CMPL, b'{"model": "smol", "prompt": ' + NESTED + b"}", {}),
    ("oai-control-char", CMPL, b'{"model": "smol", "prompt": "a\x00b"}', {}),
    ("oai-lone-surrogate", CMPL, b'{"model": "smol", "prompt": "\\ud800 hi"}', {}),
    ("oai-unknown-model", CMPL, cmpl(model="nope"), {}),
    ("oai-no-prompt", CMPL, {"model": MODEL}, {}),
    # OpenAI: prompts
    ("oai-empty-prompt", CMPL, cmpl(prompt=""), {}),
    ("oai-empty-prompt-list", CMPL, cmpl(prompt=[]), {}),
    ("oai-empty-token-list", CMPL, cmpl(prompt=[[]]), {}),
    ("oai-empty-string-in-list", CMPL, cmpl(prompt=["a", ""]), {}),
    ("oai-negative-token", CMPL, cmpl(prompt=[-1]), {}),
    ("oai-token-out-of-vocab", CMPL, cmpl(prompt=[10**9]), {}),
    ("oai-token-enormous", CMPL, cmpl(prompt=[10**30]), {}),
    ("oai-token-float", CMPL, cmpl(prompt=[1.5]), {}),
    ("oai-token-bool", CMPL, cmpl(prompt=[True]), {}),
    ("oai-mixed-prompt", CMPL, cmpl(prompt=["a", [1, 2]]), {}),
    ("oai-prompt-object", CMPL, cmpl(prompt={"a": 1}), {}),
    ("oai-prompt-null", CMPL, cmpl(prompt=None), {}),
    ("oai-prompt-too-long", CMPL, cmpl(prompt=LONG), {}),
    ("oai-megabyte-prompt", CMPL, cmpl(prompt=MEGA), {}),
    # OpenAI: sampling values
    ("oai-max-tokens-enormous", CMPL, cmpl(max_tokens=10**12), {}),
    ("oai-max-tokens-huge-int", CMPL, cmpl(max_tokens=10**30), {}),
    ("oai-max-tokens-negative", CMPL, cmpl(max_tokens=-1), {}),
    ("oai-max-tokens-fraction", CMPL, cmpl(max_tokens=2.5), {}),
    ("oai-temperature-NaN", CMPL, b'{"model": "smol", "prompt": "Hi", "temperature": NaN}', {}),
    ("oai-temperature-Infinity", CMPL,
     b'{"model": "smol", "prompt": "Hi", "temperature": Infinity}', {}),
    ("oai-temperature-overflow", CMPL, b'{"model": "smol", "prompt": "Hi", "temperature": 1e400}',
     {}),
    ("oai-temperature-negative", CMPL, cmpl(temperature=-0.5), {}),
    ("oai-top-p-above-1", CMPL, cmpl(top_p=1.5), {}),
    ("oai-top-k-negative", CMPL, cmpl(top_k=-7), {}),
    ("oai-min-p-negative", CMPL, cmpl(min_p=-1), {}),
    ("oai-min-tokens-negative", CMPL, cmpl(min_tokens=-3), {}),
    ("oai-min-tokens-over-max", CMPL, cmpl(min_tokens=10), {}),
    ("oai-stop-empty-string", CMPL, cmpl(stop=[""]), {}),
    ("oai-stop-not-strings", CMPL, cmpl(stop=[1, 2]), {}),
    ("oai-stop-token-negative", CMPL, cmpl(stop_token_ids=[-1]), {}),
    ("oai-stream-options-bad", CMPL, cmpl(stream=True, stream_options={"include_usage": "x"}),
     {}),
    ("oai-stream-options-without-stream", CMPL, cmpl(stream_options={"include_usage": True}),
     {}),
    ("oai-n-129", CMPL, cmpl(n=129), {}),
    ("oai-n-0", CMPL, cmpl(n=0), {}),
    ("oai-best-of-not-n", CMPL, cmpl(best_of=3), {}),
    ("oai-logprobs-21", CMPL, cmpl(logprobs=21), {}),
    ("oai-suffix", CMPL, cmpl(suffix="x"), {}),
    ("oai-penalty-out-of-range", CMPL, cmpl(presence_penalty=2.5), {}),
    ("oai-logit-bias-out-of-vocab", CMPL, cmpl(logit_bias={"99999999": 5}), {}),
    ("oai-logit-bias-over-100", CMPL, cmpl(logit_bias={"1": 101}), {}),
    ("oai-beam-search-streamed", CMPL, cmpl(use_beam_search=True, stream=True), {}),
    ("oai-json-mode-and-regex", CMPL, cmpl(response_format={"type": "json_object"},
                                            guided_regex="a+"), {}),
    ("oai-bad-regex", CMPL, cmpl(guided_regex="(a"), {}),
    ("oai-bad-grammar", CMPL, cmpl(structured_outputs={"grammar": "root ::= nothing"}), {}),
    ("oai-cache-salt-int", CMPL, cmpl(cache_salt=5), {}),
    ("oai-priority-text", CMPL, cmpl(priority="high"), {}),
    # chat
    ("chat-no-messages", CHAT, {"model": MODEL, "messages": []}, {}),
    ("chat-message-not-object", CHAT, {"model": MODEL, "messages": ["x"]}, {}),
    ("chat-role-int", CHAT, {"model": MODEL, "messages": [{"role": 5, "content": "x"}]}, {}),
    ("chat-content-int", CHAT, chat(5), {}),
    ("chat-image-part", CHAT, chat([{"type": "image_url", "image_url": {"url": "x"}}]), {}),
    ("chat-lone-surrogate", CHAT,
     b'{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}]}', {}),
    ("chat-too-long", CHAT, chat(LONG), {}),
    ("chat-megabyte", CHAT, chat(MEGA), {}),
    ("chat-max-completion-tokens-enormous", CHAT, chat(max_completion_tokens=10**12), {}),
    ("chat-tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "no spaces"}}]), {}),
    ("chat-tool-choice-unknown-function", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), {}),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), {}),
    ("chat-bad-json-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}), {}),
    ("chat-continue-and-generation-prompt", CHAT, chat(continue_final_message=True), {}),
    # Past --max_stop (issue 49: every list a client sends is capped by a flag).
    ("oai-thousands-of-stop-strings", CMPL, cmpl(stop=[f"zz{i}" for i in range(5000)]), {}),
]

# Accepted on purpose: unknown fields are ignored (with a warning in the log), and odd but
# valid values work. As many stop strings as --max_stop allows and a megabyte stop string are
# valid requests.
GOOD: list[tuple[str, str, Any, dict[str, str]]] = [
    ("oai-unknown-field", CMPL, cmpl(unknown_field={"x": 1}), {}),
    ("chat-unknown-field", CHAT, chat(foo="bar"), {}),
    ("v2-unknown-parameter", V2, v2(parameters={"max_tokens": 2, "bogus_option": 1}), {}),
    ("oai-stop-strings-at-the-cap", CMPL, cmpl(stop=[f"zz{i}" for i in range(DEFAULT_MAX_STOP)]),
     {}),
    ("oai-megabyte-stop-string", CMPL, cmpl(stop=["y" * MB]), {}),
    ("v2-megabyte-stop-string", V2, v2(parameters={"max_tokens": 2, "stop": "y" * MB}), {}),
    ("oai-no-model-field", CMPL, {"prompt": "Hi", "max_tokens": 2}, {}),
    ("oai-all-sampling-options", CMPL, cmpl(n=3, best_of=3, logprobs=5, echo=True,
                                            prompt_logprobs=2, presence_penalty=-2,
                                            frequency_penalty=2, repetition_penalty=100,
                                            logit_bias={"1": -100, "2": 100}, seed=1,
                                            include_stop_str_in_output=True,
                                            skip_special_tokens=False), {}),
    ("chat-all-sampling-options", CHAT, chat(n=2, logprobs=True, top_logprobs=20,
                                             max_completion_tokens=2, logit_bias={"1": 5},
                                             presence_penalty=1), {}),
    ("oai-huge-seed", CMPL, cmpl(seed=10**30), {}),
    ("oai-huge-top-k", CMPL, cmpl(top_k=10**12, temperature=1.0), {}),
    ("oai-tiny-temperature", CMPL, cmpl(temperature=1e-300), {}),
    ("oai-huge-temperature", CMPL, cmpl(temperature=1e300), {}),
    ("oai-max-tokens-zero", CMPL, cmpl(max_tokens=0, echo=True, logprobs=1), {}),
    ("oai-json-mode", CMPL, cmpl(response_format={"type": "json_object"}), {}),
    ("v2-beam-width", V2, v2(parameters={"max_tokens": 2, "beam_width": 2}), {}),
    ("oai-beam-search", CMPL, cmpl(use_beam_search=True), {}),
    ("v2-guided-choice", V2, v2(parameters={"max_tokens": 4, "guided_choice": '["a", "b"]'}),
     {}),
    ("chat-tools-auto", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     {}),
]


