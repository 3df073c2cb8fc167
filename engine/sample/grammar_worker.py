"""Compiling a grammar in a worker process, with a deadline.

xgrammar's compile cannot be interrupted inside a thread, and some valid constraints take long
(a counted repetition such as ``[a-z]{1,1000}`` compiles in seconds, and the time grows with the
count). So with a deadline set, compiles run in a child process (``python -m
engine.sample.grammar_worker``, which imports xgrammar and nothing of the server): the parent
sends the constraint as the request gave it (``StructuredOutputs.to_dict``; a parsed grammar
sent as xgrammar's JSON loses its optimizations and compiles 100x slower), the child parses
it again and answers the compiled grammar (JSON again,
~64 KB for a small schema, deserialized in milliseconds). A compile past the deadline kills the
child, fails that one constraint, and the next compile starts a fresh child.

Wire: each message is a 4-byte little-endian length and that many bytes of UTF-8; the first
message to the child is the tokenizer's info, each later one a constraint; the child answers each
one with ``"ok" + json`` or ``"er" + message``.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
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
    """One child process compiling for one tokenizer; used from one thread at a time."""

    def __init__(self, tokenizer_info: Any, timeout_s: float) -> None:
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self._info_json: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0  # children killed at the deadline (or dead)

    def start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._info_json is None:
            self._info_json = self.tokenizer_info.serialize_json()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "engine.sample.grammar_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        try:
            _send(proc.stdin, self._info_json)
            ready = _wait(proc.stdout, STARTUP_TIMEOUT_S) and _recv(proc.stdout) == "ready"
        except OSError:
            ready = False
        if not ready:  # the deadline is for compiling, not for starting the child
            self.kill()
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
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            self.restarts += 1

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    import xgrammar as xgr

    from engine.sampling_params import StructuredOutputs

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
