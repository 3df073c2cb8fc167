"""The step's traffic between host and device without extra syncs (issue 32, item 4).

- `upload(values, dtype, device)`: a Python list as a device tensor. On CUDA through pinned
  memory with `non_blocking=True`, so the host queues the copy and goes on (a pageable
  `torch.tensor(list, device=)` makes the host wait for the copy).
- `ReadBack.tokens(t)`: the step's sampled ids as a list: on CUDA one non-blocking copy into a
  pinned buffer and one wait on the stream, the step's one host sync; elsewhere `tolist()`.

Everything else the step computes stays on the device; `bench/host_syncs.py` counts what the
step reads (tests/test_host_syncs.py holds it at one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype,
           device: torch.device | str) -> torch.Tensor:
    host = torch.as_tensor(values, dtype=dtype)  # a host tensor stays as it is
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class ReadBack:
    """A pinned int64 buffer that grows to the largest step's row count."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def tokens(self, ids: torch.Tensor) -> list[int]:
        if ids.device.type != "cuda":
            return ids.tolist()
        n = ids.numel()
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host = self._host[:n]
        host.copy_(ids.view(-1), non_blocking=True)
        torch.cuda.current_stream(ids.device).synchronize()  # the step's one sync
        return host.tolist()  # host memory: no further sync
