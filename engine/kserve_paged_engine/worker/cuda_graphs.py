"""CUDA graphs for decode steps (issue 32, item 3).

A decode step of n sequences runs as the replay of a graph captured for the smallest captured
size S >= n (`capture_sizes`: 1, 2, 4, then steps of 8 to 256, then of 16, up to
`max_num_seqs`); larger steps, prefill, verification steps (several tokens per sequence), KV
groups, LoRA, a quantized KV cache and MoE layers without the fused kernel run eagerly
(`why_eager`). A graph reads only persistent buffers (`GraphBuffers`), so a step fills them on
the device and replays:

- rows 0..n-1: the step's ids, positions, slots, sequence lengths, query offsets and block
  tables (row stride `max_blocks_per_seq`, fixed for every size);
- padded rows n..S-1: slot -1 (nothing stored), position 0, and sequences of no tokens
  (`query_start_loc` stays at n, length 0): their tokens lie past `query_start_loc[-1]`, where
  attention writes exactly zero; their hidden states are sliced off.

The metadata of a size is built once, with the host maxima fixed (`max_seq_len` is the model's
length, `max_query_len` 1), so the attention backend's split count is chosen per captured size
at capture, never per step. The captured forward is the model's own forward, the same Python
as eager. Capture is `CudaCapture` (one memory pool for every size, largest first) on CUDA; the
tests use `RecordReplay`, which records the forward and replays it by calling it again over the
same buffers: what a replay can see is what a graph would see.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.models.moe import routes_on_device

logger = logging.getLogger(__name__)

MAX_CAPTURE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE) -> list[int]:
    """vLLM's default list: 1, 2, 4, 8, 16, ..., 256 (steps of 8), 272, ... (steps of 16),
    none above `max_num_seqs` (nor `limit`)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, limit + 1, 16))
    return [s for s in sizes if s <= min(max_num_seqs, limit)]


def why_eager(model: torch.nn.Module, device: torch.device, *, num_groups: int, lora: bool,
              quantized_kv: bool) -> str | None:
    """Why a runner's decode steps cannot be captured (None: they can). Checked before any
    capture: an error inside `torch.cuda.graph` can leave the allocator mid-capture, so a
    forward that would read a device value back is declined here, not caught there."""
    if getattr(model, "graph_unsafe", None):  # a model that says why (models/deepseek.py)
        return str(model.graph_unsafe)
    if num_groups > 1:
        return "the model's layers are in several KV groups"
    if lora:
        return "LoRA is on (per-token adapter rows)"
    if quantized_kv:
        return ("the KV cache is quantized (decode graphs over codes and scales are not yet "
                "run on a GPU)")
    if not routes_on_device(model, device):
        return "the MoE layers count their experts' tokens on the host (no fused MoE kernel)"
    return None


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows, or None (eager)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class GraphBuffers:
    """The inputs every captured graph reads, sized for the largest captured size."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_size = max_size
        self.input_ids = zeros(max_size, dtype=torch.long)
        self.positions = zeros(max_size, dtype=torch.long)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=device)
        self.seq_lens = zeros(max_size, dtype=torch.int32)
        self.query_start_loc = zeros(max_size + 1, dtype=torch.int32)
        self.block_tables = zeros(max_size, max_blocks_per_seq, dtype=torch.int32)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             size: int) -> None:
        """A decode step's n rows into rows 0..n-1, rows n..size-1 padding (device copies and
        fills only: no host read)."""
        n = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:size].zero_()
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[n + 1:size + 1].fill_(n)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)

    def metadata(self, size: int, max_seq_len: int, backend: str | None) -> AttentionMetadata:
        """A captured size's metadata over views of the buffers (built once per size)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_seq_len=max_seq_len, max_query_len=1, backend=backend)


class CudaCapture:
    """torch.cuda graphs, every size in one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor,
                                                                    Callable[[], None]]:
        forward()  # warm-up outside the graph: compiles kernels, settles allocations
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return out, graph.replay


class RecordReplay:
    """The stand-in for CPU tests: `capture` runs the forward once and records it; a replay
    runs it again and writes its result into the captured output, as a graph would."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], torch.Tensor]] = []
        self.replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor,
                                                                    Callable[[], None]]:
        self.captured.append(forward)
        out = forward()

        def replay() -> None:
            self.replays += 1
            out.copy_(forward())
        return out, replay


class DecodeGraphs:
    """The captured decode forwards of one model and cache, and the choice per step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 sizes: list[int], max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, backend: str | None) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.backend = backend
        self.buffers = GraphBuffers(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, tuple[torch.Tensor, Callable[[], None]]] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.used: Counter = Counter()  # replays per size

    def capture(self, capturer: Any) -> float:
        """Capture every size, largest first (smaller ones reuse its pool's memory); returns
        the seconds it took (counted in the time to ready)."""
        t0 = time.monotonic()
        for size in reversed(self.sizes):
            meta = self.buffers.metadata(size, self.max_model_len, self.backend)
            self.metas[size] = meta
            ids, pos = self.buffers.input_ids[:size], self.buffers.positions[:size]
            with torch.inference_mode():
                self.graphs[size] = capturer.capture(
                    lambda ids=ids, pos=pos, meta=meta: self._forward(ids, pos, meta))
        seconds = time.monotonic() - t0
        logger.info("captured %d decode graphs (sizes %s) in %.1f s", len(self.sizes),
                    _ranges(self.sizes), seconds)
        return seconds

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        # Nothing a backend derived in an earlier run survives into this one (on CUDA this runs
        # once, at capture; the stand-in runs it every replay, as the CPU backend needs).
        meta.plan = meta.row_lens = meta.row_seq_idx = None
        return self.model(ids, pos, self.kv_caches, meta)

    def size_for(self, num_tokens: int, meta: AttentionMetadata) -> int | None:
        """The captured size to run this step with, or None when it runs eagerly."""
        if meta.max_query_len != 1 or meta.seq_lens.shape[0] != num_tokens:
            return None  # not a pure decode step
        if type(meta) is not AttentionMetadata:
            return None  # several KV groups: eager
        size = padded_size(num_tokens, self.sizes)
        return size if size in self.graphs else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            size: int) -> torch.Tensor:
        """Fill the buffers, replay the size's graph, the real rows' hidden states."""
        self.buffers.fill(input_ids, positions, meta, size)
        out, replay = self.graphs[size]
        replay()
        self.used[size] += 1
        return out[:input_ids.shape[0]]


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 3 else str(sizes)
