"""Load a local Hugging Face checkpoint (or a GGUF file) into our paged-engine model.

Only local files: every transformers call passes `local_files_only=True`, so a typo in a path
fails here with a clear error instead of turning into a hub download.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.config_reads import ignored_fields, recording_reads
from engine.models import MODEL_REGISTRY, LlamaForCausalLM, architecture_of

StrPath = str | os.PathLike[str]

logger = logging.getLogger("engine")


def _resolve(path: StrPath) -> tuple[Path, str | None]:
    """(folder, gguf file name or None). A folder holding no config.json but one .gguf counts
    as that GGUF file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model path {str(p)!r} is a file but not a .gguf; pass the folder "
                             "holding config.json and the weights, or a .gguf file")
        return p.parent, p.name
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0].name
        raise FileNotFoundError(f"model folder {str(p)!r} has no config.json")
    return p, None


def _weight_files(folder: Path) -> list[Path]:
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


def _iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, so memory stays near one shard."""
    from safetensors import safe_open

    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def _check_architecture(folder: Path) -> None:
    """Reject unsupported checkpoints from config.json alone, before transformers parses it
    (transformers would fail on an unknown model_type with a less useful message)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from e
    architecture_of(SimpleNamespace(architectures=raw.get("architectures"),
                                    model_type=raw.get("model_type")))


def _raw_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _build(config: Any, dtype: torch.dtype, device: torch.device,
           weights: Iterator[tuple[str, torch.Tensor]] | None, seed: int = 0,
           raw_config: dict[str, Any] | None = None) -> LlamaForCausalLM:
    """Construct on the meta device (no wasted random init), allocate on `device`, fill: from
    `weights`, or with random values (`_fill_dummy`) when there are none. With `raw_config`
    (config.json), the fields the model's constructor did not read are logged."""
    cls = MODEL_REGISTRY[architecture_of(config)]
    with recording_reads(config) as reads, torch.device("meta"):
        model = cls(config)
    if raw_config is not None:
        ignored = ignored_fields(raw_config, reads, getattr(config, "attribute_map", None))
        if ignored:
            logger.warning("config.json fields this engine ignores (they change nothing here): "
                           "%s", ", ".join(ignored))
    model.to(dtype=dtype)
    model.materialize(torch.device(device))
    if weights is None:
        _fill_dummy(model, seed)
    else:
        model.load_weights(weights)
    model = model.eval().requires_grad_(False)
    model.pack_weights()
    return model


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights for every parameter, drawn on its device: N(0, 0.02) for matrices and
    embeddings (transformers' initializer_range), ones for norm weights, zeros for biases.
    Deterministic for a seed."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if param.dim() > 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def load_model(path: StrPath, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0) -> tuple[LlamaForCausalLM, Any]:
    """Load a local HF folder (config.json + safetensors/bin) or a .gguf file.

    Returns (model, transformers PretrainedConfig). Raises FileNotFoundError for a missing path,
    config or weights, and ValueError for an unsupported architecture or mismatched weights.
    GGUF goes through transformers, which dequantizes it to `dtype`-castable float tensors.
    `load_format="dummy"` reads only config.json and draws random weights (`_fill_dummy`).
    """
    from transformers import AutoConfig

    folder, gguf_file = _resolve(path)
    if load_format == "dummy":
        if gguf_file is not None:
            raise ValueError("load_format 'dummy' takes a folder with config.json, not a .gguf")
        _check_architecture(folder)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if not getattr(config, "architectures", None):
            config.architectures = [architecture_of(config)]
        return _build(config, dtype, device, None, seed, _raw_config(folder)), config
    if gguf_file is not None:
        from transformers import AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        arch = architecture_of(config)
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, local_files_only=True, dtype=torch.float32)
        config = hf_model.config
        config.architectures = [arch]
        state = hf_model.state_dict()
        del hf_model
        model = _build(config, dtype, device, iter(state.items()))
        return model, config

    _check_architecture(folder)
    files = _weight_files(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_of(config)]
    return _build(config, dtype, device, _iter_weights(files),
                  raw_config=_raw_config(folder)), config


def load_tokenizer(path: StrPath) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer, local files only; GGUF-embedded for .gguf)."""
    from transformers import AutoTokenizer

    folder, gguf_file = _resolve(path)
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
