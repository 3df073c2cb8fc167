"""Request bodies decoded into JSON values; a large one in a child process.

Why a process: CPython's JSON parser holds the GIL for the whole parse, so a 32 MiB body
decoded on a server thread stops the engine thread (and every other request) for seconds. In
the child, at the lowest priority, it costs the cores the engine leaves idle; marshal hands
the value back at a small fraction of the parse's cost.

One child serves the process, started at the first large body and again if it dies; bodies
queue for it one at a time in one thread of their own (EXECUTOR), so a client sending many
large bodies waits behind its own, while small bodies (decoded in place), asyncio's default
pool and the engine thread go on. Should the child fail
to start twice running, the body is decoded in place, as before, and the log says so.

This file is also the child's script (`python -I body_decode.py`): it imports nothing but the
standard library, so the child is a few MiB and starts fast. Frames on the child's stdin and
stdout: an 8-byte big-endian length, then that many bytes. A reply's first byte says what
follows: b"o" marshal bytes, b"d" nested too deeply, b"u" a lone surrogate, b"j" not JSON (the
parser's message follows).
"""

from __future__ import annotations

import json
import logging
import marshal
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

HEADER = 8


class BodyTooDeep(ValueError):
    """The body nests deeper than the parser (or marshal) goes."""


class BodySurrogate(ValueError):
    """The body escapes a lone surrogate, which no tokenizer takes."""


def _reply(raw: bytes) -> bytes:
    """One body's reply frame (without its length): the parse itself, here or in the child."""
    try:
        value = json.loads(raw) if raw else None
        # JSON may escape lone surrogates (\ud800), which no tokenizer takes.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return b"o" + marshal.dumps(value)
    except RecursionError:
        return b"d"
    except UnicodeEncodeError:
        return b"u"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, marshal's depth bound
        if "deeply nested" in str(exc):
            return b"d"
        return b"j" + str(exc).encode("utf-8", "replace")


def _value(reply: bytes) -> Any:
    kind, payload = reply[:1], reply[1:]
    if kind == b"o":
        return marshal.loads(payload)
    if kind == b"d":
        raise BodyTooDeep("nested too deeply")
    if kind == b"u":
        raise BodySurrogate("a lone surrogate")
    raise ValueError(payload.decode("utf-8", "replace"))


def decode_in_place(raw: bytes) -> Any:
    """The body's value, parsed in this process (small bodies, and the fallback)."""
    return _value(_reply(raw))


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            raise EOFError("the body decoder's child closed its output")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class BodyDecoder:
    """The child process and the lock that serialises it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        # -I: no user site, no PYTHON* variables, no current folder on the path.
        return subprocess.Popen([sys.executable, "-I", CHILD_SCRIPT],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def _exchange(self, raw: bytes) -> bytes:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(len(raw).to_bytes(HEADER, "big"))
        stdin.write(raw)
        size = int.from_bytes(_read_exact(stdout, HEADER), "big")
        return _read_exact(stdout, size)

    def decode(self, raw: bytes) -> Any:
        """The body's value; BodyTooDeep, BodySurrogate or ValueError when it is not one."""
        with self._lock:
            for attempt in range(2):
                try:
                    reply = self._exchange(raw)
                    break
                except (OSError, EOFError) as exc:
                    self.close()
                    if attempt:
                        logger.warning("the body decoder's child failed twice (%s): decoding "
                                       "this body in the server process", exc)
                        return decode_in_place(raw)
        return _value(reply)

    def close(self) -> None:
        """End the child (it also ends by itself when this process's pipe closes)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        """The child's pid while one runs (tests kill it)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None


def child_main() -> None:
    """The child's loop: a body in, its reply out, until the server closes the pipe."""
    # The lowest priority: beside the engine's threads the parse takes the cores they leave,
    # so a client's large body waits on the server, never the server on it.
    os.nice(19)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            size = int.from_bytes(_read_exact(stdin, HEADER), "big")
            reply = _reply(_read_exact(stdin, size))
        except EOFError:
            return
        stdout.write(len(reply).to_bytes(HEADER, "big") + reply)
        stdout.flush()


CHILD_SCRIPT = os.path.abspath(__file__)
DECODER = BodyDecoder()
# The one thread that waits on the child: large bodies queue here, never in asyncio's default
# pool, which tokenizes and renders templates for every request.
EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-decode")

if __name__ == "__main__":
    child_main()
