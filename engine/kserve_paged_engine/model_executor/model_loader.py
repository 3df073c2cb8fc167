"""Load a local Hugging Face checkpoint (or a GGUF file) into our paged-engine model.

Only local files: every transformers call passes `local_files_only=True`, so a typo in a path
fails here with a clear error instead of turning into a hub download.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kserve_paged_engine.config.quantization import ON_THE_FLY_METHODS, checkpoint_method
from kserve_paged_engine.config.quantization import check_method as quantization_check
from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.config_reads import ignored_fields, recording_reads
from kserve_paged_engine.model_executor.models import (
    MODEL_REGISTRY,
    LlamaForCausalLM,
    architecture_of,
)
from kserve_paged_engine.model_executor.quantization import (
    compressed_tensors,
    fp8_checkpoints,
    int4_checkpoints,
)
from kserve_paged_engine.model_executor.quantization.layouts import apply as quantization_apply
from kserve_paged_engine.model_executor.quantization.layouts import on_the_fly as on_the_fly_picker
from kserve_paged_engine.model_executor.tp_layout import TP_ARCHITECTURES, TPLayout

StrPath = str | os.PathLike[str]

logger = logging.getLogger("kserve_paged_engine")


def _resolve(path: StrPath) -> tuple[Path, str | None]:
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
    if len(ggufs) == 1 and _is_gguf_folder(p):
        return p, ggufs[0].name
    return p, None


def _is_gguf_folder(folder: Path) -> bool:
    """A config.json and a tokenizer beside a GGUF, no other weights: config and tokenizer
    come from the folder, the weights from the GGUF."""
    return ((folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
            and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")))


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


Slicer = Callable[[str], "tuple[int, int, int] | None"]


def _iter_weights(files: list[Path], slicer: Slicer | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, so memory stays near one shard. With a
    `slicer` (tensor parallelism: name -> (dim, start, size) or None for all of it) only that
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
                    dim, start, size = cut
                    part = f.get_slice(name)
                    index = [slice(None)] * len(part.get_shape())
                    index[dim] = slice(start, start + size)
                    yield name, part[tuple(index)]
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from _sliced(state.items(), slicer)
            del state


def _sliced(weights: Iterable[tuple[str, torch.Tensor]], slicer: Slicer | None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors already in memory (pytorch_model.bin, GGUF), cut as `_iter_weights` cuts."""
    for name, tensor in weights:
        cut = slicer(name) if slicer is not None else None
        yield name, tensor if cut is None else tensor.narrow(*cut)


