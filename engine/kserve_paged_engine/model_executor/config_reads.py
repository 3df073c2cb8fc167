"""Which `config.json` fields the engine ignores, found by recording what the model code reads.

Why record instead of keeping a list per model: a list drifts from the code that reads the
config, and a field nobody reads (a new rope setting, a quantization block, an attention
option) changes nothing here while the user believes it does. So the loader records every
attribute the model's constructor reads and lists at start-up the config.json fields it did not
read, except those that cannot matter for inference.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# Fields with no effect on a forward pass in eval mode, or read elsewhere (the tokenizer, the
# generation config, the loader's dtype handling and architecture check).
NO_EFFECT_AT_INFERENCE = frozenset({
    "_name_or_path", "_model_name_or_path", "architectures", "model_type",
    "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "dropout",
    "pretraining_tp", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "router_aux_loss_coef",
    "output_router_logits", "router_jitter_noise", "router_z_loss_coef",
    "aux_loss_alpha", "seq_aux",  # DeepSeek's training-time balance losses
})

# transformers folds these config.json keys into another attribute when it parses the file.
FOLDED_INTO = {
    "rope_parameters": ("rope_theta", "rope_scaling", "rope_local_base_freq", "rope_type",
                        "original_max_position_embeddings"),  # read by scaled RoPE only
    "layer_types": ("max_window_layers", "use_sliding_window", "sliding_window_pattern",
                    "_sliding_window_pattern"),
}


@contextmanager
def recording_reads(config: Any) -> Iterator[set[str]]:
    """Every attribute name read on `config` inside the block (its class swapped for a
    recording subclass meanwhile, so isinstance checks still hold)."""
    reads: set[str] = set()
    cls = type(config)

    class Recording(cls):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            reads.add(name)
            return super().__getattribute__(name)

    Recording.__name__ = Recording.__qualname__ = cls.__name__
    config.__class__ = Recording
    try:
        yield reads
    finally:
        config.__class__ = cls


def ignored_fields(raw: Mapping[str, Any], reads: set[str],
                   attribute_map: Mapping[str, str] | None = None) -> list[str]:
    """The fields of `raw` (config.json) that were not read and could matter: an unread field
    that is off (None, false, 0, empty) changes nothing either way, so it is not listed."""
    read = set(reads) | {attribute_map[r] for r in reads if attribute_map and r in attribute_map}
    for folded, sources in FOLDED_INTO.items():
        if folded in read:
            read.update(sources)
    return sorted(k for k, v in raw.items()
                  if v not in (None, False, 0, "", [], {}) and k not in read
                  and k not in NO_EFFECT_AT_INFERENCE)
