"""How a pooling model turns a prompt's hidden states into one vector: the pooling kind (last
token, mean, CLS) and L2 normalisation, read from the model folder as sentence-transformers
writes it (`modules.json`, `1_Pooling/config.json`, a `Normalize` module), and the running
pool of a prompt computed over several steps (chunked prefill)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only in the methods: options parse without importing it
    import torch

POOLING_KINDS = ("last", "mean", "cls")
# sentence-transformers' pooling config key -> our kind (the first one set wins).
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    kind: str  # one of POOLING_KINDS
    normalize: bool  # the default of requests that leave `normalize` unset

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling kind must be one of {POOLING_KINDS} (got {self.kind!r})")


def read_pooler_config(folder: str | Path, default: PoolerConfig) -> PoolerConfig:
    """The folder's sentence-transformers pooling (modules.json), else `default`. Raises
    ValueError for a pooling mode this engine does not have (max, weighted mean...)."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    normalize = _ST_NORMALIZE in types
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return PoolerConfig(default.kind, normalize)
    cfg = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    on = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v
              and k not in _ST_MODES]
    if others or len(on) != 1:
        raise ValueError(f"{folder}: sentence-transformers pooling {others or on} is not "
                         f"supported (one of {', '.join(_ST_MODES)})")
    return PoolerConfig(on[0], normalize)


class RunningPool:
    """One prompt's pool as its chunks arrive: the sum (mean), the first row (CLS) or the
    latest row (last). A chunk starting at position 0 starts over (a preempted request
    recomputes its prompt)."""

    __slots__ = ("kind", "num_prompt", "value", "count")

    def __init__(self, kind: str, num_prompt: int) -> None:
        self.kind, self.num_prompt = kind, num_prompt
        self.value: torch.Tensor | None = None
        self.count = 0

    def add(self, start: int, count: int, part: torch.Tensor) -> None:
        """A chunk of `count` prompt positions from `start`, already reduced to `part` `[H]`
        (`chunk_parts`): its sum (mean), its first row (CLS) or its last row (last)."""
        if start == 0:
            self.value, self.count = None, 0
        if self.kind == "mean":
            self.value = part if self.value is None else self.value + part
        elif self.kind != "cls" or start == 0:
            self.value = part
        self.count = start + count

    def result(self) -> torch.Tensor:
        """The pooled vector `[H]` (float32) once the whole prompt was added."""
        if self.value is None or self.count != self.num_prompt:
            raise RuntimeError(f"pooled {self.count} of {self.num_prompt} prompt tokens")
        return self.value / self.num_prompt if self.kind == "mean" else self.value


def chunk_parts(kind: str, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """A step's pooled rows `[sum(counts), H]`, chunk after chunk, reduced to one float32 row a
    chunk `[len(counts), H]` for `RunningPool.add`, in one op for the whole step (not one per
    request: a step of hundreds of short sentences made those calls a visible cost)."""
    import torch

    lens = torch.tensor(counts, dtype=torch.long, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if kind == "mean":
        # The output's length told (the rows' total, known here): no read of `lens` on CUDA.
        seg = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), lens,
                                      output_size=hidden.shape[0])
        out = torch.zeros((len(counts), hidden.shape[1]), dtype=torch.float32,
                          device=hidden.device)
        return out.index_add_(0, seg, hidden.float())
    rows = ends - lens if kind == "cls" else ends - 1
    return hidden.index_select(0, rows).float()