def check_architecture(folder: Path) -> None:
    """Reject unsupported checkpoints from config.json alone, before transformers parses it
    (transformers would fail on an unknown model_type with a less useful message)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from e
    architecture_of(SimpleNamespace(architectures=raw.get("architectures"),
                                    model_type=raw.get("model_type")))


def _quantized_checkpoint(folder: Path) -> tuple[str | None, Any]:
    """(method, what the reader needs) of a checkpoint whose config.json names its
    quantization; (None, None) for a float one (or no config.json yet: later checks say)."""
    if not (folder / "config.json").is_file():
        return None, None
    raw = _raw_config(folder)
    method = checkpoint_method(raw)
    if method == compressed_tensors.METHOD:
        return method, compressed_tensors.read_config(raw)
    if method == fp8_checkpoints.METHOD:
        return method, fp8_checkpoints.read_config(raw)
    return method, int4_checkpoints.read_config(raw) if method else None


def _kept_quantized(method: str, scheme: Any, weights: Iterator[tuple[str, torch.Tensor]],
                    dtype: torch.dtype, cuda: bool
                    ) -> tuple[Iterator[tuple[str, torch.Tensor]], Callable[[Any], object]]:
    """A quantized checkpoint's stream as float weights, and the step that puts their stored
    form back once the model holds them."""
    readers = {compressed_tensors.METHOD: compressed_tensors.CTReader,
               fp8_checkpoints.METHOD: fp8_checkpoints.Fp8Reader}
    reader: Any = readers.get(method, int4_checkpoints.Int4Reader)(scheme)

    def keep(model: Any) -> object:
        return quantization_apply(model, reader.picker(dtype, cuda), f"{method} (checkpoint)")
    return reader.stream(weights), keep


def _raw_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _build(config: Any, dtype: torch.dtype, device: torch.device,
           weights: Iterator[tuple[str, torch.Tensor]] | None, seed: int = 0,
           tp: TPRanks | None = None,
           raw_config: dict[str, Any] | None = None,
           quantize: Callable[[LlamaForCausalLM], object] | None = None) -> LlamaForCausalLM:
    """Construct on the meta device (no wasted random init), allocate on `device`, fill: from
    `weights`, or with random values (`_fill_dummy`) when there are none. With `tp`, this
    rank's shard (the weights already cut by `_iter_weights`). With `raw_config`
    (config.json), the fields the model's constructor did not read are logged (rank 0 only).
    `quantize` runs on the loaded weights before they are packed (`--quantization`)."""
    arch = architecture_of(config)
    cls = MODEL_REGISTRY[arch]
    with recording_reads(config) as reads, torch.device("meta"):
        model = cls(config) if tp is None else cls(config, tp=tp)
    if raw_config is not None and (tp is None or tp.rank == 0):
        ignored = ignored_fields(raw_config, reads, getattr(config, "attribute_map", None))
        if ignored:
            logger.warning("config.json fields this engine ignores (they change nothing here): "
                           "%s", ", ".join(ignored))
    model.to(dtype=dtype)
    model.materialize(torch.device(device))
    if weights is None:
        # Under tensor parallelism each rank draws its own shard: shapes, not TP=1's values.
        _fill_dummy(model, seed + (tp.rank if tp is not None else 0))
    else:
        model.load_weights(weights)
    model = model.eval().requires_grad_(False)
    if quantize is not None:
        quantize(model)
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


def check_tensor_parallel(config: Any, world: int) -> TPLayout:
    """Rank 0's layout, or ValueError if this model does not shard over `world` ranks."""
    from kserve_paged_engine.model_executor.models.architectures import decoder_of

    arch = architecture_of(config)
    if decoder_of(arch) not in TP_ARCHITECTURES:  # a decoder classifier shards as its decoder
        raise ValueError(f"tensor_parallel_size {world}: {arch} is not sharded by this engine "
                         f"(tensor parallelism covers {', '.join(TP_ARCHITECTURES)} and their "
                         "sequence classifiers)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TPLayout.of(config.num_attention_heads, config.num_key_value_heads, head_dim,
                       config.intermediate_size, config.vocab_size, 0, world)


def check_tensor_parallel_folder(path: StrPath, world: int) -> None:
    """`check_tensor_parallel` from a folder's config.json alone (a GGUF file is checked when
    loaded); raises ValueError before anything loads."""
    from transformers import AutoConfig

    folder, gguf_file = _resolve(path)
    if gguf_file is None:
        check_architecture(folder)
        check_tensor_parallel(AutoConfig.from_pretrained(folder, local_files_only=True), world)


