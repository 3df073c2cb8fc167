"""Large request bodies are parsed in the body decoder's child process (issue 49, item 4: one
client's body must not hold the server's GIL), with the same values and the same refusals as
the in-place parse of small bodies."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from kserve_paged import body_decode
from kserve_paged.body_decode import (
    BodyCrashedDecoder,
    BodyDecoder,
    BodySurrogate,
    BodyTooCostly,
    BodyTooDeep,
)


@pytest.fixture
def decoder():
    dec = BodyDecoder()
    yield dec
    dec.close()


BODIES = [
    b"",
    b'{"model": "m", "prompt": "h\\u00e9llo \\ud83d\\ude00", "n": 2, "temperature": 0.5}',
    json.dumps({"prompt": list(range(200_000)), "stop": ["a"] * 300,
                "nested": [[[{"x": None, "y": True, "z": -1.5e-300}]]]}).encode(),
]


@pytest.mark.parametrize("raw", BODIES, ids=["empty", "small", "large"])
def test_the_child_returns_what_json_loads_returns(decoder, raw):
    expected = json.loads(raw) if raw else None
    assert decoder.decode(raw) == expected
    assert body_decode.decode_in_place(raw) == expected


def test_nan_is_read_as_the_standard_parser_reads_it(decoder):
    assert math.isnan(decoder.decode(b'{"t": NaN}')["t"])


@pytest.mark.parametrize("raw, error", [
    (b"[" * 5000 + b"]" * 5000, BodyTooDeep),
    (b'{"prompt": "\\ud800"}', BodySurrogate),
    (b'{"prompt": ', ValueError),
    (b"\xff\xfe", ValueError),
])
def test_refusals_match_in_both_places(decoder, raw, error):
    with pytest.raises(error):
        decoder.decode(raw)
    with pytest.raises(error):
        body_decode.decode_in_place(raw)


def test_the_parse_happens_in_another_process(decoder, monkeypatch):
    """With this process's parser broken, the child still decodes: the work is not here."""
    def broken(*args, **kwargs):
        raise AssertionError("parsed in the server process")

    monkeypatch.setattr(json, "loads", broken)
    assert decoder.decode(b'{"ids": [1, 2, 3]}') == {"ids": [1, 2, 3]}
    assert decoder.pid not in (None, os.getpid())


def test_a_killed_child_is_replaced(decoder):
    assert decoder.decode(b"[1]") == [1]
    first = decoder.pid
    os.kill(first, 9)
    assert decoder.decode(b"[2]") == [2]
    assert decoder.pid not in (None, first)


@pytest.mark.parametrize("missing", ["script", "interpreter"])
def test_a_child_that_cannot_start_falls_back_to_parsing_here(decoder, monkeypatch, caplog,
                                                              missing):
    """No body has reached a child that cannot start: the environment is at fault, and the
    body is parsed here, as before the child existed, with a log line."""
    if missing == "script":
        monkeypatch.setattr(body_decode, "CHILD_SCRIPT", body_decode.CHILD_SCRIPT + ".absent")
    else:
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert decoder.decode(b'{"a": [1]}') == {"a": [1]}
    assert "could not start twice running" in caplog.text


