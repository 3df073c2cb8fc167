"""The soak's request catalogue: every request it sends is built from (kind, variant, stream).

Why a pure function of the key: the reference phase sends each deterministic request once,
alone, and the load phase sends the same body again among everything else; equal keys are
equal bodies, so a greedy answer under load must be the answer alone (see soak_checks).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CMPL = "/openai/v1/completions"
CHAT = "/openai/v1/chat/completions"
LOAD = "/openai/v1/load_lora_adapter"
UNLOAD = "/openai/v1/unload_lora_adapter"
ADAPTERS = ("a1", "a2")
EXACT, REPORT = "exact", "report"

COMPLETION_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                      "def fibonacci(n):", "The three primary colors are"]
CHAT_PROMPTS = ["What is the capital of Italy?", "Give me one short tip for learning to cook.",
                "Name three planets."]
REPETITIVE_PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",
                      "the cat sat on the mat. the cat sat on the mat. the cat sat on the"]
WORDS = ["river", "mountain", "silver", "quiet", "lantern", "harbor", "meadow", "thunder",
         "velvet", "orchard", "copper", "whisper", "glacier", "ember", "falcon", "prairie"]
SUFFIXES = [" In one word, the mood is", " The next line reads:"]
CITY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
    "required": ["name", "country", "population"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a timezone",
        "parameters": {"type": "object", "properties": {
            "timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"], "additionalProperties": False}}}]
TOOL_ASK = "What is the weather in Paris, and the time in Tokyo?"


def prefix(i: int) -> str:
    """A ~300-token document, one per i: the long prefixes that requests share."""
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(290)) + "."


@dataclass(frozen=True)
class Spec:
    """One request to send and what a correct answer is."""

    kind: str
    variant: int
    route: str
    body: Any  # a JSON-able object, or raw bytes for malformed bodies
    stream: bool = False
    expect: int = 200  # the status code it must get (4xx for invalid requests)
    # Compared with the answer of the same request alone: EXACT (a failure when it differs,
    # greedy and beam) or REPORT (seeded sampling: counted, not judged).
    compare: str | None = None
    ref_repeat: int = 1  # n greedy choices: the alone answer repeated n times
    ref_kind: str | None = None  # the reference's kind when it is another kind's (n greedy)
    adapter: str | None = None
    disconnect_after_chunks: int | None = None  # stream: read this many events, then close
    abandon_after_s: float | None = None  # non-stream: give up waiting after this long

    @property
    def ref_key(self) -> str:
        return f"{self.ref_kind or self.kind}/{self.variant}"


def _cmpl(model: str, prompt: Any, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def _chat(model: str, content: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw}


def _v2(prompt: str, **parameters: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                        "data": [prompt]}], "parameters": parameters}


def _stream(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {**body, "stream": True} if stream else body


def valid_spec(model: str, kind: str, variant: int, stream: bool) -> Spec:
    """The valid request (kind, variant); `stream` is honoured where the kind allows it."""
    v = variant
    if kind == "completion":
        body = _cmpl(model, COMPLETION_PROMPTS[v], 12)
        return Spec(kind, v, CMPL, _stream(body, stream), stream, compare=EXACT)
    if kind == "chat":
        body = _chat(model, CHAT_PROMPTS[v], 12)
        return Spec(kind, v, CHAT, _stream(body, stream), stream, compare=EXACT)
    if kind == "prefix":  # 3 documents x 2 questions: blocks shared across requests
        body = _cmpl(model, prefix(v % 3) + SUFFIXES[v // 3], 8)
        if stream:  # the usage (cached tokens) comes in a last chunk
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        return Spec(kind, v, CMPL, body, stream, compare=EXACT)
    if kind == "repetitive":  # prompt lookup proposes drafts: n-gram speculation at work
        body = _cmpl(model, REPETITIVE_PROMPTS[v], 24, ignore_eos=True)
        return Spec(kind, v, CMPL, _stream(body, stream), stream, compare=EXACT)
    if kind == "n_greedy":  # every greedy choice is the n=1 answer
        body = _cmpl(model, COMPLETION_PROMPTS[v], 12, n=3)
        return Spec(kind, v, CMPL, _stream(body, stream), stream, compare=EXACT,
                    ref_repeat=3, ref_kind="completion")
    if kind == "n_sampled":  # seeded: compared too, but only reported (not greedy)
        body = _cmpl(model, COMPLETION_PROMPTS[v], 12, n=2, temperature=0.8, seed=7 + v)
        return Spec(kind, v, CMPL, _stream(body, stream), stream, compare=REPORT)
    if kind == "beam":  # results are final only: never streamed
        body = _cmpl(model, COMPLETION_PROMPTS[v], 8, n=2, best_of=3, use_beam_search=True)
        return Spec(kind, v, CMPL, body, False, compare=EXACT)
    if kind == "json_schema":
        fmt = {"type": "json_schema",
               "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
        body = _chat(model, f"Describe {CITIES[v]} as JSON.", 64, response_format=fmt)
        return Spec(kind, v, CHAT, _stream(body, stream), stream, compare=EXACT)
    if kind == "tools":  # 0: tool_choice required, 1: a named function
        choice: Any = "required" if v == 0 else {"type": "function",
                                                 "function": {"name": "get_time"}}
        body = _chat(model, TOOL_ASK, 64, tools=TOOLS, tool_choice=choice,
                     parallel_tool_calls=False)
        return Spec(kind, v, CHAT, _stream(body, stream), stream, compare=EXACT)
    if kind == "v2":
        body = _v2(COMPLETION_PROMPTS[2 + v], max_tokens=12, temperature=0)
        return Spec(kind, v, f"/v2/models/{model}/infer", body, False, compare=EXACT)
    if kind == "lora":  # 2 adapters x 2 prompts
        name = ADAPTERS[v % 2]
        body = _cmpl(name, COMPLETION_PROMPTS[v // 2], 12)
        return Spec(kind, v, CMPL, _stream(body, stream), stream, compare=EXACT,
                    adapter=name)
    if kind == "disconnect":  # 0-3: stream, close after v events; 4-7: stop waiting
        body = _cmpl(model, COMPLETION_PROMPTS[v % 4], 128, ignore_eos=True)
        if v < 4:
            return Spec(kind, v, CMPL, _stream(body, True), True, disconnect_after_chunks=v)
        return Spec(kind, v, CMPL, body, False, abandon_after_s=0.4 * (v - 3))
    raise KeyError(kind)


VARIANTS = {"completion": 4, "chat": 3, "prefix": 6, "repetitive": 2, "n_greedy": 4,
            "n_sampled": 4, "beam": 2, "json_schema": 2, "tools": 2, "v2": 2, "lora": 4,
            "disconnect": 8}
STREAMABLE = {"completion", "chat", "prefix", "repetitive", "n_greedy", "n_sampled",
              "json_schema", "tools", "lora"}
# How often each kind is drawn (relative). Invalid requests are one kind among the others.
WEIGHTS = {"completion": 12, "chat": 8, "prefix": 12, "repetitive": 5, "n_greedy": 4,
           "n_sampled": 4, "beam": 4, "json_schema": 5, "tools": 5, "v2": 5, "lora": 10,
           "disconnect": 6, "invalid": 8}


def invalid_specs(model: str, lora: bool = True) -> list[Spec]:
    """Requests that must be refused, each with the status code it must get (the adapter
    routes' only with runtime LoRA updates on: off, they are 404s whatever the body)."""
    v2 = f"/v2/models/{model}/infer"
    cases: list[tuple[str, Any, int]] = [
        (CMPL, _cmpl(model, "Hi", -1), 400),
        (CMPL, _cmpl(model, "Hi", 4, n=0), 400),
        (CMPL, _cmpl(model, "Hi", 4, temperature=-0.5), 400),
        (CMPL, _cmpl("no-such-model", "Hi", 4), 404),
        (CMPL, _cmpl(model, "Hi", 4, stream=True, use_beam_search=True, n=2), 400),
        (CMPL, _cmpl(model, "Hi", 4, n=1, best_of=3), 400),
        (CMPL, _cmpl(model, "Hi", 10**9), 400),
        (CMPL, _cmpl(model, "Hi", 4, logit_bias={"999999999": 5}), 400),
        (CMPL, b'{"model": "' + model.encode() + b'", "prompt": ', 400),
        (CHAT, _chat(model, "Hi", 4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400),
        (CHAT, {"model": model, "messages": [], "max_tokens": 4}, 400),
        (CHAT, _chat(model, "Hi", 4, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "not_a_tool"}}), 400),
        (CHAT, _chat("ghost-adapter", "Hi", 4), 404),
        (v2, {"inputs": [{"name": "text_input", "datatype": "INT32", "shape": [1],
                          "data": [1]}]}, 400),
        (v2, _v2("", max_tokens=4), 400),
        (LOAD, {"lora_name": "ghost", "lora_path": "/nonexistent/adapter"}, 400),
        (LOAD, {"lora_name": model, "lora_path": "/nonexistent/adapter"}, 400),
        (UNLOAD, {"lora_name": "ghost"}, 404),
    ]
    return [Spec("invalid", i, route, body, expect=code)
            for i, (route, body, code) in enumerate(cases)
            if lora or route not in (LOAD, UNLOAD)]


