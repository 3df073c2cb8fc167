"""Load a local Hugging Face checkpoint (or a GGUF file) into our paged-engine model.

Only local files: every transformers call passes `local_files_only=True`, so a typo in a path
fails here with a clear error instead of turning into a hub download.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kserve_paged_engine.config.quantization import ON_THE_FLY_METHODS, checkpoint_method
from kserve_paged_engine.config.quantization import check_method as quantization_check
from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.checkpoint_files import (
    Slicer,
    StrPath,
    check_architecture,
    is_gguf_folder,
    iter_weights,
    raw_config,
    resolve,
    sliced,
    weight_files,
)
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
from kserve_paged_engine.model_executor.quantization.tp_online import WholeRows
from kserve_paged_engine.model_executor.tp_layout import MOE_TP_ARCHITECTURES
from kserve_paged_engine.model_executor.tp_load import rank_slicer

logger = logging.getLogger("kserve_paged_engine")


def _quantized_checkpoint(folder: Path) -> tuple[str | None, Any]:
    """(method, what the reader needs) of a checkpoint whose config.json names its
    quantization; (None, None) for a float one (or no config.json yet: later checks say)."""
    if not (folder / "config.json").is_file():
        return None, None
    raw = raw_config(folder)
    method = checkpoint_method(raw)
    if method == "mxfp4":  # gpt-oss's experts: its model reads *_blocks / *_scales itself
        if raw.get("model_type") != "gpt_oss":
            raise ValueError("quant_method 'mxfp4' is read for gpt-oss checkpoints only "
                             f"(this one's model_type is {raw.get('model_type')!r})")
        return method, None
    if method == compressed_tensors.METHOD:
        return method, compressed_tensors.read_config(raw)
    if method == fp8_checkpoints.METHOD:
        return method, fp8_checkpoints.read_config(raw)
    return method, int4_checkpoints.read_config(raw) if method else None


def _kept_quantized(method: str, scheme: Any, weights: Iterator[tuple[str, torch.Tensor]],
                    dtype: torch.dtype, cuda: bool, cut: Slicer | None = None
                    ) -> tuple[Iterator[tuple[str, torch.Tensor]], Callable[[Any], object]]:
    """A quantized checkpoint's stream as float weights, and the step that puts their stored
    form back once the model holds them. `cut` (tensor parallelism): the whole tensors of
    `weights` cut by the reader, the packed ones in their packed form (quantization/tp_cuts.py)."""
    readers = {compressed_tensors.METHOD: compressed_tensors.CTReader,
               fp8_checkpoints.METHOD: fp8_checkpoints.Fp8Reader}
    reader: Any = readers.get(method, int4_checkpoints.Int4Reader)(scheme)
    reader.cut = cut

    def keep(model: Any) -> object:
        return quantization_apply(model, reader.picker(dtype, cuda), f"{method} (checkpoint)")
    return reader.stream(weights), keep


def _build(config: Any, dtype: torch.dtype, device: torch.device,
           weights: Iterator[tuple[str, torch.Tensor]] | None, seed: int = 0,
           tp: TPRanks | None = None,
           raw_config: dict[str, Any] | None = None,
           quantize: Callable[[LlamaForCausalLM], object] | None = None,
           expert_parallel: bool = False) -> LlamaForCausalLM:
    """Construct on the meta device (no wasted random init), allocate on `device`, fill: from
    `weights`, or with random values (`_fill_dummy`) when there are none. With `tp`, this
    rank's shard (the weights already cut by `iter_weights`). With `raw_config`
    (config.json), the fields the model's constructor did not read are logged (rank 0 only).
    `quantize` runs on the loaded weights before they are packed (`--quantization`)."""
    arch = architecture_of(config)
    cls = MODEL_REGISTRY[arch]
    with recording_reads(config) as reads, torch.device("meta"):
        model = cls(config) if tp is None else cls(config, tp=tp, **(
            {"expert_parallel": True} if expert_parallel and arch in MOE_TP_ARCHITECTURES else {}))
    if expert_parallel and (tp is None or arch not in MOE_TP_ARCHITECTURES) and not (
            tp is not None and tp.rank):  # as vLLM: accepted, and nothing to spread
        logger.info("enable_expert_parallel changes nothing: %s", "one rank holds every expert"
                    if tp is None else f"{arch} has no experts to spread")
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
        if not param.is_floating_point():  # packed codes (gpt-oss's MXFP4 experts): zeros
            param.zero_()
        elif param.dim() > 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(1.0 if "norm" in name else 0.0)


def _gguf_config(folder: Path, gguf_file: str) -> Any:
    """The model's config: its folder's config.json beside the GGUF, else the GGUF's metadata
    (transformers parses it; no tensor is read)."""
    from transformers import AutoConfig

    if is_gguf_folder(folder):
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

        read = gguf_read.read(folder / gguf_file, config, _expected_weights(config),
                              rank_slicer(config, tp))  # under TP each block group cut per rank
        keep = gguf_quant.keeper(read.groups, dtype, gguf_file)  # runs once `weights` is read
        return _build(config, dtype, device, read.weights, tp=tp, quantize=keep), config
    from transformers import AutoModelForCausalLM

    # The config read above passed on: without it transformers parses the file's metadata
    # (the whole tokenizer vocabulary among it) once more for the config alone.
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, config=config, local_files_only=True, dtype=torch.float32)
    arch = config.architectures
    config = hf_model.config
    config.architectures = arch
    state = hf_model.state_dict()
    del hf_model
    slicer = rank_slicer(config, tp)
    return _build(config, dtype, device, sliced(state.items(), slicer), tp=tp), config


def _folder_config(folder: Path) -> Any:
    """config.json through transformers, its architecture named where config.json names none
    (the registry's pick from model_type)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_of(config)]
    return config


def _load_dummy(folder: Path, dtype: torch.dtype, device: torch.device, seed: int,
                tp: TPRanks | None, quantize: Callable[[LlamaForCausalLM], object] | None,
                expert_parallel: bool) -> tuple[LlamaForCausalLM, Any]:
    """`load_format="dummy"`: config.json only, checked as a real load would be (architecture,
    tensor parallelism), and random weights (`_fill_dummy`)."""
    check_architecture(folder)
    config = _folder_config(folder)
    rank_slicer(config, tp, expert_parallel)  # the checks
    return _build(config, dtype, device, None, seed, tp, raw_config(folder),
                  quantize, expert_parallel), config


def load_model(path: StrPath, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, tp: TPRanks | None = None,
               quantization: str | None = None, expert_parallel: bool = False
               ) -> tuple[LlamaForCausalLM, Any]:
    """Load a local HF folder (config.json + safetensors/bin) or a .gguf file.

    Returns (model, transformers PretrainedConfig). Raises FileNotFoundError for a missing path,
    config or weights, and ValueError for an unsupported architecture or mismatched weights.
    A GGUF goes through transformers, which dequantizes it, or with `quantization="gguf"` is
    read once and its quantized projections kept packed.
    `load_format="dummy"` reads only config.json and draws random weights (`_fill_dummy`).
    With `tp` (tensor parallelism), this rank's shard, reading only its slices. `quantization`
    (`--quantization`, or an AWQ/GPTQ checkpoint's own): engine/kserve_paged_engine/model_executor/quantization/layouts.py.
    `expert_parallel` (`--enable-expert-parallel`): a mixture of experts' experts spread over
    the `tp` ranks instead of cut (a GGUF's are cut); nothing without `tp`.
    """
    folder, gguf_file = resolve(path)
    ckpt, scheme = (None, None) if gguf_file else _quantized_checkpoint(folder)
    quantization = quantization_check(quantization, gguf=gguf_file is not None,
                                      device_type=torch.device(device).type, checkpoint=ckpt)
    whole: WholeRows | None = None  # quantized at load under TP: whole rows' scales
    on_the_fly = None if quantization not in ON_THE_FLY_METHODS else (
        lambda m: quantization_apply(m, fp8_checkpoints.on_the_fly(dtype, whole)
                                     if quantization == "fp8"
                                     else on_the_fly_picker(quantization, dtype, whole),
                                     quantization))
    if load_format == "dummy":
        if gguf_file is not None:
            raise ValueError("load_format 'dummy' takes a folder with config.json, not a .gguf")
        return _load_dummy(folder, dtype, device, seed, tp, on_the_fly, expert_parallel)
    if gguf_file is not None:
        return _load_gguf(folder, gguf_file, dtype, device, tp, quantization == "gguf")

    check_architecture(folder)
    files = weight_files(folder)
    config = _folder_config(folder)
    slicer = rank_slicer(config, tp, expert_parallel)
    # A quantized checkpoint is read whole and cut by its reader, packed tensors packed.
    weights = iter_weights(files, slicer if ckpt is None else None)
    if on_the_fly is not None and slicer is not None and ckpt is None:
        # Read whole, cut after: the scales TP 1 would give (quantization/tp_online.py).
        whole = WholeRows(slicer, quantization)
        weights = whole.stream(iter_weights(files))
    if ckpt is not None and ckpt != "mxfp4":
        weights, on_the_fly = _kept_quantized(ckpt, scheme, weights, dtype,
                                              torch.device(device).type == "cuda", slicer)
    model = _build(config, dtype, device, weights, tp=tp, raw_config=raw_config(folder),
                   quantize=on_the_fly, expert_parallel=expert_parallel)
    if tp is not None and hasattr(model, "sep_token_id"):
        # An encoder's token types start after [SEP]: every rank needs its id, and a worker
        # has no tokenizer of its own (rank 0's engine sets it again from its tokenizer).
        model.sep_token_id = getattr(load_tokenizer(folder), "sep_token_id", None)
    return model, config


def load_tokenizer(path: StrPath) -> Any:
    """The checkpoint's tokenizer (AutoTokenizer, local files only; GGUF-embedded for a .gguf
    without a tokenizer beside it)."""
    from transformers import AutoTokenizer

    folder, gguf_file = resolve(path)
    if gguf_file is not None and not is_gguf_folder(folder):
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
