"""Steps of a random Qwen3-MoE-like model in float32 on CPU: the experts on `F.linear` over the
float weights (old) against the native packed GEMM (`SparseMoE.pack`, new), and how much of a
step is outside the GEMM and attention kernels, the most a one-call decoder stack could remove.

A random checkpoint (hidden 1024, 16 heads of 64 over 4 KV heads, `--experts` experts top-2
with `--inter` intermediate, `--layers` layers, all sparse) is saved with transformers into a
temporary folder and loaded with `load_model` (which packs the experts). The old path is
`SparseMoE.forward` as it was before (`old_forward`, a copy) over float stacks unpacked from
the panels, so both paths run the same weights in one process.
Timed, per thread count: one sparse layer alone at 16, 64 and 512 rows, the paths alternating,
and the same with the GEMMs stubbed (`Stubbed`: the layer's glue alone, routing real); then the
model's forward of a decode step of 16 and of 64 sequences (prompts of 64-192 tokens) and of one
512-token prefill, the paths alternating, `--rounds` each, and the fastest of 3 profiled steps
of each kind and path: every native call timed by kind (GEMM, attention, other kernels: norms,
RoPE, KV store) and `F.linear`; the rest of the step, less the profiler's own cost per call
(`calibrate`), is Python and torch's glue (routing, gathers, `index_add_`, dispatch).

    python bench/probes/moe_step.py [--threads 1,2] [--rounds 11] [--layers 6] [--experts 16]
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from kserve_paged_engine.model_executor.model_loader import load_model  # noqa: E402
from kserve_paged_engine.model_executor.models.moe import SparseMoE  # noqa: E402
from kserve_paged_kernels.cpu_native import loader  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402

# old: the loop as it was (old_forward) on F.linear; torch: today's loop on F.linear; new:
# today's loop on the native GEMM.
PATHS = ("old", "torch", "new")
OVERHEAD = 0.0  # seconds the profiler adds to a native call (`calibrate`)
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
        SparseMoE.forward = old_forward if name == "old" else NEW_FORWARD
        for m, (panels, floats) in zip(self.layers, self.saved, strict=True):
            m.experts_gate_up, m.experts_down = (torch.nn.Parameter(f, requires_grad=False)
                                                 for f in floats)
            m._gate_up_panels, m._down_panels = panels if name == "new" else (None, None)


NEW_FORWARD = SparseMoE.forward


def old_forward(self: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """`SparseMoE.forward` before the native experts (main at 30fed6c): per expert a gather,
    `F.linear` over the float stacks, a weighted `index_add_`."""
    probs = torch.softmax(self.gate(x).float(), dim=-1)
    weights, experts = torch.topk(probs, self.top_k, dim=-1)
    if self.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // self.top_k
        gate, up = F.linear(x[tokens], self.experts_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, self.experts_down[e])
        out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(out.dtype))
    return out


class Profile:
    """The loaded library with every call timed by kind, and `F.linear` timed as GEMM."""

    def __init__(self) -> None:
        self.lib = loader._lib
        self.spent: dict[str, float] = defaultdict(float)
        self.moe = [0.0, 0.0]  # the sparse layers' time: all of it, inside kernels
        self.calls = [0, 0]  # timed calls: all, in the sparse layers
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
        self.calls[0] += 1
        if self.in_moe:
            self.moe[1] += seconds
            self.calls[1] += 1

    def __exit__(self, *exc: object) -> None:
        loader._lib = self.lib
        torch.nn.functional.linear = self.linear
        SparseMoE.forward = self.moe_forward


def calibrate() -> float:
    """Seconds the profiler adds to one native call: its wrapper around a trivial call
    (`kp_gemm_panel`) against the call alone, best of 5 x 2000; subtracted from the glue."""
    lib, prof = loader._lib, Profile()

    def per_call(owner: object) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                owner.kp_gemm_panel()
            best = min(best, (time.perf_counter() - t0) / 2000)
        return best
    return max(0.0, per_call(prof) - per_call(lib))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=11)
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
    global OVERHEAD
    OVERHEAD = calibrate()
    print(f"the profiler adds {1e6 * OVERHEAD:.2f} us to a native call (subtracted)")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (16, 64, 512):
            measure_layer(paths, rows, threads, 5 * args.rounds)
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
    """Interleaved rounds of each path, then the fastest of 3 profiled steps of each."""
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    for name in PATHS:  # warm-up
        paths.use(name)
        step(sim, seqs, tokens)
    for _ in range(rounds):
        for name in PATHS:
            paths.use(name)
            times[name].append(step(sim, seqs, tokens))
    best = {k: 1000 * min(v) for k, v in times.items()}
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"threads={threads} {label}: " + "; ".join(
        f"{k} median {med[k]:.1f} ms best {best[k]:.1f}" for k in PATHS) + "; old/new median "
        f"{med['old'] / med['new']:.2f} best {best['old'] / best['new']:.2f}")
    for name in PATHS:
        paths.use(name)
        runs = []
        for _ in range(3):
            with Profile() as prof:
                runs.append((step(sim, seqs, tokens), prof))
        total, prof = min(runs, key=lambda r: r[0])
        rest = total - sum(prof.spent.values()) - prof.calls[0] * OVERHEAD
        shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(prof.spent.items()))
        moe_glue = prof.moe[0] - prof.moe[1] - prof.calls[1] * OVERHEAD
        print(f"    {name:5s} profiled {1000 * total:.1f} ms: {shares}; outside kernels "
              f"{100 * rest / total:.0f}% = {1000 * rest:.2f} ms, in the sparse layers "
              f"{100 * moe_glue / total:.0f}% (the sparse layers in all "
              f"{100 * prof.moe[0] / total:.0f}%)")


class Stubbed:
    """The expert GEMMs as no-ops (the native ones return at once, `F.linear` only allocates)
    and the router's logits computed once: a sparse layer's Python and torch glue alone."""

    def __init__(self, layer: SparseMoE, x: torch.Tensor) -> None:
        self.layer, self.logits, self.lib = layer, layer.gate(x), loader._lib

    def __getattr__(self, name: str) -> object:
        if "gemm" in name and name != "kp_gemm_panel":
            return lambda *args: 0
        return getattr(self.lib, name)

    def __enter__(self) -> Stubbed:
        self.linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda a, w, b=None: a.new_empty(a.shape[0], w.shape[0])
        self.layer.gate.forward = lambda x: self.logits
        loader._lib = self
        return self

    def __exit__(self, *exc: object) -> None:
        loader._lib = self.lib
        torch.nn.functional.linear = self.linear
        del self.layer.gate.forward


def measure_layer(paths: Paths, rows: int, threads: int, calls: int) -> None:
    """One sparse layer's forward alone over `rows` random rows, `calls` per path interleaved:
    the best call of each, and the best with the kernels stubbed (`Stubbed`): its glue."""
    layer = paths.layers[0]
    x = torch.randn(rows, layer.hidden_size, generator=torch.Generator().manual_seed(rows))
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    with torch.inference_mode():
        for i in range(calls + 1):
            for name in PATHS:
                paths.use(name)
                t0 = time.perf_counter()
                layer(x)
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        glue: dict[str, list[float]] = {name: [] for name in PATHS}
        with Stubbed(layer, x):
            for _ in range(calls):
                for name in PATHS:
                    paths.use(name)
                    t0 = time.perf_counter()
                    layer(x)
                    glue[name].append(time.perf_counter() - t0)
    print(f"threads={threads} one sparse layer, {rows} rows, best: " + "; ".join(
        f"{k} {1e3 * min(v):.2f} ms (glue alone {1e3 * min(glue[k]):.2f}, "
        f"{100 * min(glue[k]) / min(v):.0f}%)" for k, v in times.items()))


if __name__ == "__main__":
    main()
