"""Constrained decoding: a request's output held to a JSON schema, regex, choice or grammar.

xgrammar does the work (vLLM's default backend; CPU and GPU). Three stages, each where it costs
least (design: docs/engine.md, "Structured outputs"):
- ``StructuredOutputs`` (engine/sampling_params.py, with the other request options) parses the
  constraint into a tokenizer-free grammar when the request is made, so a bad schema, regex or
  grammar is a ValueError before anything is queued;
- ``GrammarCompiler`` compiles it against the tokenizer on a worker thread, cached by the
  constraint's text; the request waits in the queue (the scheduler skips it) until that is done;
- ``RequestGrammar`` holds the request's matcher: each step fills the allowed-token bitmask of
  its row and, after sampling, accepts the sampled token.
Preemption needs nothing: outputs survive recompute, so the matcher is still where it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:  # torch and xgrammar load on first use
    import torch

# Compiled grammars kept for reuse (an agent sends the same few schemas again and again).
COMPILED_CACHE_ENTRIES = 256


class GrammarCompiler:
    """Compiles constraints against one tokenizer on a worker thread, cached by their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = (
            collections.OrderedDict())
        self.compile_seconds: list[float] = []  # per compiled constraint (benchmarks read it)

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > COMPILED_CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputs) -> Any:
        import time

        import xgrammar as xgr

        if self._compiler is None:  # the tokenizer's table: built once, on first use
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(spec._grammar)
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's constraint: its compile future, then its matcher; with `start_after`
    (a reasoning model's end-of-thinking token), inactive until that token is sampled."""

    __slots__ = ("future", "matcher", "start_after")

    def __init__(self, future: concurrent.futures.Future, start_after: int | None = None
                 ) -> None:
        self.future = future
        self.matcher: Any = None
        self.start_after = start_after

    @property
    def active(self) -> bool:
        """The mask applies (no start token to wait for, or it was sampled)."""
        return self.start_after is None

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False when the active grammar refuses it. While
        inactive every token is fine, and the start token activates the grammar."""
        if self.start_after is not None:
            if token == self.start_after:
                self.start_after = None
            return True
        return bool(self.matcher.accept_token(token))

    @property
    def compiling(self) -> bool:
        """True until the engine has made the matcher (the scheduler waits for that, not
        just for the compile, so a step never meets a constrained row without one)."""
        return self.matcher is None

    def start(self) -> None:
        """Make the matcher once the grammar is compiled; re-raises a failed compile."""
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result())


class GrammarBitmask:
    """The step's allowed-token masks, filled row by row and applied to all rows at once."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffer: torch.Tensor | None = None  # int32 [rows, ceil(vocab / 32)]

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
        """``logits`` with every disallowed token of a constrained row at -inf (a copy when
        any row is constrained, so the raw logits stay for logprobs)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        import xgrammar as xgr

        if self._buffer is None or self._buffer.shape[0] < len(grammars):
            self._buffer = xgr.allocate_token_bitmask(max(len(grammars), 8), self.vocab_size)
        for i in rows:
            grammars[i].matcher.fill_next_token_bitmask(self._buffer, i)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, self._buffer[:len(grammars)].to(logits.device),
                                        vocab_size=self.vocab_size, indices=rows)
        return masked
