"""Constrained decoding: a request's output held to a JSON schema, regex, choice or grammar.

xgrammar does the work (vLLM's default backend; CPU and GPU). Three stages, each where it costs
least (design: docs/engine.md, "Structured outputs"):
- ``StructuredOutputs`` (engine/kserve_paged_engine/output_constraints.py, a request option) parses the
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
import contextlib
import threading
from typing import TYPE_CHECKING, Any

from kserve_paged_engine import limits
from kserve_paged_engine.output_constraints import StructuredOutputs
from kserve_paged_engine.sample.grammar_worker import CompileWorker, GrammarCompileTimeout

if TYPE_CHECKING:  # torch and xgrammar load on first use
    import torch


class GrammarCompiler:
    """Compiles constraints against one tokenizer on a worker thread, cached by their text.

    With ``timeout_s``, each compile runs in a child process killed at the deadline
    (grammar_worker.py); a constraint that timed out stays failed in the cache, so sending it
    again is refused at once. The cache keeps compiled grammars up to ``cache_bytes`` of
    memory (xgrammar's own count), least recently used out first."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float | None = None,
                 cache_bytes: int = limits.GRAMMAR_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._compiler: Any = None
        self._worker: CompileWorker | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = (
            collections.OrderedDict())
        self._sizes: dict[str, int] = {}  # key -> bytes, of compiled grammars in the cache
        self.compile_seconds: list[float] = []  # per compiled constraint (benchmarks read it)
        if timeout_s is not None:  # start the worker now, not on the first request's time
            self._pool.submit(self._start)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None and not (future.done() and future.exception() is not None
                                           and not isinstance(future.exception(),
                                                              GrammarCompileTimeout)):
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            self._sizes.pop(spec.key, None)
        # Outside the lock: a compile that already finished runs the callback right here, and
        # _sized takes the (non-reentrant) lock, which would hang the engine thread for good.
        future.add_done_callback(lambda f, key=spec.key: self._sized(key, f))
        return future

    def _sized(self, key: str, future: concurrent.futures.Future) -> None:
        """Count a finished compile's bytes, then evict the least recently used to fit."""
        with self._lock:
            if self._cache.get(key) is not future:
                return
            if future.exception() is None:
                self._sizes[key] = int(future.result().memory_size_bytes)
            while sum(self._sizes.values()) > self.cache_bytes and len(self._sizes) > 1:
                oldest = next(k for k in self._cache if k in self._sizes and k != key)
                del self._cache[oldest], self._sizes[oldest]
            while len(self._cache) > limits.GRAMMAR_CACHE_ENTRIES:  # failures, in flight
                oldest = next(iter(self._cache))
                self._cache.pop(oldest)
                self._sizes.pop(oldest, None)

    def _start(self) -> None:
        """The tokenizer's table, once; with a deadline, the worker process too."""
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            if self.timeout_s is not None:
                self._worker = CompileWorker(info, self.timeout_s)
        if self._worker is not None:
            # On failure the first compile tries again, and fails its request with the reason.
            with contextlib.suppress(ValueError):
                self._worker.start()

    def _compile(self, spec: StructuredOutputs) -> Any:
        import time

        self._start()
        start = time.perf_counter()
        if self._worker is not None:
            compiled = self._worker.compile(spec)
        else:
            compiled = self._compiler.compile_grammar(spec._grammar)
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()


class RequestGrammar:
    """One request's constraint: its compile future, then its matcher; with `start_after`
    (a reasoning model's end-of-thinking token, or a token sequence such as Harmony's
    `<|channel|>final<|message|>`), inactive until the output has sampled those tokens."""

    __slots__ = ("future", "matcher", "start_after", "_recent")

    def __init__(self, future: concurrent.futures.Future,
                 start_after: int | tuple[int, ...] | None = None) -> None:
        self.future = future
        self.matcher: Any = None
        self.start_after = (start_after,) if isinstance(start_after, int) else start_after
        self._recent: tuple[int, ...] = ()  # the last sampled tokens, while inactive

    @property
    def active(self) -> bool:
        """The mask applies (no start tokens to wait for, or they were sampled)."""
        return self.start_after is None

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False when the active grammar refuses it. While
        inactive every token is fine, and the start sequence's last token activates it."""
        if self.start_after is not None:
            self._recent = (*self._recent, token)[-len(self.start_after):]
            if self._recent == self.start_after:
                self.start_after, self._recent = None, ()
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

            compiled = self.future.result()
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
            matcher.fill_next_token_bitmask(mask, 0)
            if not bool(mask.any()):  # not even an end: no output could ever satisfy it
                raise ValueError("the grammar matches no text (a rule that never ends?)")
            self.matcher = matcher


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
