"""Which block the second KV tier lets go when it is full: LRU, or ARC (`eviction_policy`, as
KServe's spec.kvCacheOffloading names them).

ARC (Megiddo and Modha, FAST 2003) keeps two lists, blocks seen once recently (T1) and blocks
hit again since (T2), plus the keys it recently let go from each (ghosts B1, B2, no bytes). A
miss on a ghost says which list was cut too short, and moves the target size `p` of T1 that
way. For a tier under a prefix cache this matters: a burst of one-off prompts evicted from the
pool fills T1 and leaves the system prompts and histories that keep coming back (T2) alone,
where LRU would let the burst push them out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LRU:
    """The least recently stored or hit key leaves first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys)

    def touch(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def insert(self, key: bytes) -> list[bytes]:
        """Keep a new key; the keys let go to make room."""
        out = []
        while len(self._keys) >= self.capacity:
            out.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return out

    def remove(self, key: bytes) -> None:
        self._keys.pop(key, None)


class ARC:
    """Adaptive replacement: T1 (seen once), T2 (hit again), ghosts B1 and B2."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[bytes]:
        yield from self.t1
        yield from self.t2

    def touch(self, key: bytes) -> None:
        """A hit: the key moves to the most recent end of T2."""
        self.t1.pop(key, None)
        self.t2.pop(key, None)
        self.t2[key] = None

    def insert(self, key: bytes) -> list[bytes]:
        """A new key (a miss); the keys let go to make room."""
        c, out = self.capacity, []
        if key in self.b1 or key in self.b2:
            ghost_b1 = key in self.b1
            if ghost_b1:
                self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            else:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            (self.b1 if ghost_b1 else self.b2).pop(key)
            self._make_room(not ghost_b1, out)
            self.t2[key] = None
            return out
        if len(self.t1) + len(self.b1) >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._make_room(False, out)
            else:
                out.append(self.t1.popitem(last=False)[0])
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)
            self._make_room(False, out)
        self.t1[key] = None
        return out

    def _make_room(self, from_b2: bool, out: list[bytes]) -> None:
        """ARC's REPLACE, when the tier is full: T1's or T2's least recent key becomes a
        ghost (`from_b2`: the new key was a ghost of T2)."""
        if len(self) < self.capacity:
            return
        if self.t1 and (len(self.t1) > self.p or (from_b2 and len(self.t1) == self.p)
                        or not self.t2):
            old = self.t1.popitem(last=False)[0]
            self.b1[old] = None
        else:
            old = self.t2.popitem(last=False)[0]
            self.b2[old] = None
        out.append(old)

    def remove(self, key: bytes) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)


def make_policy(name: str, capacity: int) -> LRU | ARC:
    if name == "arc":
        return ARC(capacity)
    if name == "lru":
        return LRU(capacity)
    raise ValueError(f"KV tier eviction policy must be lru or arc (got {name!r})")
