"""Tensor parallelism at load: whether a model shards over the ranks, and which part of each
checkpoint tensor a rank reads (tp_layout.py cuts the dense weights, moe_layout.py the experts).

Checked from config.json before anything loads (`check_tensor_parallel_folder`), and again by
each rank's loader when it builds its `rank_slicer`.
"""

from __future__ import annotations

from typing import Any

from kserve_paged_engine.distributed.ranks import TPRanks
from kserve_paged_engine.model_executor.checkpoint_files import (
    Slicer,
    StrPath,
    check_architecture,
    resolve,
)
from kserve_paged_engine.model_executor.models import architecture_of
from kserve_paged_engine.model_executor.moe_layout import ExpertLayout
from kserve_paged_engine.model_executor.tp_layout import (
    MOE_TP_ARCHITECTURES,
    TP_ARCHITECTURES,
    TPLayout,
)


def check_tensor_parallel(config: Any, world: int, expert_parallel: bool = False) -> TPLayout:
    """Rank 0's layout, or ValueError if this model does not shard over `world` ranks (a
    mixture of experts: its experts cut, or spread with `expert_parallel`, moe_layout.py)."""
    from kserve_paged_engine.model_executor.models.architectures import decoder_of

    arch = architecture_of(config)
    if decoder_of(arch) not in TP_ARCHITECTURES:  # a decoder classifier shards as its decoder
        raise ValueError(f"tensor_parallel_size {world}: {arch} is not sharded by this engine "
                         f"(tensor parallelism covers {', '.join(TP_ARCHITECTURES)} and their "
                         "sequence classifiers)")
    if arch in MOE_TP_ARCHITECTURES:
        ExpertLayout.of(config, 0, world, expert_parallel)
    return layout_of(config, 0, world)


def layout_of(config: Any, rank: int, world: int) -> TPLayout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # BERT
    return TPLayout.of(config.num_attention_heads, kv_heads, head_dim,
                       config.intermediate_size, config.vocab_size, rank, world)


def check_tensor_parallel_folder(path: StrPath, world: int, expert_parallel: bool = False
                                 ) -> None:
    """`check_tensor_parallel` from a folder's config.json alone (a GGUF file is checked when
    loaded); raises ValueError before anything loads."""
    from transformers import AutoConfig

    folder, gguf_file = resolve(path)
    if gguf_file is None:
        check_architecture(folder)
        check_tensor_parallel(AutoConfig.from_pretrained(folder, local_files_only=True), world,
                              expert_parallel)


def _rank_layout(config: Any, tp: TPRanks) -> TPLayout:
    check_tensor_parallel(config, tp.world_size)
    return layout_of(config, tp.rank, tp.world_size)


def rank_slicer(config: Any, tp: TPRanks | None, expert_parallel: bool = False) -> Slicer | None:
    """Which part of each checkpoint tensor this rank reads (None: all of every tensor, TP 1):
    the dense rule, and for a mixture of experts its experts' (moe_layout.py)."""
    if tp is None:
        return None
    dense = _rank_layout(config, tp).weight_slice
    if architecture_of(config) not in MOE_TP_ARCHITECTURES:
        return dense
    experts = ExpertLayout.of(config, tp.rank, tp.world_size, expert_parallel)
    return lambda name: experts.weight_slice(name, dense)
