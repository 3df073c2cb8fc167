"""CPU time (and wall time) of sentence-transformers' `encode` and our `LLM.embed` on
bench/embeddings.py's 256 sentences, interleaved in one process: on a shared machine the
process's CPU time says more than the wall clock about the work each side does (at 2 threads
it also counts OpenMP spinning). Environment: NT threads (default 1; set OMP_NUM_THREADS the
same), BUDGET max_num_batched_tokens (8192), REPS (2), TREE a source tree to import our engine
from instead of this one (a checkout of main, for a before/after).

    NT=1 OMP_NUM_THREADS=1 python bench/probes/embed_cpu_time.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib
from benchlib import source_roots  # noqa: E402

# The tree to measure (another checkout with TREE=...): its three source roots first on the path.
sys.path[:0] = source_roots(Path(os.environ.get("TREE", Path(__file__).resolve().parents[2])))

import torch  # noqa: E402


def measure(fn, reps: int) -> tuple[float, float]:
    """(CPU s, wall s) of the fastest of `reps` runs after one warm-up."""
    fn()
    runs = []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        runs.append((time.process_time() - c0, time.perf_counter() - w0))
    return min(runs)


def main() -> None:
    from sentence_transformers import SentenceTransformer

    from bench.embeddings import sentences
    from kserve_paged_engine import LLM
    from kserve_paged_engine.frontend.packaged_folders import ensure_folder_model

    torch.set_num_threads(int(os.environ.get("NT", "1")))
    folder = str(ensure_folder_model("all-minilm-l6-v2"))
    st = SentenceTransformer(folder, device="cpu")
    texts = sentences(st.tokenizer)
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_seqs=256,
              max_num_batched_tokens=int(os.environ.get("BUDGET", "8192")))
    reps = int(os.environ.get("REPS", "2"))
    sides = [("sentence-transformers", lambda: st.encode(texts, batch_size=32)),
             ("ours", lambda: llm.embed(texts))]
    for name, fn in sides * 2:
        cpu, wall = measure(fn, reps)
        print(f"{name}: cpu {cpu:.3f} s, wall {wall:.3f} s, load {os.getloadavg()[0]:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
