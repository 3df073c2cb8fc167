"""What a request may take instead of computing: cached blocks of its leading tokens (a
prefix-cache hit) or the blocks a sibling fork holds for their common tokens, in every KV group.

A request's full blocks are keyed by a chain of hashes (engine/kserve_paged_engine/core/block_hash.py): the
previous block's key, this block's tokens, and (in vLLM's order) the adapter on every block and
the cache salt on the first, so a prefix never hits across adapters or salts. A global group
needs a hit's blocks from block 0; a sliding group only those its window reaches before the
hit's end (engine/kserve_paged_engine/core/kv_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kserve_paged_engine.core.block_hash import BlockHasher
from kserve_paged_engine.core.block_pool import KVBlock
from kserve_paged_engine.core.request import Request


@dataclass(slots=True)
class PrefixHit:
    # Per KV group, the hit's table entries (None: before a sliding group's window, not taken);
    # empty: no hit in any group.
    groups: list[list[KVBlock | None]]
    num_tokens: int  # the pool's blocks and the tier's, in tokens
    # Keys of the second tier's blocks after the pool's (engine/kserve_paged_engine/core/kv_tier/link.py): they
    # get fresh blocks and their bytes are copied in before the forward.
    restore: tuple[bytes, ...] = ()

    @property
    def blocks(self) -> list[KVBlock | None]:
        """The first group's hit blocks (a one-group model's whole hit)."""
        return self.groups[0] if self.groups else []


NO_HIT = PrefixHit([], 0)


def extra_keys(request: Request, block_index: int) -> tuple[Any, ...] | None:
    """What besides tokens keys a block, in vLLM's order: the adapter on every block, the
    cache salt on the first (so on the whole chain); a prefix never hits across either.

    vLLM keys an adapter by its name; here it is its content digest (`LoRARequest.cache_key`),
    so blocks computed with other weights (a reload of changed files, another adapter given
    the same id after a restart, whose blocks a kept KV tier still holds) are never hit."""
    keys: list[Any] = []
    if request.lora_request is not None:
        keys.append(request.lora_request.cache_key)
    if block_index == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def extend_block_hashes(hasher: BlockHasher, request: Request, block_size: int) -> None:
    """Grow the request's chain of full-block hashes to cover its known tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    while len(hashes) < num_full:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hasher(parent, request.tokens_slice(i * block_size, (i + 1) * block_size),
                             extra_keys(request, i)))


def first_in_window(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block the token at position `num_tokens` reads (0 without a window)."""
    return max(0, num_tokens - window + 1) // block_size if window else 0


def cached_hit(hashes: Sequence[bytes], windows: Sequence[int | None], block_size: int,
               lookup: Callable[[int, bytes], KVBlock | None]) -> PrefixHit:
    """The longest run of cached blocks for these full-block hashes (`lookup(group, hash)`):
    in every global group from block 0, in every sliding group for the window before the
    hit's end (a hit is cut back until each group has what it needs)."""
    end = len(hashes)
    found: list[list[KVBlock | None]] = [[] for _ in windows]
    for g, window in enumerate(windows):
        if window is None:  # a run from block 0
            run = found[g]
            for h in hashes[:end]:
                block = lookup(g, h)
                if block is None:
                    break
                run.append(block)
            end = len(run)
    sliding = [g for g, w in enumerate(windows) if w is not None]
    if sliding:
        for g in sliding:
            found[g] = [lookup(g, h) for h in hashes[:end]]
        moved = True
        while moved and end > 0:  # cut the hit back past any missing window block
            moved = False
            for g in sliding:
                first = first_in_window(end * block_size, windows[g], block_size)
                missing = [i for i in range(first, end) if found[g][i] is None]
                if missing:
                    end, moved = missing[-1], True
    if end == 0:
        return NO_HIT
    groups: list[list[KVBlock | None]] = []
    for g, window in enumerate(windows):
        first = first_in_window(end * block_size, window, block_size)
        groups.append([None] * first + found[g][first:end])
    return PrefixHit(groups, end * block_size)


def sibling_blocks(held: int, last: int, windows: Sequence[int | None], block_size: int,
                   theirs: Sequence[Sequence[KVBlock | None]]) -> PrefixHit:
    """A sibling's full blocks `held`..`last` (its table `theirs[g]` in each group), taken
    after the `held` blocks a request has; in a sliding group only those the window before
    the hit's end reaches. No hit if any needed block left the sibling's window."""
    groups: list[list[KVBlock | None]] = []
    for g, window in enumerate(windows):
        first = max(held, first_in_window(last * block_size, window, block_size))
        part = list(theirs[g][first:last])
        if len(part) < last - first or any(b is None for b in part):
            return NO_HIT  # blocks that left the window
        groups.append([None] * (first - held) + part)
    return PrefixHit(groups, (last - held) * block_size)
