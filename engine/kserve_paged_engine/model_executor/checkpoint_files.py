"""Find and read a local checkpoint's files: its folder or GGUF file, config.json, and its
weight tensors one file at a time, each tensor whole or only the slice a rank needs.

The loader (model_loader.py) builds the model from these; tensor parallelism (tp_load.py)
says which slice of each tensor a rank reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kserve_paged_engine.model_executor.models import architecture_of
from kserve_paged_engine.model_executor.tp_layout import Cut

StrPath = str | os.PathLike[str]

# name -> this rank's cut of that checkpoint tensor, or None for all of it.
Slicer = Callable[[str], "Cut | list[Cut] | None"]


def resolve(path: StrPath) -> tuple[Path, str | None]:
    """(folder, gguf file name or None). A folder holding one .gguf and no other weights counts
    as that GGUF file (with a config.json and tokenizer beside it: a packaged model's GGUF
    folder, engine/kserve_paged_engine/frontend/default_model.py)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model path {str(p)!r} is a file but not a .gguf; pass the folder "
                             "holding config.json and the weights, or a .gguf file")
        return p.parent, p.name
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").is_file():
        if len(ggufs) == 1:
            return p, ggufs[0].name
        raise FileNotFoundError(f"model folder {str(p)!r} has no config.json")
    if len(ggufs) == 1 and is_gguf_folder(p):
        return p, ggufs[0].name
    return p, None


def is_gguf_folder(folder: Path) -> bool:
    """A config.json and a tokenizer beside a GGUF, no other weights: config and tokenizer
    come from the folder, the weights from the GGUF."""
    return ((folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
            and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")))


def raw_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def check_architecture(folder: Path) -> None:
    """Reject unsupported checkpoints from config.json alone, before transformers parses it
    (transformers would fail on an unknown model_type with a less useful message)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from e
    architecture_of(SimpleNamespace(architectures=raw.get("architectures"),
                                    model_type=raw.get("model_type")))


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: sharded or single safetensors, else pytorch_model.bin."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [folder / name for name in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise FileNotFoundError(f"{index} lists shard(s) missing from the folder: {absent}")
            return files
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        return safetensors
    if (folder / "pytorch_model.bin").is_file():
        return [folder / "pytorch_model.bin"]
    raise FileNotFoundError(
        f"model folder {str(folder)!r} has no weights (looked for model.safetensors.index.json, "
        "*.safetensors, pytorch_model.bin.index.json, pytorch_model.bin)")


def take(source: Any, cut: Cut | list[Cut]) -> torch.Tensor:
    """A cut of a tensor, or of a safetensors slice (only that part read): one range, or the
    concatenation of several along their dim (a fused checkpoint tensor's sub-projections)."""
    if isinstance(cut, list):
        return torch.cat([take(source, part) for part in cut], dim=cut[0][0])
    dim, start, size = cut
    if isinstance(source, torch.Tensor):
        return source.narrow(dim, start, size)
    index = [slice(None)] * len(source.get_shape())
    index[dim] = slice(start, start + size)
    return source[tuple(index)]


def iter_weights(files: list[Path], slicer: Slicer | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, so memory stays near one shard. With a
    `slicer` (tensor parallelism: name -> a cut, `take`, or None for all of it) only that
    slice is read from a safetensors file (`get_slice`), never the whole tensor."""
    from safetensors import safe_open

    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    cut = slicer(name) if slicer is not None else None
                    if cut is None:
                        yield name, f.get_tensor(name)
                        continue
                    yield name, take(f.get_slice(name), cut)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from sliced(state.items(), slicer)
            del state


def sliced(weights: Iterable[tuple[str, torch.Tensor]], slicer: Slicer | None
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors already in memory (pytorch_model.bin, GGUF), cut as `iter_weights` cuts."""
    for name, tensor in weights:
        cut = slicer(name) if slicer is not None else None
        yield name, tensor if cut is None else take(tensor, cut)
