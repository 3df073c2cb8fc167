"""Steps of a random Qwen3-MoE-like model in float32 on CPU: the experts on `F.linear` over the
float weights (old) against the native packed GEMM (`SparseMoE.pack`, new), and how much of a
step is outside the GEMM and attention kernels, the most a one-call decoder stack could remove.

A random checkpoint (hidden 1024, 16 heads of 64 over 4 KV heads, `--experts` experts top-2
with `--inter` intermediate, `--layers` layers, all sparse) is saved with transformers into a
temporary folder and loaded with `load_model` (which packs the experts). The old path gets
float stacks unpacked from the panels, so both paths run the same weights in one process.
Timed: the model's forward of a decode step of 16 and of 64 sequences (prompts of 64-192
tokens) and of one 512-token prefill, the two paths alternating, `--rounds` each, per thread
count. Then one profiled step of each kind and path: every native call timed by kind (GEMM,
attention, other kernels: norms, RoPE, KV store) and the old path's `F.linear`; the rest of the
step is Python and torch's glue (routing, gathers, `index_add_`, dispatch).

    python bench/probes/moe_step.py [--threads 1,2] [--rounds 7] [--layers 6] [--experts 16]
        [--inter 768]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from engine.model_executor.model_loader import load_model  # noqa: E402
from engine.model_executor.models.moe import SparseMoE  # noqa: E402
from kernels.cpu_native import loader  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402

KINDS = (("decode 16", 16, 1), ("decode 64", 64, 1), ("prefill 512", 1, 512))


def build(folder: Path, layers: int, experts: int, inter: int) -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=inter, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    return model


class Paths:
    """Switch every sparse layer between its packed experts (new) and float stacks (old)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        assert all(m._gate_up_panels is not None for m in self.layers), "experts not packed"
        self.saved = []
        for m in self.layers:
            pairs = [m.expert_weights(e) for e in range(m.num_experts)]
            floats = [torch.stack([p[i] for p in pairs]) for i in (0, 1)]
            self.saved.append(((m._gate_up_panels, m._down_panels), floats))

    def use(self, name: str) -> None:
        for m, (panels, floats) in zip(self.layers, self.saved, strict=True):
            m.experts_gate_up, m.experts_down = (torch.nn.Parameter(f, requires_grad=False)
                                                 for f in floats)
            m._gate_up_panels, m._down_panels = panels if name == "new" else (None, None)


class Profile:
    """The loaded library with every call timed by kind, and `F.linear` timed as GEMM."""

    def __init__(self) -> None:
        self.lib = loader._lib
        self.spent: dict[str, float] = defaultdict(float)
        self.moe = [0.0, 0.0]  # the sparse layers' time: all of it, inside kernels
        self.in_moe = False

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.lib, name)
        kind = ("gemm" if "gemm" in name else "attention" if "paged" in name
                else "other kernels")

        def timed(*args: object) -> object:
            t0 = time.perf_counter()
            rc = fn(*args)
            self._add(kind, time.perf_counter() - t0)
            return rc
        return timed

    def __enter__(self) -> Profile:
        self.linear = torch.nn.functional.linear
        real = self.linear

        def linear(*args: object) -> torch.Tensor:
            t0 = time.perf_counter()
            out = real(*args)
            self._add("gemm", time.perf_counter() - t0)
            return out
        torch.nn.functional.linear = linear
        self.moe_forward = moe_forward = SparseMoE.forward

        def sparse(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
            self.in_moe, t0 = True, time.perf_counter()
            out = moe_forward(layer, x)
            self.moe[0] += time.perf_counter() - t0
            self.in_moe = False
            return out
        SparseMoE.forward = sparse
        loader._lib = self  # what load() returns from now on (gemm.py, ops.py, ...)
        return self

    def _add(self, kind: str, seconds: float) -> None:
        self.spent[kind] += seconds
        if self.in_moe:
            self.moe[1] += seconds

    def __exit__(self, *exc: object) -> None:
        loader._lib = self.lib
        torch.nn.functional.linear = self.linear
        SparseMoE.forward = self.moe_forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--inter", type=int, default=768)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe_step_") as tmp:
        model = build(Path(tmp), args.layers, args.experts, args.inter)
    assert isinstance(loader._lib, ctypes.CDLL)
    paths = Paths(model)
    sim = PagedSim(model, seed=0, num_blocks=2048, block_size=16)
    model.compute_logits = lambda hidden: hidden[-1:]  # time the decoder, not the LM head
    forward = model.forward

    def timed_forward(*a: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = forward(*a)
        sim.forward_s = time.perf_counter() - t0
        return out
    model.forward = timed_forward  # the step's model call alone, not PagedSim's bookkeeping
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 193, (64,), generator=gen).tolist()
    sim.step([(sid, torch.randint(5, 8000, (n,), generator=gen).tolist())
              for sid, n in enumerate(lens)])
    print(f"{args.layers} layers, {args.experts} experts top-2, inter {args.inter}, hidden "
          f"1024; loadavg {os.getloadavg()[0]:.2f}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for label, seqs, tokens in KINDS:
            measure(sim, paths, label, seqs, tokens, threads, args.rounds)


def step(sim: PagedSim, seqs: int, tokens: int) -> float:
    """One step's model forward time: a token for each of `seqs` sequences, or a fresh
    `tokens`-token prompt (its blocks freed after)."""
    gen = torch.Generator().manual_seed(len(sim.free))
    if tokens > 1:
        batch = [(1000, torch.randint(5, 8000, (tokens,), generator=gen).tolist())]
    else:
        batch = [(sid, [int(t)]) for sid, t in enumerate(torch.randint(5, 8000, (seqs,)))]
    sim.step(batch)
    spent = sim.forward_s
    if tokens > 1:
        sim.free += sim.tables.pop(1000)
        del sim.lens[1000]
    return spent


def measure(sim: PagedSim, paths: Paths, label: str, seqs: int, tokens: int, threads: int,
            rounds: int) -> None:
    """Interleaved old/new rounds, then one profiled step of each."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    for name in ("old", "new"):  # warm-up
        paths.use(name)
        step(sim, seqs, tokens)
    for _ in range(rounds):
        for name in ("old", "new"):
            paths.use(name)
            times[name].append(step(sim, seqs, tokens))
    best = {k: 1000 * min(v) for k, v in times.items()}
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"threads={threads} {label}: old median {med['old']:.1f} ms best {best['old']:.1f}; "
          f"new median {med['new']:.1f} best {best['new']:.1f}; old/new median "
          f"{med['old'] / med['new']:.2f} best {best['old'] / best['new']:.2f}")
    for name in ("old", "new"):
        paths.use(name)
        with Profile() as prof:
            total = step(sim, seqs, tokens)
        parts = dict(prof.spent)
        rest = total - sum(parts.values())
        shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(parts.items()))
        moe_glue = prof.moe[0] - prof.moe[1]
        print(f"    {name} profiled step {1000 * total:.1f} ms: {shares}, outside kernels "
              f"(Python + glue) {100 * rest / total:.0f}% = {1000 * rest:.2f} ms, of which in "
              f"the sparse layers {100 * moe_glue / total:.0f}% (sparse layers in all "
              f"{100 * prof.moe[0] / total:.0f}%)")


if __name__ == "__main__":
    main()
