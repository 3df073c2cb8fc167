"""Soak: a stated time (default 60 minutes) of every kind of request against one server, then
checks that nothing was lost, nothing hung and nothing leaked (issue 37, part 4).

The mix (bench/soak_requests.py, seeded): completions and chat, streamed and not, n > 1,
beam search, json_schema outputs, tools (required, named), long shared prefixes on a small KV
pool (prefix hits under eviction, preemptions), repetitive prompts for the n-gram speculation,
the v2 route, two LoRA adapters unloaded and loaded again while requests use them, clients
that disconnect mid-stream or stop waiting, and invalid requests that must be 4xx.

Every `--sample-s` (30 s) it records the server's RSS, open fds, threads (/proc/PID), KV
usage, running and waiting requests (/metrics) and per-route answers by status code. At the end:
every valid request finished (no 5xx, no timeout), greedy answers equal the same requests'
answers alone (sent one at a time before the load), KV usage and running back to zero, RSS
grew less than 5% after warm-up, no fds or threads left behind. Exit status 1 when a check
fails, 2 when the setup does.

    python bench/soak.py --minutes 60 --out bench/runs/2026-12-02-soak   # starts the server
    python bench/soak.py --url http://127.0.0.1:8080 --minutes 10        # one already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_report  # noqa: E402
from soak_run import SoakSettings, run_soak, say  # noqa: E402

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
               "prompt_lookup_min": 2}
ENGINE_FLAGS = {"max_model_len": 512, "block_size": 16, "num_kv_blocks": 64,
                "max_loras": 2, "max_lora_rank": 8}


def server_command(model: str, port: int, adapters_dir: Path) -> list[str]:
    """Our server on loopback with everything the mix needs: speculation, LoRA with runtime
    updates (from ``adapters_dir``, under --out: the one --lora_roots entry), a KV pool too
    small to keep every shared prefix cached."""
    cmd = [sys.executable, "-m", "kserve_paged", "--model_name", model,
           "--http_host", "127.0.0.1", "--http_port", str(port), "--enable_grpc", "false",
           "--speculative_config", json.dumps(SPECULATIVE), "--enable_lora_runtime_updates",
           "--lora_roots", str(adapters_dir.resolve())]
    for name, value in ENGINE_FLAGS.items():
        cmd += [f"--{name}", str(value)]
    return cmd


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the load phase")
    ap.add_argument("--out", default=None, help="folder for soak.json (and the server log)")
    ap.add_argument("--url", default=None, help="attach to this server instead of starting one")
    ap.add_argument("--pid", type=int, default=None,
                    help="with --url: the server's pid (default: whoever listens on its port)")
    ap.add_argument("--model", default="smol", help="the served model's name")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    ap.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="load seconds before the RSS baseline (default: a quarter of the "
                         "run, at most 300)")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="client timeout per request: a request past it counts as hung")
    ap.add_argument("--drain-timeout", type=float, default=120.0,
                    help="seconds the server gets to be idle after the load")
    ap.add_argument("--lora-period-s", type=float, default=20.0,
                    help="seconds between adapter unload/load cycles")
    ap.add_argument("--lora-gap-s", type=float, default=4.0,
                    help="seconds an adapter stays unloaded in a cycle")
    ap.add_argument("--no-lora", action="store_true", help="leave the adapters out")
    ap.add_argument("--variants", type=int, default=None,
                    help="at most N variants of each compared kind (a shorter reference "
                         "phase; default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = min(300.0, args.minutes * 60 / 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or f"bench/runs/{time.strftime('%Y-%m-%d')}-soak")
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops our server on the way out
    settings = SoakSettings(
        model=args.model, minutes=args.minutes, concurrency=args.concurrency,
        sample_s=args.sample_s, warmup_s=args.warmup_s, request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout, lora=not args.no_lora,
        lora_period_s=args.lora_period_s, lora_gap_s=args.lora_gap_s, seed=args.seed,
        adapters_dir=out / "adapters", variants=args.variants)
    if args.url:
        from soak_monitor import listening_pid

        pid = args.pid or listening_pid(urlparse(args.url).port or 80)
        report = asyncio.run(run_soak(settings, args.url.rstrip("/"), pid))
        report["server"] = {"url": args.url, "pid": pid, "started_by_soak": False}
    else:
        report = run_with_own_server(settings, out)
    report["command"] = " ".join(["python", "bench/soak.py", *(argv or sys.argv[1:])])
    report["machine"] = soak_report.machine()
    verdicts = soak_report.verdicts(report)
    report["verdicts"] = verdicts
    (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    print(soak_report.summary(report))
    print(f"JSON: {out / 'soak.json'}")
    if report.get("setup_error"):
        return 2
    return 0 if all(v["ok"] is not False for v in verdicts.values()) else 1


def run_with_own_server(settings: SoakSettings, out: Path) -> dict[str, Any]:
    from soak_adapters import make_adapters

    from kserve_paged.testing import ServerProcess, free_port
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    base = Path(ensure_default_model(progress=lambda _: None))
    port = free_port()
    settings.adapters_dir.mkdir(parents=True, exist_ok=True)
    cmd = server_command(settings.model, port, settings.adapters_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(cmd, [f"{url}/v2/models/{settings.model}/ready"], env=env,
                           log_path=out / "server.log", timeout_s=600)
    try:
        with ThreadPoolExecutor(1) as pool:  # the adapters are made while the server loads
            adapters = pool.submit(make_adapters, base, settings.adapters_dir) \
                if settings.lora else None
            server.start()
            if adapters is not None:
                adapters.result()
    except (RuntimeError, TimeoutError) as exc:  # the server did not come up
        server.stop()
        return {"settings": {"minutes": settings.minutes, "concurrency": settings.concurrency},
                "setup_error": str(exc)[:2000], "server": {"command": cmd}}
    assert server.proc is not None
    say(f"server ready after {server.time_to_ready_s:.0f} s (pid {server.proc.pid})")
    try:
        report = asyncio.run(run_soak(settings, url, server.proc.pid))
    finally:
        server.stop()
    report["server"] = {"command": cmd, "pid": server.proc.pid, "started_by_soak": True,
                        "time_to_ready_s": round(server.time_to_ready_s or 0, 1)}
    report["server"]["exit_code"] = server.proc.returncode
    report["server"]["log_tracebacks"] = server.log().count("Traceback (most recent call last)")
    return report


if __name__ == "__main__":
    sys.exit(main())
