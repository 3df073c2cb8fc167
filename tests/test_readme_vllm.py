"""Every example of docs/serving.md's section on vLLM's command line and routes runs: each `vllm
serve` line goes through our `vllm` command's translation and the server's parser and checks
(as the container would, up to starting the server), each `curl` line is sent to the server in
process (fake engine, the default model's real tokenizer) with the flags of the examples: the
served names and the API key."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from pathlib import Path

import pytest

from kserve_paged.args import parse_args
from kserve_paged.gateway import api_key, check_gateway_args, served_names
from kserve_paged.vllm_cli import VLLM_DEFAULT_PORT, serve_argv
from tests.helpers.server import FakeEngine, client, ready

README = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
SECTION = "## vLLM's command line and routes"


def _examples() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start + 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


EXAMPLES = _examples()
SERVES = [e for e in EXAMPLES if e.startswith("vllm serve ")]
CURLS = [e for e in EXAMPLES if e.startswith("curl ")]


def test_the_section_has_examples_of_flags_and_routes():
    assert len(SERVES) >= 4 and len(CURLS) >= 5
    assert set(EXAMPLES) == set(SERVES) | set(CURLS)  # nothing left unrun


@pytest.mark.parametrize("line", SERVES)
def test_each_vllm_serve_example_parses_and_passes_the_servers_checks(line, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("tls.crt", "tls.key"):  # the example's files, relative to where it runs
        (tmp_path / name).write_text("x")
    args = parse_args(serve_argv(shlex.split(line)[2:]))
    assert check_gateway_args(args) is None
    assert args.http_port == VLLM_DEFAULT_PORT and args.model_dir == "/mnt/models"
    words = shlex.split(line)
    for flag in [w for w in words if w.startswith("--")]:
        value = words[words.index(flag) + 1] if words.index(flag) + 1 < len(words) else None
        attr = flag[2:].replace("-", "_")
        if attr == "served_model_name":
            assert served_names(args)[0] == value
        elif value is not None and not value.startswith("--") and hasattr(args, attr):
            assert str(getattr(args, attr)) == value, flag
    if "--api-key" in words:
        assert api_key(args) == words[words.index("--api-key") + 1]


def _request(line: str) -> tuple[str, str, dict[str, str], dict | None]:
    """A curl line as (method, path, headers, JSON body)."""
    words = shlex.split(line)[1:]
    url = next(w for w in words if w.startswith("localhost:"))
    headers, body = {}, None
    for flag, value in zip(words, words[1:]):
        if flag == "-H":
            key, _, val = value.partition(":")
            headers[key.strip().lower()] = val.strip()
        elif flag == "-d":
            body = json.loads(value)
    return ("POST" if body is not None else "GET"), url.split("/", 1)[1], headers, body


def _key_and_names() -> tuple[str, list[str]]:
    """The key and served names of the examples' command lines."""
    key, names = None, []
    for line in SERVES:
        args = parse_args(serve_argv(shlex.split(line)[2:]))
        key = key or args.api_key
        names += [n for n in served_names(args) if n not in names and n != "/mnt/models"]
    assert key and names
    return key, names


@pytest.mark.slow
def test_each_curl_example_answers_and_without_the_key_is_refused():
    from transformers import AutoTokenizer

    from kserve_paged_engine.frontend.default_model import ensure_default_model

    key, names = _key_and_names()
    engine = FakeEngine()
    engine.tokenizer = AutoTokenizer.from_pretrained(
        ensure_default_model(progress=lambda _: None))

    async def main() -> None:
        app, model, _ = await ready(engine, names=names, api_key=key)
        async with client(app) as c:
            for line in CURLS:
                method, path, headers, body = _request(line)
                r = await c.request(method, "/" + path, headers=headers, json=body)
                assert r.status_code == 200, (line, r.text)
                if "authorization" in headers:
                    bare = await c.request(method, "/" + path, json=body)
                    assert bare.status_code == 401, line
                if path.startswith("tokenize") and body.get("prompt") == "Hello world":
                    detok = next(_request(x)[3] for x in CURLS if "/detokenize" in x)
                    assert r.json()["tokens"] == detok["tokens"]  # the doc agrees
        model.stop_engine()
    asyncio.run(asyncio.wait_for(main(), 120))