# The real child, with its parser made to end the child ("crash"), never answer while idle
# ("hang") or busy ("spin"), or answer late without using CPU ("nap", a parse waiting for the
# CPU on a busy server) on bodies that start so: the hostile bodies stdlib json itself has no
# example of. While the file `no_start` exists, a new child exits before it is ready.
HOOKED_CHILD = """
import json, os, runpy, time
if os.path.exists({no_start!r}):
    raise SystemExit(1)
parse = json.loads
def loads(raw, *args, **kwargs):
    if raw.startswith(b'"crash'):
        os.kill(os.getpid(), 9)
    if raw.startswith(b'"hang'):
        time.sleep(10)
    if raw.startswith(b'"spin'):
        while True:
            pass
    if raw.startswith(b'"nap'):
        time.sleep(0.6)
    return parse(raw, *args, **kwargs)
json.loads = loads
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    script = tmp_path / "hooked_child.py"
    script.write_text(HOOKED_CHILD.format(script=body_decode.CHILD_SCRIPT,
                                          no_start=str(tmp_path / "no_start")))
    monkeypatch.setattr(body_decode, "CHILD_SCRIPT", str(script))
    dec = BodyDecoder(seconds_for=lambda size: 30.0, wall_factor=2.0)
    yield dec
    dec.close()


def test_a_body_past_its_bound_is_refused_and_the_child_replaced(hooked):
    assert hooked.decode(b"[1]") == [1]
    first = hooked.pid
    hooked.seconds_for = lambda size: 0.3  # the child is up: this bounds the body alone
    with pytest.raises(BodyTooCostly, match=r"within 0\.3 s"):
        hooked.decode(b'"hang"')
    assert hooked.pid is None  # killed, not left to finish
    hooked.seconds_for = lambda size: 30.0
    assert hooked.decode(b"[2]") == [2]
    assert hooked.pid not in (None, first)


def test_the_bound_counts_the_childs_cpu_time_not_the_clock(hooked):
    hooked.decode(b"[0]")  # the child is up: the bounds below are the body's alone
    hooked.seconds_for = lambda size: 0.3
    hooked.wall_factor = 10.0
    with pytest.raises(BodyTooCostly, match=r"within 0\.3 s"):
        hooked.decode(b'"spin"')  # busy: its CPU time meets the bound long before the clock's
    assert hooked.pid is None
    # Idle for twice the bound (as a child at nice 19 waits for CPU on a busy server), then
    # an answer: not refused.
    assert hooked.decode(b'"nap"') == "nap"


def test_a_body_that_ends_the_child_is_refused_not_parsed_here(hooked, monkeypatch, caplog):
    """The body is tried in a fresh child once more (the first may have died idle), then
    refused: never parsed in the server process, the case the child exists for."""
    def broken(*args, **kwargs):
        raise AssertionError("parsed in the server process")

    monkeypatch.setattr(json, "loads", broken)
    assert hooked.decode(b"[1]") == [1]
    first = hooked.pid
    with pytest.raises(BodyCrashedDecoder, match="ended the server's JSON parser process"):
        hooked.decode(b'"crash"')
    assert "ended the body decoder's child" in caplog.text
    assert hooked.decode(b"[2]") == [2]
    assert hooked.pid not in (None, first)


def test_a_body_that_ends_the_child_is_refused_even_when_no_child_starts_after(
        hooked, monkeypatch, tmp_path):
    """The fallback to parsing here is for a child that cannot start before any body reached
    it, not for a body that has just ended one."""
    def broken(*args, **kwargs):
        raise AssertionError("parsed in the server process")

    monkeypatch.setattr(json, "loads", broken)
    assert hooked.decode(b"[1]") == [1]
    (tmp_path / "no_start").touch()
    with pytest.raises(BodyCrashedDecoder):
        hooked.decode(b'"crash"')


@pytest.mark.parametrize("body, bound, status, message", [
    (b'"hang"', 0.3, 413, r"^the request body \(\d+ bytes\) was not parsed within 0\.3 s"),
    (b'"crash"', 30.0, 400, "^the request body could not be parsed: it ended the server's JSON "
     "parser process"),
], ids=["hang", "crash"])
def test_the_routes_answer_the_refusals_with_4xx(hooked, monkeypatch, body, bound, status,
                                                 message):
    """read_json, which every JSON route parses its body with, turns both into a client
    error naming the cause, never a 500; the large body queued behind it is decoded."""
    import asyncio

    from kserve_paged.openai import schemas
    from kserve_paged.openai.errors import APIError

    pad = b" " * schemas.DECODE_OFF_PROCESS_BYTES  # large: both go to the child
    hostile, queued = body + pad, b'{"ids": [1, 2, 3]}' + pad
    assert hooked.decode(b"[1]") == [1]
    # The hostile body's bound is short; the others' generous, so a slow machine fails none.
    hooked.seconds_for = lambda size: bound if size == len(hostile) else 30.0
    monkeypatch.setattr(body_decode, "DECODER", hooked)

    class Request:
        def __init__(self, raw: bytes) -> None:
            self.raw = raw

        async def body(self) -> bytes:
            return self.raw

    async def main() -> list[object]:
        return await asyncio.gather(schemas.read_json(Request(hostile)),
                                    schemas.read_json(Request(queued)), return_exceptions=True)

    refused, decoded = asyncio.run(main())
    assert isinstance(refused, APIError), refused
    assert refused.status == status
    assert re.search(message, refused.message), refused.message
    assert decoded == {"ids": [1, 2, 3]}


def test_queued_large_bodies_leave_the_default_pool_free(monkeypatch):
    """Large bodies wait for the child one at a time; they wait in the decoder's own thread,
    never in asyncio's default pool, which tokenizes and renders for every other request."""
    import asyncio
    import threading

    from kserve_paged.openai import schemas

    release = threading.Event()
    monkeypatch.setattr(body_decode.DECODER, "decode", lambda raw: release.wait(30) and {})

    class Body:
        async def body(self) -> bytes:
            return b" " * (schemas.DECODE_OFF_PROCESS_BYTES + 1)

    async def main() -> None:
        waiting = [asyncio.create_task(schemas.read_json(Body())) for _ in range(40)]
        await asyncio.sleep(0.2)
        try:  # more bodies than the default pool has threads are queued now
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 10) == "free"
        finally:
            release.set()
        await asyncio.gather(*waiting)

    asyncio.run(main())


def test_the_child_script_needs_only_the_standard_library():
    # -S as well as -I: no site-packages either, so a server run from a checkout on PYTHONPATH
    # (which -I drops) still gets a child that starts and parses.
    proc = subprocess.Popen([sys.executable, "-I", "-S", body_decode.CHILD_SCRIPT],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    try:
        assert body_decode._read_frame(proc.stdout) == body_decode.READY
        body_decode._write_frame(proc.stdin, b'{"a": [1, 2.5]}')
        assert body_decode._value(body_decode._read_frame(proc.stdout)) == {"a": [1, 2.5]}
    finally:
        body_decode._end(proc)
