"""One step's inputs as two broadcasts: a fixed header of sizes, then one int64 payload with
every flat tensor laid end to end (token ids, positions, slot mapping, block tables, sequence
lengths, query offsets, logits rows, attention rows, prompt rows, block copies, then each
further KV group's slot mapping and block tables).

Two broadcasts a step, whatever the number of layers; the workers rebuild `StepInputs` from
them and run the same `ModelRunner.forward` as rank 0.
"""

from __future__ import annotations

import torch

from kserve_paged_engine.model_executor.attention import AttentionMetadata, GroupedMetadata
from kserve_paged_engine.worker.model_runner import StepInputs

HEADER_LEN = 12
# Commands, the header's first entry.
STEP, LOAD, CACHE, RELEASE, STOP = 1, 2, 3, 4, 5
# A STEP header's entry that is 1 when an object message follows the payload (LoRA adapters,
# KV-tier copies: worker/tp_extras.py).
EXTRA = 10
# A STEP header's entry: the KV groups past the first (Gemma's sliding layers,
# engine/kserve_paged_engine/core/kv_groups.py), each a slot mapping and block tables at the payload's end.
GROUPS = 11


def header(command: int, *fields: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.long)
    out[0] = command
    out[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.long)
    return out.to(device)


def pack(inputs: StepInputs, block_copies: list[tuple[int, int]], device: torch.device
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a prepared step, on the collectives' device."""
    meta = inputs.meta
    num_tokens = inputs.input_ids.shape[0]
    num_seqs, max_blocks = meta.block_tables.shape
    has_rows = meta.row_lens is not None
    parts = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.block_tables.reshape(-1),
             meta.seq_lens, meta.query_start_loc, inputs.logits_indices]
    if has_rows:
        parts += [meta.row_lens, meta.row_seq_idx]
    extra = list(inputs.prompt_rows) + [s for s, _ in block_copies] + [d for _, d in block_copies]
    groups = getattr(meta, "groups", None) or []
    parts.append(torch.tensor(extra, dtype=torch.long))
    for g in groups:
        parts += [g.slot_mapping, g.block_tables.reshape(-1)]
    parts = [p.to(device=device, dtype=torch.long) for p in parts]
    head = header(STEP, num_tokens, num_seqs, max_blocks, inputs.logits_indices.shape[0],
                  len(inputs.prompt_rows), len(block_copies), meta.max_seq_len,
                  meta.max_query_len, int(has_rows), device=device)
    head[GROUPS] = len(groups)
    return head, torch.cat(parts)


def payload_len(head: list[int]) -> int:
    _, tokens, seqs, max_blocks, sample, prompt, copies, _, _, has_rows = head[:10]
    return ((3 * tokens + seqs * max_blocks + 2 * seqs + 1 + sample + 2 * tokens * has_rows
             + prompt + 2 * copies) + head[GROUPS] * (tokens + seqs * max_blocks))


def unpack(head: list[int], payload: torch.Tensor, device: torch.device, backend: str
           ) -> tuple[StepInputs, list[tuple[int, int]]]:
    """The step `pack` sent, on this rank's model device."""
    _, tokens, seqs, max_blocks, sample, prompt, copies, max_seq, max_query, has_rows = head[:10]
    sizes = [tokens, tokens, tokens, seqs * max_blocks, seqs, seqs + 1, sample]
    if has_rows:
        sizes += [tokens, tokens]
    sizes += [prompt, copies, copies]
    sizes += [tokens, seqs * max_blocks] * head[GROUPS]
    cut = list(payload.to(device).split(sizes))
    ids, positions, slots, tables, seq_lens, qsl, logits_rows = cut[:7]
    i32 = torch.int32
    meta = (GroupedMetadata if head[GROUPS] else AttentionMetadata)(
        slot_mapping=slots, block_tables=tables.to(i32).view(seqs, max_blocks),
        seq_lens=seq_lens.to(i32), query_start_loc=qsl.to(i32), max_seq_len=max_seq,
        max_query_len=max_query, backend=backend)
    if has_rows:
        meta.row_lens, meta.row_seq_idx = cut[7].to(i32), cut[8]
    end = 9 if has_rows else 7
    prompt_rows, src, dst = cut[end:end + 3]
    group_parts = cut[end + 3:]
    if isinstance(meta, GroupedMetadata):  # each further group: the same step, its tables
        meta.groups = [AttentionMetadata(
            slot_mapping=g_slots, block_tables=g_tables.to(i32).view(seqs, max_blocks),
            seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc, max_seq_len=max_seq,
            max_query_len=max_query, row_lens=meta.row_lens, row_seq_idx=meta.row_seq_idx,
            backend=backend) for g_slots, g_tables in zip(group_parts[::2], group_parts[1::2],
                                                          strict=True)]
    inputs = StepInputs(input_ids=ids, positions=positions, meta=meta, logits_indices=logits_rows,
                        sampling=[], prompt_spans=[], prompt_rows=prompt_rows.tolist())
    return inputs, list(zip(src.tolist(), dst.tolist(), strict=True))
