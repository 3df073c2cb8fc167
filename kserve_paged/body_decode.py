"""Request bodies decoded into JSON values; a large one in a child process.

Why a process: CPython's JSON parser holds the GIL for the whole parse, so a 32 MiB body
decoded on a server thread stops the engine thread (and every other request) for seconds. In
the child, at the lowest priority, it costs the cores the engine leaves idle; marshal hands
the value back at a small fraction of the parse's cost.

One child serves the process, started at the first large body and again if it dies; bodies
queue for it one at a time in one thread of their own (EXECUTOR), so a client sending many
large bodies waits behind its own, while small bodies (decoded in place), asyncio's default
pool and the engine thread go on.

What may go wrong, and what each costs: a body the child has not answered within its bound
is refused (BodyTooCostly) and the child killed and replaced. The bound is the child's CPU time
(limits.body_decode_seconds), not the clock: at nice 19 on a server whose engine keeps every
core busy, a legitimate parse may wait a long time for CPU, and it must not be refused for
that. A child that hangs without using CPU meets a backstop on the clock instead
(limits.BODY_DECODE_WALL_FACTOR times the bound), so the bodies queued behind it wait no longer
than that. A body that ends the child is tried once
more in a fresh one, then refused (BodyCrashedDecoder): it is never parsed in the server
process, the hostile case the child exists for. Only a child that cannot start (twice running,
an environment problem: no body has been sent to it) has the body decoded in place, as before
the child existed, and the log says so.

This file is also the child's script (`python -I body_decode.py`): run so, it imports nothing
but the standard library (-I drops PYTHONPATH, so the server's packages may not be importable
there) and builds no decoder of its own, so the child is a few MiB and starts fast. Frames on the child's stdin and
stdout: an 8-byte big-endian length, then that many bytes. The child's first frame, b"r",
says it is ready. A reply's first byte says what follows: b"o" marshal bytes, b"d" nested too
deeply, b"u" a lone surrogate, b"j" not JSON (the parser's message follows).
"""

from __future__ import annotations

import json
import logging
import marshal
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

HEADER = 8
READY = b"r"


class BodyTooDeep(ValueError):
    """The body nests deeper than the parser (or marshal) goes."""


class BodySurrogate(ValueError):
    """The body escapes a lone surrogate, which no tokenizer takes."""


class BodyTooCostly(ValueError):
    """The child did not answer within the body's bound; it was killed and is replaced."""

    def __init__(self, seconds: float, size: int) -> None:
        super().__init__(f"the request body ({size} bytes) was not parsed within {seconds:g} s "
                         "of parsing, this server's bound for a body of its size: send a "
                         "smaller body")
        self.seconds = seconds


class BodyCrashedDecoder(ValueError):
    """The body ended the decoder's child (twice running, unless no fresh child would start
    for the second try)."""

    def __init__(self, detail: str) -> None:
        super().__init__("the request body could not be parsed: it ended the server's JSON "
                         f"parser process ({detail})")


class _ChildWontStart(Exception):
    """The child did not start or did not say it was ready: the environment, not a body."""


class _ChildDied(Exception):
    """The child ended while it held a body."""


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


def _read_frame(stream: BinaryIO) -> bytes:
    return _read_exact(stream, int.from_bytes(_read_exact(stream, HEADER), "big"))


def _write_frame(stream: BinaryIO, payload: bytes) -> None:
    """Header and payload, all of them (an unbuffered pipe may take part of a write)."""
    for data in (len(payload).to_bytes(HEADER, "big"), memoryview(payload)):
        while data:
            data = data[stream.write(data) or 0:]
    stream.flush()


