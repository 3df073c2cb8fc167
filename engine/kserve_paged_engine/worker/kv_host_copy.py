"""The host KV tier's copy engines (engine/kserve_paged_engine/core/kv_tier/host.py): rows of block bytes between
the device and the tier's host slots.

On CPU the copies are synchronous tensor copies. On CUDA they run on a side stream so the
device-to-host copies of a step's evicted blocks overlap the step's forward: the rows are
gathered on the compute stream first (a device copy, before the forward reuses any block), the
side stream waits for that gather with an event, then copies each row into its pinned slot. A
load is queued on the same stream (so it follows any earlier save into a slot) and the compute
stream waits for it with an event before the scatter into the pool. `sync` waits for every
queued copy: the host tier calls it before the CPU reads a slot (a spill to disk).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each stretch where rows and slots both go up by
    one: one copy per stretch instead of one per block (slots are handed out in order)."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            first, start, n = out[-1]
            out[-1] = (first, start, n + 1)
        else:
            out.append((i, slot, 1))
    return out


class SyncCopier:
    """CPU: a copy is done when the call returns."""

    def save(self, rows: torch.Tensor, host: torch.Tensor, slots: Sequence[int]) -> None:
        host.index_copy_(0, torch.tensor(list(slots), dtype=torch.long), rows.to(host.device))

    def load(self, host: torch.Tensor, slots: Sequence[int],
             device: torch.device) -> torch.Tensor:
        return host.index_select(0, torch.tensor(list(slots), dtype=torch.long)).to(device)

    def sync(self) -> None:
        pass


class StreamCopier:
    """CUDA: copies on a side stream, ordered against the compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.done: torch.cuda.Event | None = None

    def save(self, rows: torch.Tensor, host: torch.Tensor, slots: Sequence[int]) -> None:
        gathered = torch.cuda.current_stream(rows.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(gathered)
            for i, slot, n in runs(slots):
                host[slot:slot + n].copy_(rows[i:i + n], non_blocking=True)
            rows.record_stream(self.stream)  # freed by the caller, reused only after the copy
            self.done = self.stream.record_event()

    def load(self, host: torch.Tensor, slots: Sequence[int],
             device: torch.device) -> torch.Tensor:
        out = torch.empty((len(slots), host.shape[1]), dtype=torch.uint8, device=device)
        allocated = torch.cuda.current_stream(device).record_event()  # out's memory is free
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(allocated)
            for i, slot, n in runs(slots):
                out[i:i + n].copy_(host[slot:slot + n], non_blocking=True)
            loaded = self.stream.record_event()
        torch.cuda.current_stream(device).wait_event(loaded)
        return out

    def sync(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def make_copier(device: torch.device) -> SyncCopier | StreamCopier:
    return StreamCopier(device) if device.type == "cuda" else SyncCopier()
