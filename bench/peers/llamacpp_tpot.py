"""llama.cpp's `llama-server` (built by bench/peers/setup_llamacpp.sh, outside the repository) as
a one-stream TPOT peer: one request at a time to its native `/completion` endpoint, the prompt
as token ids, greedy, ignore_eos, and the server's own decode timing
(`timings.predicted_per_token_ms`, the time per generated token after the first).

bench/probes/quant_tpot.py alternates it with our engine in one run (`--llamacpp`); alone:

    python bench/peers/llamacpp_tpot.py [--model FILE] [--threads 2] [--prompt 128] [--output 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: peers/llamacpp.py's imports
from peers.llamacpp import default_dir, installed  # noqa: E402

from kserve_paged.testing import ServerProcess, free_port  # noqa: E402

DIR = default_dir()  # one home for where the peer lives (compare.py's llama.cpp peer)


def available() -> bool:
    return installed(DIR) and (DIR / "smollm2-q4_1.gguf").is_file()


class LlamaServer:
    """`llama-server` on a free loopback port, one slot, `threads` threads; a context manager."""

    def __init__(self, model: Path | None = None, threads: int = 2, ctx: int = 1024) -> None:
        self.port = free_port()
        cmd = [str(DIR / "llama-server"), "-m", str(model or DIR / "smollm2-q4_1.gguf"),
               "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-c", str(ctx), "--parallel", "1"]
        env = {**os.environ, "LD_LIBRARY_PATH": str(DIR)}
        self.server = ServerProcess(cmd, [f"http://127.0.0.1:{self.port}/health"], env=env,
                                    timeout_s=300)

    def __enter__(self) -> LlamaServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def tpot_s(self, prompt: list[int], output: int) -> float:
        """One greedy request; the server's time per output token after the first."""
        body = json.dumps({"prompt": prompt, "n_predict": output, "ignore_eos": True,
                           "temperature": 0.0, "top_k": 1, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            timings = json.loads(resp.read())["timings"]
        return float(timings["predicted_per_token_ms"]) / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
    with LlamaServer(args.model, args.threads) as server:
        tpots = [server.tpot_s(prompt, args.output) * 1000 for _ in range(args.rounds)]
    print(json.dumps({"config": "llama.cpp", "tpot_ms_rounds": [round(t, 2) for t in tpots],
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