def _layout(config: Any, tp: TPRanks) -> TPLayout:
    check_tensor_parallel(config, tp.world_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TPLayout.of(config.num_attention_heads, config.num_key_value_heads, head_dim,
                       config.intermediate_size, config.vocab_size, tp.rank, tp.world_size)


def _gguf_config(folder: Path, gguf_file: str) -> Any:
    """The model's config: its folder's config.json beside the GGUF, else the GGUF's metadata
    (transformers parses it; no tensor is read)."""
    from transformers import AutoConfig

    if _is_gguf_folder(folder):
        check_architecture(folder)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    else:
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    config.architectures = [architecture_of(config)]
    return config


def _expected_weights(config: Any) -> set[str]:
    """transformers' parameter names our model of `config` loads (built on the meta device)."""
    with torch.device("meta"):
        return MODEL_REGISTRY[architecture_of(config)](config).expected_weights()


def _load_gguf(folder: Path, gguf_file: str, dtype: torch.dtype, device: torch.device,
               tp: TPRanks | None, keep_quantized: bool) -> tuple[LlamaForCausalLM, Any]:
    """A .gguf: with `--quantization gguf` read once (engine/kserve_paged_engine/model_executor/quantization/gguf_read.py), its
    quantized projections kept packed; without, through transformers, dequantized."""
    config = _gguf_config(folder, gguf_file)
    if keep_quantized:
        # Imported here, not at module import: the minimal GPU image has no `gguf`
        # (bench/gpu_acceptance.py).
        from kserve_paged_engine.model_executor.quantization import gguf_quant, gguf_read

        read = gguf_read.read(folder / gguf_file, config, _expected_weights(config))
        keep = gguf_quant.keeper(read.groups, dtype, gguf_file)  # runs once `weights` is read
        return _build(config, dtype, device, read.weights, quantize=keep), config
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, local_files_only=True, dtype=torch.float32)
    arch = config.architectures
    config = hf_model.config
    config.architectures = arch
    state = hf_model.state_dict()
    del hf_model
    slicer = _layout(config, tp).weight_slice if tp is not None else None
    return _build(config, dtype, device, _sliced(state.items(), slicer), tp=tp), config


def load_model(path: StrPath, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, tp: TPRanks | None = None,
               quantization: str | None = None) -> tuple[LlamaForCausalLM, Any]:
    """Load a local HF folder (config.json + safetensors/bin) or a .gguf file.

    Returns (model, transformers PretrainedConfig). Raises FileNotFoundError for a missing path,
    config or weights, and ValueError for an unsupported architecture or mismatched weights.
    A GGUF goes through transformers, which dequantizes it, or with `quantization="gguf"` is
    read once and its quantized projections kept packed.
    `load_format="dummy"` reads only config.json and draws random weights (`_fill_dummy`).
    With `tp` (tensor parallelism), this rank's shard, reading only its slices. `quantization`
    (`--quantization`, or an AWQ/GPTQ checkpoint's own): engine/kserve_paged_engine/model_executor/quantization/layouts.py.
    """
    from transformers import AutoConfig

    folder, gguf_file = _resolve(path)
    ckpt, scheme = (None, None) if gguf_file else _quantized_checkpoint(folder)
    quantization = quantization_check(quantization, gguf=gguf_file is not None,
                                      device_type=torch.device(device).type, tp=tp is not None,
                                      checkpoint=ckpt)
    on_the_fly = None if quantization not in ON_THE_FLY_METHODS else (
        lambda m: quantization_apply(m, fp8_checkpoints.on_the_fly(dtype) if quantization == "fp8"
                                     else on_the_fly_picker(quantization, dtype), quantization))
    if load_format == "dummy":
        if gguf_file is not None:
            raise ValueError("load_format 'dummy' takes a folder with config.json, not a .gguf")
        check_architecture(folder)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        if not getattr(config, "architectures", None):
            config.architectures = [architecture_of(config)]
        if tp is not None:
            _layout(config, tp)
        return _build(config, dtype, device, None, seed, tp, _raw_config(folder),
                      on_the_fly), config
    if gguf_file is not None:
        return _load_gguf(folder, gguf_file, dtype, device, tp, quantization == "gguf")

    check_architecture(folder)
    files = _weight_files(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_of(config)]
    slicer = _layout(config, tp).weight_slice if tp is not None else None
    weights = _iter_weights(files, slicer)
    if ckpt is not None:
        weights, on_the_fly = _kept_quantized(ckpt, scheme, weights, dtype,
                                              torch.device(device).type == "cuda")
    return _build(config, dtype, device, weights, tp=tp,
                  raw_config=_raw_config(folder), quantize=on_the_fly), config


def load_tokenizer(path: StrPath) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer, local files only; GGUF-embedded for a .gguf
    without a tokenizer beside it)."""
    from transformers import AutoTokenizer

    folder, gguf_file = _resolve(path)
    if gguf_file is not None and not _is_gguf_folder(folder):
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
