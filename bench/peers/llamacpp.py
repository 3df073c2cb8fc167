"""llama.cpp's `llama-server` as a benchmark peer of bench/compare.py.

Installed outside the repository by `bash bench/peers/setup_llamacpp.sh` (built from the
llama.cpp source that the PyPI sdist of llama-cpp-python vendors), next to the GGUF files it
serves: the default model's own Q4_1 file and an F32 GGUF converted from our float32 folder.
Each compare.py dtype maps to the file a llama.cpp user would run for it; bfloat16 has none.

Its "offline" figure is W1/W2 sent all at once to the server's OpenAI completions route with one
`--parallel` slot per request (continuous batching over slots is how llama.cpp batches), so it
is a server figure by construction; ours and vLLM's offline figures go through their Python
APIs. Same prompts as token ids, greedy, EOS ignored, every request's own max_tokens.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from bench_serve import VLLM_ENDPOINT, run_benchmark
from benchlib import load_workload
from server_proc import ServerProcess, free_port

# compare.py's dtype -> the GGUF file llama.cpp serves for it (None: no counterpart).
GGUF_FOR_DTYPE = {"float32": "smollm2-f32.gguf", "bfloat16": None,
                  "default": "smollm2-q4_1.gguf", "gguf": "smollm2-q4_1.gguf"}
CTX_PER_SLOT = 2048  # compare.py's MAX_MODEL_LEN: each slot holds one whole request
ENDPOINT = VLLM_ENDPOINT  # llama-server serves OpenAI's /v1/completions


def default_dir() -> Path:
    root = os.environ.get("KSERVE_PAGED_PEERS") or Path.home() / ".cache/kserve-paged/peers"
    return Path(root) / "llamacpp"


def installed(peer_dir: Path) -> bool:
    return (peer_dir / "llama-server").is_file()


def gguf_for(peer_dir: Path, dtype: str) -> Path | None:
    """The GGUF llama.cpp runs at `dtype`, or None when there is none (or it was not made)."""
    name = GGUF_FOR_DTYPE.get(dtype)
    path = peer_dir / name if name else None
    return path if path is not None and path.is_file() else None


def env(peer_dir: Path) -> dict[str, str]:
    """Our environment with the peer's shared libraries found."""
    out = dict(os.environ)
    out["LD_LIBRARY_PATH"] = ":".join(p for p in (str(peer_dir), out.get("LD_LIBRARY_PATH"))
                                      if p)
    return out


def server_spec(peer_dir: Path, gguf: Path, port: int, served_name: str, slots: int,
                threads: int) -> tuple[list[str], list[str], str]:
    """(command, readiness URLs, completions endpoint), as compare.server_spec returns."""
    cmd = [str(peer_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--alias", served_name, "--threads", str(threads),
           "--parallel", str(slots), "--ctx-size", str(slots * CTX_PER_SLOT)]
    base = f"http://127.0.0.1:{port}"
    # /health answers 503 while the model loads and 200 once requests are served.
    return cmd, [f"{base}/health"], ENDPOINT


def offline(peer_dir: Path, gguf: Path, workload: str, num_prompts: int | None,
            max_tokens: int | None, served_name: str, threads: int, log_path: Path,
            ready_timeout: float) -> dict:
    """A workload sent all at once, one slot per request; shaped like bench_offline's JSON."""
    reqs = load_workload(workload, num_prompts, max_tokens)
    port = free_port()
    cmd, ready, endpoint = server_spec(peer_dir, gguf, port, served_name, len(reqs), threads)
    with ServerProcess(cmd, ready, env=env(peer_dir), timeout_s=ready_timeout,
                       log_path=log_path) as srv:
        res = asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", endpoint, served_name,
                                        reqs, request_rate=float("inf"), progress=False,
                                        label=f"llamacpp offline {workload}",
                                        keep_alive=False))
        init = srv.time_to_ready_s
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed: {res['errors']}")
    if res["output_tokens"] != res["requested_output_tokens"]:
        raise RuntimeError(f"{res['output_tokens']} output tokens, "
                           f"{res['requested_output_tokens']} asked: EOS was not ignored")
    run = {"rep": 0, "seconds": res["duration_s"], "output_tokens": res["output_tokens"],
           "prompt_tokens": res["prompt_tokens"], "output_tok_s": res["output_throughput"],
           "total_tok_s": res["total_token_throughput"]}
    return {"engine": "llamacpp", "workload": workload, "num_prompts": len(reqs),
            "gguf": gguf.name, "slots": len(reqs), "threads": threads, "init_seconds": init,
            "runs": [run]}
