"""Large request bodies are parsed in the body decoder's child process (issue 49, item 4: one
client's body must not hold the server's GIL), with the same values and the same refusals as
the in-place parse of small bodies."""

from __future__ import annotations

import json
import math
import os

import pytest

from kserve_paged import body_decode
from kserve_paged.body_decode import BodyDecoder, BodySurrogate, BodyTooDeep


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


def test_a_child_that_cannot_start_falls_back_to_parsing_here(decoder, monkeypatch, caplog):
    monkeypatch.setattr(body_decode, "CHILD_SCRIPT", body_decode.CHILD_SCRIPT + ".absent")
    assert decoder.decode(b'{"a": [1]}') == {"a": [1]}
    assert "failed twice" in caplog.text


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