def variants(kind: str, cap: int | None = None) -> int:
    """How many variants of `kind` are sent. `cap` bounds the compared kinds' (so the
    reference phase is short), never below MIN_VARIANTS."""
    n = VARIANTS[kind]
    if cap is None or kind not in COMPARED:
        return n
    return min(n, max(cap, MIN_VARIANTS.get(kind, 1)))


# Below these, a part of the soak would not happen: both adapters in use; more shared
# documents (3 x 18 blocks) than the pool keeps cached next to the running requests.
MIN_VARIANTS = {"lora": 2, "prefix": 3}


COMPARED = {"completion", "chat", "prefix", "repetitive", "n_greedy", "n_sampled", "beam",
            "json_schema", "tools", "v2", "lora"}


def reference_specs(model: str, kinds: set[str] | None = None,
                    cap: int | None = None) -> list[Spec]:
    """Every request compared with its answer alone, once, not streamed: what the reference
    phase sends (n greedy shares the completion references, so it is left out)."""
    out = []
    for kind in VARIANTS:
        if kinds is not None and kind not in kinds:
            continue
        for v in range(variants(kind, cap)):
            spec = valid_spec(model, kind, v, stream=False)
            if spec.compare and spec.ref_kind is None:
                out.append(spec)
    return out


def mix(model: str, seed: int, kinds: set[str], cap: int | None = None) -> Iterator[Spec]:
    """The endless seeded sequence of requests the clients share: every kind once first (in a
    seeded order, so even a short soak sends each), then weighted draws."""
    rng = random.Random(seed)
    names = [k for k in WEIGHTS if k in kinds]
    weights = [WEIGHTS[k] for k in names]
    invalid = invalid_specs(model, lora="lora" in kinds)
    first = rng.sample(names, len(names))
    while True:
        kind = first.pop() if first else rng.choices(names, weights)[0]
        if kind == "invalid":
            yield invalid[rng.randrange(len(invalid))]
            continue
        variant = rng.randrange(variants(kind, cap))
        stream = kind in STREAMABLE and rng.random() < 0.5
        yield valid_spec(model, kind, variant, stream)


def describe_body(spec: Spec) -> str:
    """A short printable form of a request, for failure reports."""
    text = spec.body.decode(errors="replace") if isinstance(spec.body, bytes) else \
        json.dumps(spec.body)
    return text if len(text) <= 300 else text[:300] + "..."