def _cpu_seconds(pid: int) -> float | None:
    """The process's CPU time so far (user + system), or None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Watchdog:
    """Kills the child once it has used ``seconds`` of CPU, or ``wall`` seconds have passed
    (a child that hangs idle), unless the block it guards ends first; ``fired`` says whether
    it did. A kill ends the child's pipes, so a read or write blocked on them returns with an
    error. Where /proc gives no CPU time, the clock stands for it."""

    def __init__(self, proc: subprocess.Popen[bytes], seconds: float, wall: float) -> None:
        self.fired = False
        self._proc = proc
        self._seconds = max(seconds, 0.0)
        self._wall = max(wall, self._seconds)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="body-decode-watchdog")

    def _watch(self) -> None:
        start = time.monotonic()
        base = _cpu_seconds(self._proc.pid) or 0.0
        poll = min(0.05, self._seconds / 4) if self._seconds else 0.0
        while not self._done.wait(poll):
            elapsed = time.monotonic() - start
            cpu = _cpu_seconds(self._proc.pid)
            used = elapsed if cpu is None else cpu - base
            if used >= self._seconds or elapsed >= self._wall:
                self.fired = True
                self._proc.kill()
                return

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()  # no kill can land after this


def _end(proc: subprocess.Popen[bytes]) -> int:
    """Kill the child, reap it and close its pipes; its exit code."""
    proc.kill()
    code = proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
    return code


class BodyDecoder:
    """The child process and the lock that serialises it. ``seconds_for(size)`` bounds the
    child's work on a body of ``size`` bytes (and, with size 0, its start)."""

    def __init__(self, seconds_for: Callable[[int], float] | None = None,
                 wall_factor: float | None = None) -> None:
        if seconds_for is None or wall_factor is None:
            # Here, not at the top: this file is also the child's script, which imports
            # nothing but the standard library (and builds no BodyDecoder).
            from kserve_paged_engine.limits import BODY_DECODE_WALL_FACTOR, body_decode_seconds
            seconds_for = seconds_for or body_decode_seconds
            wall_factor = wall_factor or BODY_DECODE_WALL_FACTOR
        self.seconds_for = seconds_for
        self.wall_factor = wall_factor
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _watchdog(self, proc: subprocess.Popen[bytes], seconds: float) -> _Watchdog:
        return _Watchdog(proc, seconds, seconds * self.wall_factor)

    def _start(self) -> subprocess.Popen[bytes]:
        """A fresh child that has said it is ready; _ChildWontStart when it cannot."""
        try:
            # -I: no user site, no PYTHON* variables, no current folder on the path.
            proc = subprocess.Popen([sys.executable, "-I", CHILD_SCRIPT],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            raise _ChildWontStart(str(exc)) from exc
        assert proc.stdout is not None
        try:
            with self._watchdog(proc, self.seconds_for(0)) as watchdog:
                ready = _read_frame(proc.stdout)
        except (OSError, EOFError):
            ready = b""
        if ready != READY:
            code = _end(proc)
            raise _ChildWontStart("no answer within its bound" if watchdog.fired
                                  else f"it exited with code {code}")
        return proc

    def _child(self) -> subprocess.Popen[bytes]:
        """The running child, or a fresh one (a second try when the first will not start)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()  # a child that died idle: reaped, its pipes closed
        try:
            self._proc = self._start()
        except _ChildWontStart:
            self._proc = self._start()
        return self._proc

    def _exchange(self, proc: subprocess.Popen[bytes], raw: bytes, seconds: float) -> bytes:
        """The child's reply to ``raw``; BodyTooCostly past ``seconds`` of its CPU (or the
        backstop on the clock), _ChildDied when the child ended without one. Either way the
        child is gone afterwards."""
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None
        failure: Exception | None = None
        with self._watchdog(proc, seconds) as watchdog:
            try:
                _write_frame(stdin, raw)
                reply = _read_frame(stdout)
            except (OSError, EOFError) as exc:
                failure = exc
        if watchdog.fired or failure is not None:
            self.close()
        if watchdog.fired and failure is not None:
            logger.warning("the body decoder's child took longer than %g s over a %d-byte "
                           "body: killed, the request refused", seconds, len(raw))
            raise BodyTooCostly(seconds, len(raw))
        if failure is not None:
            raise _ChildDied(f"exit code {proc.returncode}") from failure
        return reply

    def decode(self, raw: bytes) -> Any:
        """The body's value; BodyTooDeep, BodySurrogate, BodyTooCostly, BodyCrashedDecoder or
        ValueError when it is not one."""
        with self._lock:
            seconds = self.seconds_for(len(raw))
            died: _ChildDied | None = None
            for _ in range(2):  # the first child may have died idle (killed by the OS)
                try:
                    proc = self._child()
                except _ChildWontStart as exc:
                    if died is not None:  # this body ended a child: never parsed here
                        break
                    logger.warning("the body decoder's child could not start twice running "
                                   "(%s): decoding this body in the server process", exc)
                    return decode_in_place(raw)
                try:
                    return _value(self._exchange(proc, raw, seconds))
                except _ChildDied as exc:
                    died = exc
            logger.warning("a %d-byte request body ended the body decoder's child (%s): "
                           "refused", len(raw), died)
            raise BodyCrashedDecoder(str(died))

    def close(self) -> None:
        """End the child (it also ends by itself when this process's pipe closes)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)

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
    _write_frame(stdout, READY)
    while True:
        try:
            reply = _reply(_read_frame(stdin))
        except EOFError:
            return
        _write_frame(stdout, reply)


CHILD_SCRIPT = os.path.abspath(__file__)

if __name__ == "__main__":
    child_main()
else:
    DECODER = BodyDecoder()
    # The one thread that waits on the child: large bodies queue here, never in asyncio's
    # default pool, which tokenizes and renders templates for every request.
    EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-decode")
