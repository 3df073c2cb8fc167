"""Compiling a grammar in a worker process, with a deadline.

xgrammar's compile cannot be interrupted inside a thread, and some valid constraints take long
(a counted repetition such as ``[a-z]{1,1000}`` compiles in seconds, and the time grows with the
count). So with a deadline set, compiles run in a child process (``python -m
kserve_paged_engine.sample.grammar_worker``, which imports xgrammar and nothing of the server): the parent
sends the constraint as the request gave it (``StructuredOutputs.to_dict``; a parsed grammar
sent as xgrammar's JSON loses its optimizations and compiles 100x slower), the child parses
it again and answers the compiled grammar (JSON again,
~64 KB for a small schema, deserialized in milliseconds). A compile past the deadline kills the
child and fails that one constraint; the next compile takes a spare child started beforehand,
and another spare starts in the background.

Wire: each message is a 4-byte little-endian length and that many bytes of UTF-8; the first
message to the child is the tokenizer's info, each later one a constraint; the child answers each
one with ``"ok" + json`` or ``"er" + message``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

STARTUP_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a loaded machine


class GrammarCompileTimeout(ValueError):
    """The constraint did not compile within the deadline (the client's to simplify)."""


def _send(pipe: IO[bytes], text: str) -> None:
    data = text.encode()
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def _wait(pipe: IO[bytes], timeout_s: float) -> bool:
    """Whether ``pipe`` has something to read within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([pipe], [], [], left)[0]:
            return True
    return False


def _recv(pipe: IO[bytes]) -> str | None:
    head = pipe.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    data = pipe.read(size)
    return data.decode() if len(data) == size else None


class CompileWorker:
    """A child process compiling for one tokenizer, and a spare one started beside it, so a
    child killed at the deadline is replaced at once (a start imports xgrammar and torch:
    seconds, tens of seconds on a loaded machine) while the next spare starts in the
    background. ``compile`` is called from one thread at a time; spares start on their own."""

    def __init__(self, tokenizer_info: Any, timeout_s: float) -> None:
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self._info_json: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._spare: concurrent.futures.Future | None = None  # of a started child
        # Two: at the first start, the spare starts beside the first child, not after it.
        self._launcher = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="grammar-start")
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen[bytes]] = set()  # every child not yet ended
        self._closed = False
        self.restarts = 0  # children killed at the deadline (or dead)

    @property
    def pid(self) -> int | None:
        """The compiling child's pid (None before the first start, or after a kill)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def spare(self) -> concurrent.futures.Future | None:
        """The spare child (a future of its process: done once it is ready)."""
        return self._spare

    def start(self) -> subprocess.Popen[bytes]:
        """The compiling child: the one alive, else the spare (waiting for it only if it is
        still starting), a new spare launched at once in either case of replacement."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc
            self.kill()  # it died idle
        for attempt in range(2):  # a spare that died idle: the next one
            taken = self._spare or self._launcher.submit(self._launch)
            self._spare = self._launcher.submit(self._launch)
            try:
                proc = taken.result()
            except ValueError:
                if attempt:
                    raise
                continue
            if proc.poll() is None:
                self._proc = proc
                return proc
            self._end(proc)
        raise ValueError("the grammar compiler process did not start")

    def _launch(self) -> subprocess.Popen[bytes]:
        """A child that has read the tokenizer and is ready to compile; ValueError if not."""
        if self._info_json is None:
            self._info_json = self.tokenizer_info.serialize_json()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "kserve_paged_engine.sample.grammar_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        with self._lock:
            self._children.add(proc)
            closed = self._closed
        try:
            _send(proc.stdin, self._info_json)
            ready = (not closed and _wait(proc.stdout, STARTUP_TIMEOUT_S)
                     and _recv(proc.stdout) == "ready")
        except OSError:
            ready = False
        if not ready or self._closed:  # the deadline is for compiling, not for starting
            self._end(proc)
            raise ValueError("the grammar compiler process did not start")
        return proc

    def compile(self, spec: Any) -> Any:
        """The compiled grammar, or ValueError: GrammarCompileTimeout past the deadline (the
        child is killed), or the compiler's own message."""
        import xgrammar as xgr

        proc = self.start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _send(proc.stdin, json.dumps({**spec.to_dict(),
                                          "disable_any_whitespace": spec.disable_any_whitespace}))
        except (BrokenPipeError, OSError):
            self.kill()
            raise ValueError("the grammar compiler process died") from None
        if not _wait(proc.stdout, self.timeout_s):
            self.kill()
            raise GrammarCompileTimeout(
                f"the structured-output constraint did not compile within "
                f"{self.timeout_s:g} s (--max_grammar_compile_s): simplify it")
        answer = _recv(proc.stdout)
        if answer is None:
            self.kill()
            raise ValueError("the grammar compiler process died")
        if answer.startswith("er"):
            raise ValueError(answer[2:])
        return xgr.CompiledGrammar.deserialize_json(answer[2:], self.tokenizer_info)

    def kill(self) -> None:
        """End the compiling child; the next compile takes the spare."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._end(proc)
            self.restarts += 1

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._children.discard(proc)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self) -> None:
        """End every child, the spare and one still starting included."""
        with self._lock:
            self._closed = True
            children = list(self._children)
        self._proc = self._spare = None
        self._launcher.shutdown(wait=False, cancel_futures=True)
        for proc in children:
            self._end(proc)


def main() -> None:
    import xgrammar as xgr

    from kserve_paged_engine.output_constraints import StructuredOutputs

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    info_json = _recv(stdin)
    if info_json is None:
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1)
    compiler.compile_builtin_json_grammar()  # one-time costs (the vocabulary's tables) now,
    _send(stdout, "ready")  # outside any request's deadline
    while (job := _recv(stdin)) is not None:
        try:
            compiled = compiler.compile_grammar(StructuredOutputs(**json.loads(job))._grammar)
            _send(stdout, "ok" + compiled.serialize_json())
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the request
            _send(stdout, "er" + (str(exc).strip() or type(exc).__name__))


if __name__ == "__main__":
    main()
