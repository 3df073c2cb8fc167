"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over the paged latent cache.

Per token: the query (through a low-rank `q_a_proj` -> norm -> `q_b_proj`, or one `q_proj`)
split into a no-RoPE part and a RoPE part per head; `kv_a_proj_with_mqa` gives the compressed
KV (`kv_lora_rank`, normalised by `kv_a_layernorm`) and one shared RoPE key. Only those two go
into the cache, as one latent row (kernels/kserve_paged_kernels/mla_reference.py has the
layout); `kv_b_proj` up-projects a latent to each head's no-RoPE key and value.

Two paths, the same result (tests/test_models_deepseek.py checks them against each other and
against transformers):
- absorbed: `W_UK` (kv_b_proj's key rows) is multiplied into the query and `W_UV` (its value
  rows) into the output, so attention runs over the latent rows as they are stored (MQA, one
  shared row of `kv_lora_rank + qk_rope_head_dim` values for every head). Its cost grows with
  the new tokens times the context.
- expanded: the context's latents are up-projected to per-head keys and values and attended
  as multi-head attention. Its cost is dominated by up-projecting the whole context once.
`mode` "auto" takes the cheaper for each sequence from those two costs (`absorbs`): decode
steps (and short speculative chunks) absorb, prefill chunks expand. Where Triton runs (CUDA,
or its interpreter with the triton backend forced) a step whose sequences all absorb is one
kernel over every row (kernels/kserve_paged_kernels/mla_triton.py); otherwise torch, one
sequence at a time (kernels/kserve_paged_kernels/mla_reference.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kserve_paged_engine.model_executor.attention import AttentionMetadata
from kserve_paged_engine.model_executor.layers import Linear, RMSNorm
from kserve_paged_engine.model_executor.rope import RotaryEmbedding, _yarn_mscale
from kserve_paged_kernels import fused_ops, quant_linear
from kserve_paged_kernels import mla_reference as mla
from kserve_paged_kernels.kv_quant import QuantKV

MLA_MODES = ("auto", "absorbed", "expanded")
# transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with their default epsilon,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: Any, rope: dict[str, Any]) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim) ** 2` when the RoPE
    is scaled and sets `mscale_all_dim` (DeepSeek's reference and transformers alike)."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    mscale_all_dim = rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and mscale_all_dim:
        m = _yarn_mscale(float(rope["factor"]), float(mscale_all_dim))
        scale *= m * m
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleave: bool) -> torch.Tensor:
    """RoPE over the last dim; `interleave`: DeepSeek's pairs `(x0, x1), (x2, x3), ...` (the
    output de-interleaved, as transformers writes it: q and k alike, so dot products hold),
    else the rotate-half layout."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    """DeepSeek's attention block (transformers' `self_attn.*` names), one paged latent cache
    per layer. `mode` picks the path (module docstring); the model sets it for every layer."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, scale: float) -> None:
        super().__init__()
        h = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        if getattr(config, "qk_head_dim", self.qk_dim) != self.qk_dim:
            raise ValueError(f"qk_head_dim {config.qk_head_dim} != qk_nope_head_dim + "
                             f"qk_rope_head_dim ({self.qk_dim})")
        self.interleave = bool(getattr(config, "rope_interleave", True))
        self.scale = scale
        self.mode = "auto"
        if self.q_lora_rank:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_proj = Linear(h, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.rotary = [rotary]  # shared, kept out of the module tree

    def _up_projection(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight (W_UK and W_UV), which the absorbed path multiplies by itself;
        under `--quantization` the float weight is gone, so the weight its codes stand for
        (decoded each step: a cost of quantizing this projection, not of reading it)."""
        proj = self.kv_b_proj
        return proj.weight if proj.quant is None else quant_linear.dequant(proj.quant).to(dtype)

    def absorbs(self, q_len: int) -> bool:
        """Whether `q_len` new tokens of a sequence take the absorbed path: under "auto" when
        its attention work per context token, `q_len * (2 * kv_lora_rank + rope)` per head, is
        below the expanded path's up-projection of that token, `kv_lora_rank * (nope + v)`."""
        if self.mode != "auto":
            return self.mode == "absorbed"
        r = self.kv_lora_rank
        return q_len * (2 * r + self.rope_dim) < r * (self.nope_dim + self.v_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim],
                                                             dim=-1)
        compressed = self.kv_a_layernorm(compressed.contiguous())
        rotary = self.rotary[0]
        cos = rotary.cos[positions].unsqueeze(1)  # [T, 1, rope / 2]
        sin = rotary.sin[positions].unsqueeze(1)
        q_pe = rotate(q_pe, cos, sin, self.interleave)
        k_pe = rotate(k_pe.unsqueeze(1), cos, sin, self.interleave)[:, 0]
        latent = torch.cat((compressed, k_pe), dim=-1)  # [T, kv_lora_rank + rope]
        mla.store_latent(latent, kv_cache, meta.slot_mapping, backend=meta.backend)

        w = self._up_projection(x.dtype).view(self.num_heads, self.nope_dim + self.v_dim,
                                              self.kv_lora_rank)
        triton = (fused_ops.triton_module("mla_triton", x.device, meta.backend)
                  if self.absorbs(meta.max_query_len) and not isinstance(kv_cache, QuantKV)
                  else None)
        if triton is not None:  # every sequence absorbs: one kernel over all rows
            out = self._absorbed_triton(q_nope, q_pe, kv_cache, meta, w, triton)
            return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
        out = x.new_zeros(t, self.num_heads, self.v_dim)
        for seq, start, q_len, seq_len in mla.sequences(meta):
            rows = slice(start, start + q_len)
            latents = mla.gather_latents(kv_cache, meta.block_tables[seq], seq_len, x.dtype)
            if self.absorbs(q_len):
                out[rows] = self._absorbed(q_nope[rows], q_pe[rows], latents, w)
            else:
                out[rows] = self._expanded(q_nope[rows], q_pe[rows], latents)
        return self.o_proj(out.view(t, self.num_heads * self.v_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                  w: torch.Tensor) -> torch.Tensor:
        """W_UK into the query, MQA over the latent rows, W_UV on the latent output."""
        w_uk, w_uv = w[:, :self.nope_dim], w[:, self.nope_dim:]  # [H, nope|v, r]
        q_latent = torch.einsum("qhn,hnr->qhr", q_nope, w_uk)
        q_full = torch.cat((q_latent, q_pe), dim=-1)
        out_latent = mla.attend_latent(q_full, latents, self.kv_lora_rank, self.scale)
        return torch.einsum("qhr,hvr->qhv", out_latent.to(w.dtype), w_uv)

    def _absorbed_triton(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata, w: torch.Tensor,
                         triton: Any) -> torch.Tensor:
        """The absorbed path for the whole step in one Triton kernel
        (kernels/kserve_paged_kernels/mla_triton.py): no per-sequence loop on the host."""
        w_uk, w_uv = w[:, :self.nope_dim], w[:, self.nope_dim:]
        q_full = torch.cat((torch.einsum("qhn,hnr->qhr", q_nope, w_uk), q_pe), dim=-1)
        out_latent = triton.mla_absorbed_triton(q_full, kv_cache, meta, self.kv_lora_rank,
                                                self.scale)
        return torch.einsum("qhr,hvr->qhv", out_latent.to(w.dtype), w_uv)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                  latents: torch.Tensor) -> torch.Tensor:
        """The context's latents up-projected to per-head keys and values, then MHA."""
        kv_len = latents.shape[0]
        compressed, k_pe = latents.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(compressed.contiguous()).view(kv_len, self.num_heads,
                                                          self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return mla.attend_expanded(q, k, v, self.scale)
