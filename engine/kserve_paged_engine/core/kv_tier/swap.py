"""Preemption by swap: a victim's KV written to the second tier when it is preempted and read
back when it resumes, if copying costs less than the prefill it saves.

Without a swap a victim's full blocks stay cached when freed (and reach the tier only if the
pool evicts them); its partial last block is lost and recomputed. A swap writes, before the
next forward, every full block the tier does not hold yet (under its prefix key, so the
ordinary lookup brings it back) and the partial last block under a key of its own, made from
the request id, its computed tokens and a per-process salt: no prompt can hit it, and it is
never announced in KV events. On resume the lookup's run of full blocks is followed by that
block, so the request's computed tokens are exactly what it had: the scheduler still sees one
number per request (a swap-in is computed tokens restored).

The choice is a cost model from measured rates: writing the blocks out (the tier writer's disk
rate) plus reading them all back (the tier's read-and-check rate) against computing the tokens
again (the engine's recent prefill steps, tokens per second). Each rate has a default until it
is measured. A swap that the tier cannot hold, or one while the tier's writes fail, is a
recompute; a swap whose blocks the tier lost by the time of resume falls back to computing
what is missing, so the answer never depends on the tier.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kserve_paged_engine.core.block_pool import KVBlock
from kserve_paged_engine.core.kv_tier.disk import DiskTier
from kserve_paged_engine.core.kv_tier.host import HostTier
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from kserve_paged_engine.core.prefix_hits import PrefixHit
from kserve_paged_engine.core.request import Request

logger = logging.getLogger("kserve_paged_engine")

DEFAULT_PREFILL_TPS = 1000.0  # prefill tokens per second until a prefill step is measured
MIN_PREFILL_TOKENS = 32  # a step measures the prefill rate only with this many prompt tokens
ERROR_HOLD_S = 60.0  # no swap for this long after a tier write failed


@dataclass(frozen=True, slots=True)
class SwapChoice:
    """What one preemption does and the numbers it was decided by (all logged)."""

    swap: bool
    why: str
    tokens: int  # computed tokens a recompute would compute again
    blocks_out: int
    blocks_in: int
    swap_s: float
    recompute_s: float


@dataclass(frozen=True, slots=True)
class Swapped:
    num_tokens: int  # computed tokens at preemption: what the resume restores
    key: bytes | None  # the partial last block's key (None: the last block was full)


@dataclass(slots=True)
class SwapStats:
    outs: int = 0  # preemptions by swap
    ins: int = 0  # swapped requests resumed with every token they had
    recomputes: int = 0  # preemptions (with a tier) that recomputed
    short: int = 0  # swapped requests resumed short (the tier lost a block): computed again
    dropped: int = 0  # swapped requests that ended while waiting (aborted, failed): never resumed


class Swapper:
    """The swap records of preempted requests and the cost model that makes them."""

    def __init__(self, tier: DiskTier | HostTier, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        self.prefill = MeasuredRate(DEFAULT_PREFILL_TPS)
        self.swapped: dict[str, Swapped] = {}
        self.stats = SwapStats()
        self.done: list[bytes] = []  # partial-block keys no one will read again
        self._salt = os.urandom(16)

    def choose(self, tokens: int, blocks_out: int, blocks_in: int) -> SwapChoice:
        """Swap if writing `blocks_out` and reading `blocks_in` back beats computing
        `tokens` again, at the rates measured so far."""
        tier = self.tier
        swap_s = (tier.write_rate.seconds_for(blocks_out * tier.block_bytes)
                  + tier.read_rate.seconds_for(blocks_in * tier.block_bytes))
        recompute_s = self.prefill.seconds_for(tokens)
        failed = tier.last_error
        if blocks_out > tier.capacity_blocks:
            swap, why = False, "recompute: the tier cannot hold the blocks"
        elif failed is not None and time.monotonic() - failed < ERROR_HOLD_S:
            swap, why = False, "recompute: a tier write failed recently"
        elif swap_s < recompute_s:
            swap, why = True, "swap: the copy is cheaper"
        else:
            swap, why = False, "recompute: the prefill is cheaper"
        return SwapChoice(swap, why, tokens, blocks_out, blocks_in, swap_s, recompute_s)

    def swap_out(self, request: Request, blocks: Sequence[KVBlock]) -> list[tuple[int, bytes]]:
        """The copies (block id, key) that swap this freed victim out, or none: recompute.
        Its blocks' bytes stay in place until the next forward, which copies them first."""
        n, bs = request.num_computed_tokens, self.block_size
        full = n // bs
        saves = [(blocks[i].block_id, h) for i, h in enumerate(request.block_hashes[:full])
                 if h not in self.tier]
        key = None
        if n % bs:
            key = hashlib.sha256(b"kv-swap" + self._salt + request.request_id.encode()
                                 + n.to_bytes(8, "little")).digest()
            saves.append((blocks[full].block_id, key))
        choice = self.choose(n, len(saves), -(-n // bs))
        self._log(request, choice)
        if not choice.swap:
            self.stats.recomputes += 1
            return []
        if key is not None:
            self.tier.private.add(key)
        self.swapped[request.request_id] = Swapped(n, key)
        self.stats.outs += 1
        return saves

    def _log(self, request: Request, c: SwapChoice) -> None:
        w, r = self.tier.write_rate, self.tier.read_rate
        logger.info(
            "preempted %s with %d tokens computed: %s (swap %.2f ms: %d blocks out at %.0f MB/s"
            "%s, %d in at %.0f MB/s%s; recompute %.2f ms at %.0f tokens/s%s)",
            request.request_id, c.tokens, c.why, c.swap_s * 1e3, c.blocks_out, w.value / 1e6,
            "" if w.measured else " (default)", c.blocks_in, r.value / 1e6,
            "" if r.measured else " (default)", c.recompute_s * 1e3, self.prefill.value,
            "" if self.prefill.measured else " (default)")

    def extend(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """A swapped request's hit, once it reaches the end of its full blocks, followed by
        its partial last block from the tier (its computed tokens exactly as they were)."""
        rec = self.swapped.get(request.request_id)
        if rec is None or rec.key is None or rec.num_tokens >= request.num_tokens:
            return hit
        if hit.num_tokens != rec.num_tokens // self.block_size * self.block_size:
            return hit
        if not self.tier.fetch(rec.key):
            return hit
        return PrefixHit(hit.groups or [[]], rec.num_tokens, hit.restore + (rec.key,))

    def admitted(self, request: Request, hit: PrefixHit) -> int:
        """A request admitted with `hit`: if it was swapped, count the swap-in (whole or
        short) and let its record go. Returns the tokens of its partial block restored (a
        swap's, not a prefix hit)."""
        rec = self.swapped.pop(request.request_id, None)
        if rec is None:
            return 0
        restored = rec.key is not None and hit.restore[-1:] == (rec.key,)
        if hit.num_tokens >= rec.num_tokens:
            self.stats.ins += 1
        else:
            self.stats.short += 1
            logger.info("resumed %s with %d of its %d swapped tokens (the tier lost a block); "
                        "the rest is computed again", request.request_id, hit.num_tokens,
                        rec.num_tokens)
        if rec.key is not None:
            self.done.append(rec.key)
        return rec.num_tokens % self.block_size if restored else 0

    def forget(self, request_id: str) -> None:
        """A request that ends or is freed while swapped: its partial block is useless. Every
        swap-out ends as one of ins, short or dropped (or is still waiting)."""
        rec = self.swapped.pop(request_id, None)
        if rec is None:
            return
        self.stats.dropped += 1
        if rec.key is not None:
            self.done.append(rec.key)

    def observe_step(self, num_scheduled: dict[str, int], spec: dict[str, list[int]],
                     seconds: float) -> None:
        """A step's forward time: a prefill rate if it computed enough prompt tokens."""
        prompt = sum(n for rid, n in num_scheduled.items() if n > 1 and rid not in spec)
        if prompt >= MIN_PREFILL_TOKENS:
            self.prefill.observe(sum(num_scheduled.values()), seconds)

    def stat_dict(self) -> dict[str, int]:
        s = self.stats
        return {"kv_swap_outs": s.outs, "kv_swap_ins": s.ins, "kv_swap_recomputes": s.recomputes,
                "kv_swap_short": s.short, "kv_swap_dropped": s.dropped,
                "num_requests_swapped": len(self.swapped)}
