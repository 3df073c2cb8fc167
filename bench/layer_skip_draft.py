"""A draft model available offline: a checkpoint's first N decoder layers with its own
embeddings, final norm and LM head (a layer-skip draft, as in LayerSkip / self-speculative
decoding, without the fine-tuning that makes its early exit good). Same tokenizer, so it
drafts for the full model.

    python bench/layer_skip_draft.py --layers 8 [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_layer_skip_draft(model: str | Path, num_layers: int, out: str | Path | None = None
                          ) -> Path:
    """Write (once) and return the folder of `model` cut to its first `num_layers` layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(model)
    dst = Path(out) if out is not None else src.parent / f"{src.name}-first{num_layers}layers"
    if (dst / "config.json").is_file():
        return dst
    hf = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype="auto")
    total = hf.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"--layers must be from 1 to {total - 1} (the model has {total})")
    hf.model.layers = hf.model.layers[:num_layers]
    hf.config.num_hidden_layers = num_layers
    if getattr(hf.config, "layer_types", None):
        hf.config.layer_types = hf.config.layer_types[:num_layers]
    hf.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--model", default=None, help="source folder (default: the default model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    print(make_layer_skip_draft(args.model or ensure_default_model(), args.layers, args.out))


if __name__ == "__main__":
    main()
