"""How layers share the KV block pool: groups of layers with one block table each.

Layers are grouped by attention type (global, or a sliding window of W tokens). Every group has
the same number of layers, `group_size`, so one physical block id names the same amount of
memory in every group: the block's bytes in `group_size` per-slot tensors, slot j holding layer
j of whichever group owns the block. One pool of such blocks serves all groups; a request has
one block table per group, and a sliding group's table holds only the blocks its window still
reaches (engine/kserve_paged_engine/core/kv_cache_manager.py frees the rest as the request runs). A model of one type
(Llama; Mistral, every layer sliding) is one group of all its layers: one tensor per layer and
one table per request, as before.

`group_size` is the smallest type's layer count; a type whose count it does not divide gets a
last group with unused slots (their memory is allocated and never written), which costs less
than the extra tables a smaller size (their gcd) would have every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVLayout:
    group_windows: list[int | None]  # per group: its sliding window, None for global layers
    group_size: int  # layers (slots) per group: a block holds this many layers' K/V
    layer_group: list[int]  # per layer: its group
    layer_slot: list[int]  # per layer: its slot (which per-slot tensor holds its K/V)
    # len(group_windows), a plain field: the runner reads it every step (no call into here).
    num_groups: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_groups = len(self.group_windows)

    def blocks_to_hold(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks one request of `num_tokens` tokens needs at most at once when its prompt is
        computed in chunks of up to `chunk` tokens: a global group holds all its tokens; a
        sliding group its window before a chunk plus the chunk."""
        total = 0
        for window in self.group_windows:
            reach = num_tokens if window is None else min(num_tokens, window - 1 + chunk)
            total += -(-reach // block_size) + (window is not None and reach < num_tokens)
        return total


def kv_layout(layer_windows: list[int | None], per_group: bool = True) -> KVLayout:
    """The layout for these per-layer windows. `per_group` False: one group of every layer (one
    shared table, nothing freed unless every layer slides), what
    `disable_hybrid_kv_cache_manager` gets."""
    n = len(layer_windows)
    types = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    if not per_group or len(types) == 1:
        window = layer_windows[0] if len(types) == 1 else None
        return KVLayout([window], n, [0] * n, list(range(n)))
    members = {t: [i for i, w in enumerate(layer_windows) if w == t] for t in types}
    size = min(len(m) for m in members.values())
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for t in types:  # global layers first: group 0 is the one prefix-cache events announce
        layers = members[t]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(t)
    return KVLayout(group_windows, size, layer_group, layer_slot)
