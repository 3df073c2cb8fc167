"""How a Llama-family model divides over tensor-parallel ranks: heads, MLP columns, vocabulary.

One home of the rule, read by the sharded model, the loader (which slice of each checkpoint
tensor a rank reads) and the capacity planner (kserve_paged/plan.py), so the three agree. No
torch import: the planner checks a config before anything heavy loads.

- KV heads: with at least as many KV heads as ranks, each rank takes a contiguous run of them
  (as even as possible: 3 KV heads over 2 ranks are 2 + 1), and the query heads of their groups.
  With fewer, each KV head is replicated on `world // kv` ranks and their query heads split.
- MLP: `intermediate_size` split into contiguous runs, as even as possible.
- Vocabulary: padded to a multiple of the world size, so every rank's logits have one shape
  and a gather concatenates them; the padding rows are zero and cut off.
"""

from __future__ import annotations

from dataclasses import dataclass

# Mixtral and Qwen3-MoE: attention as the Llama family's, experts cut or spread (moe_layout.py).
MOE_TP_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# Architectures whose model code shards (engine/kserve_paged_engine/model_executor/models/llama.py, gemma.py, bert.py);
# the others refuse tensor_parallel_size > 1.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                    "Gemma3ForCausalLM", "BertModel", "BertForSequenceClassification",
                    *MOE_TP_ARCHITECTURES)

# A BERT checkpoint's module paths -> the Llama name of the same cut (longest suffix first).
_ENCODER_ROLES = (("attention.self.query", "q_proj"), ("attention.self.key", "k_proj"),
                  ("attention.self.value", "v_proj"), ("attention.output.dense", "o_proj"),
                  ("intermediate.dense", "up_proj"), ("output.dense", "down_proj"),
                  ("word_embeddings", "embed_tokens"))

Cut = tuple[int, int, int]  # (dim, start, size) of a checkpoint tensor


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank's contiguous share of n items, the first n % world ranks one more."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(slots=True, frozen=True)
class TPLayout:
    rank: int
    world: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
           vocab_size: int, rank: int, world: int) -> TPLayout:
        """The layout, or ValueError saying why these heads do not split over `world` ranks."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of tensor_parallel_size {world} is out of range")
        if num_kv_heads < world and (world % num_kv_heads or num_heads % world):
            raise ValueError(
                f"tensor_parallel_size {world} does not divide this model: with fewer KV "
                f"heads ({num_kv_heads}) than ranks, the ranks must be a multiple of the KV "
                f"heads and divide the {num_heads} attention heads")
        if intermediate_size < world:
            raise ValueError(f"intermediate_size {intermediate_size} is smaller than "
                             f"tensor_parallel_size {world}")
        return cls(rank, world, num_heads, num_kv_heads, head_dim, intermediate_size,
                   vocab_size)

    @property
    def replicated_kv(self) -> bool:
        return self.num_kv_heads < self.world

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, count) this rank holds."""
        if self.replicated_kv:
            return self.rank // (self.world // self.num_kv_heads), 1
        return split(self.num_kv_heads, self.world, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        """(first query head, count): the groups of this rank's KV heads, or with replicated KV
        heads an even share."""
        if self.replicated_kv:
            return split(self.num_heads, self.world, self.rank)
        group = self.num_heads // self.num_kv_heads
        start, count = self.kv_heads
        return start * group, count * group

    @property
    def intermediate(self) -> tuple[int, int]:
        return split(self.intermediate_size, self.world, self.rank)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.world)

    @property
    def vocab(self) -> tuple[int, int]:
        """(first token id, rows in the checkpoint) of this rank's vocabulary shard; the shard
        itself always has `vocab_per_rank` rows (the last one's tail is padding)."""
        start = self.rank * self.vocab_per_rank
        return start, max(0, min(self.vocab_per_rank, self.vocab_size - start))

    def weight_slice(self, hf_name: str) -> Cut | list[Cut] | None:
        """(dim, start, size) of the checkpoint tensor `hf_name` this rank reads; a list of
        them, read and concatenated along their dim, for a tensor the checkpoint stores fused
        (Phi-3's `qkv_proj`, `gate_up_proj`: each sub-projection's own rows); None: all of it
        (norms; row-parallel biases, added on rank 0 only)."""
        module_path, _, leaf = hf_name.rpartition(".")
        module = module_path.rpartition(".")[2]
        module = next((role for path, role in _ENCODER_ROLES
                       if module_path == path or module_path.endswith("." + path)), module)
        hd = self.head_dim
        if module == "qkv_proj":
            (q0, qn), (k0, kn) = self.q_heads, self.kv_heads
            q_rows, kv_rows = self.num_heads * hd, self.num_kv_heads * hd
            return [(0, q0 * hd, qn * hd), (0, q_rows + k0 * hd, kn * hd),
                    (0, q_rows + kv_rows + k0 * hd, kn * hd)]
        if module == "gate_up_proj":
            start, size = self.intermediate
            return [(0, start, size), (0, self.intermediate_size + start, size)]
        if module == "q_proj":
            start, count = self.q_heads
            return 0, start * hd, count * hd
        if module in ("k_proj", "v_proj"):
            start, count = self.kv_heads
            return 0, start * hd, count * hd
        if module in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if leaf == "weight" and module == "o_proj":
            start, count = self.q_heads
            return 1, start * hd, count * hd
        if leaf == "weight" and module == "down_proj":
            return (1, *self.intermediate)
        if module in ("embed_tokens", "lm_head"):
            return (0, *self.vocab)
        return None


def kv_heads_per_rank(num_kv_heads: int, world: int) -> int:
    """The most KV heads any rank holds: what sizes a rank's cache (and the planner's)."""
    return max(1, -(-num_kv_heads // world))
