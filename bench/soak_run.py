"""The soak's phases against a server that is up: adapters, the references alone, the load
with its samples, the drain. Returns the raw report; soak_report judges it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import soak_checks
import soak_monitor
import soak_requests
from soak_adapters import cycle, load_spec, make_adapters, unload_spec
from soak_client import FINISHED, Outcome, send


@dataclass
class SoakSettings:
    model: str
    minutes: float
    concurrency: int
    sample_s: float
    warmup_s: float
    request_timeout: float
    drain_timeout: float
    lora: bool
    lora_period_s: float
    lora_gap_s: float
    seed: int
    adapters_dir: Path
    variants: int | None = None  # cap on the compared kinds' variants (soak_requests.variants)

    @property
    def kinds(self) -> set[str]:
        kinds = set(soak_requests.WEIGHTS)
        return kinds if self.lora else kinds - {"lora"}


def say(line: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {line}", flush=True)


def session(concurrency: int) -> aiohttp.ClientSession:
    # No session-wide timeout: each request has its own (soak_client.send).
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def run_soak(s: SoakSettings, url: str, pid: int | None) -> dict[str, Any]:
    report: dict[str, Any] = {"settings": {**asdict(s), "adapters_dir": str(s.adapters_dir)},
                              "tolerance": soak_checks.TOLERANCE}
    paths = {}
    if s.lora:
        from kserve_paged_engine.frontend.default_model import ensure_default_model

        base = Path(ensure_default_model(progress=lambda _: None))
        paths = await asyncio.to_thread(make_adapters, base, s.adapters_dir)
    async with session(s.concurrency) as client:
        error = await prepare(client, url, paths, s.request_timeout)
        if error:
            return {**report, "setup_error": error}
        started = time.monotonic()
        refs, preflight = await references(client, url, s)
        say(f"references: {len(preflight)} requests alone in "
            f"{time.monotonic() - started:.0f} s; load for {s.minutes} min")
        report["references"], report["preflight"] = refs, preflight
        bad = [p for p in preflight if not p["ok"]]
        if bad:
            return {**report, "setup_error": f"{len(bad)} requests failed alone: {bad[:3]}"}
    report["idle_before"] = await idle_figures(url, s.model, pid, s.concurrency)
    outcomes, events, samples = [], [], []
    t0 = time.monotonic()
    async with session(s.concurrency) as client:
        stop_at = t0 + s.minutes * 60
        sampler = asyncio.ensure_future(sample_loop(client, url, s, pid, t0, outcomes, samples))
        specs = soak_requests.mix(s.model, s.seed, s.kinds, s.variants)
        tasks = [worker(client, url, s, specs, stop_at, outcomes) for _ in range(s.concurrency)]
        if s.lora:
            tasks.append(cycle(client, url, paths, stop_at, s.lora_period_s, s.lora_gap_s,
                               s.request_timeout, outcomes, events))
        await asyncio.gather(*tasks)
        report["load_seconds"] = round(time.monotonic() - t0, 1)
        say(f"load done after {report['load_seconds']} s, {len(outcomes)} requests; draining")
        report["drain"] = await drain(client, url, s)
        sampler.cancel()
        samples.append(await sample(client, url, s.model, pid, t0, outcomes, "drained"))
    report["idle_after"] = await idle_figures(url, s.model, pid, s.concurrency)
    samples.append({**report["idle_after"], "t": round(time.monotonic() - t0, 1),
                    "phase": "idle"})
    report.update(samples=samples, adapter_events=[{**e, "sent": round(e["sent"] - t0, 2),
                                                    "done": round(e["done"] - t0, 2)}
                                                   for e in events])
    report["judged"] = soak_checks.judge(outcomes, refs, events)
    return report


async def prepare(client: aiohttp.ClientSession, url: str, paths: dict[str, Path],
                  timeout_s: float) -> str | None:
    """Both adapters loaded (unloaded first, so a second soak on one server starts clean)."""
    for name, path in paths.items():
        await send(client, url, unload_spec(name), timeout_s)
        out = await send(client, url, load_spec(name, path), timeout_s)
        if out.status != 200:
            return f"loading adapter {name} from {path}: {out.status} {out.error}"
    return None


async def references(client: aiohttp.ClientSession, url: str, s: SoakSettings
                     ) -> tuple[dict[str, list[str]], list[dict[str, Any]]]:
    """Each compared request alone, one at a time, and each invalid request alone (its code
    checked before the load, so a wrong expectation fails here and says so)."""
    refs, preflight = {}, []
    specs = soak_requests.reference_specs(s.model, s.kinds, s.variants)
    for spec in specs + soak_requests.invalid_specs(s.model, s.lora):
        out = await send(client, url, spec, s.request_timeout)
        ok = out.status == spec.expect and (spec.expect != 200 or out.result == FINISHED)
        if ok and spec.compare:
            refs[spec.ref_key] = out.answer
        preflight.append({"key": f"{spec.kind}/{spec.variant}", "route": spec.route,
                          "status": out.status, "expect": spec.expect, "ok": ok,
                          "seconds": round(out.t_end - out.t_send, 2),
                          **({} if ok else {"error": out.error,
                                            "body": soak_requests.describe_body(spec)})})
    return refs, preflight


async def worker(client: aiohttp.ClientSession, url: str, s: SoakSettings,
                 specs: Iterator[soak_requests.Spec], stop_at: float,
                 outcomes: list[Outcome]) -> None:
    """One client: the next request of the shared mix as soon as its last one is answered."""
    while time.monotonic() < stop_at:
        outcomes.append(await send(client, url, next(specs), s.request_timeout))


async def sample(client: aiohttp.ClientSession, url: str, model: str, pid: int | None,
                 t0: float, outcomes: list[Outcome], phase: str) -> dict[str, Any]:
    row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1), "phase": phase}
    row.update(soak_monitor.process_figures(pid))
    row.update(await soak_monitor.scrape(client, url, model))
    c = soak_checks.counts(list(outcomes))
    row.update(sent=c["sent"], answered=c["answered"], by_route=c["by_route"])
    return row


async def sample_loop(client: aiohttp.ClientSession, url: str, s: SoakSettings,
                      pid: int | None, t0: float, outcomes: list[Outcome],
                      samples: list[dict[str, Any]]) -> None:
    while True:
        row = await sample(client, url, s.model, pid, t0, outcomes, "load")
        samples.append(row)
        say(f"t={row['t']:.0f}s sent {row['sent']} answered {row['answered']} rss "
            f"{row.get('rss_mib', 0):.0f} MiB fds {row.get('fds')} threads {row.get('threads')} "
            f"kv {row.get('vllm:kv_cache_usage_perc', -1):.2f} running "
            f"{row.get('vllm:num_requests_running')} waiting "
            f"{row.get('vllm:num_requests_waiting')}")
        await asyncio.sleep(s.sample_s)


async def drain(client: aiohttp.ClientSession, url: str, s: SoakSettings) -> dict[str, Any]:
    """Wait for no running or waiting request and no KV block held."""
    start = time.monotonic()
    metrics: dict[str, float] = {}
    while time.monotonic() - start < s.drain_timeout:
        metrics = await soak_monitor.scrape(client, url, s.model)
        if soak_monitor.idle(metrics):
            return {"ok": True, "seconds": round(time.monotonic() - start, 2), **metrics}
        await asyncio.sleep(0.5)
    return {"ok": False, "seconds": round(time.monotonic() - start, 2), **metrics}


async def idle_figures(url: str, model: str, pid: int | None,
                       concurrency: int) -> dict[str, Any]:
    """The server's figures once our connections are closed (they hold fds of its own)."""
    await asyncio.sleep(2.0)
    async with session(concurrency) as client:
        metrics = await soak_monitor.scrape(client, url, model)
    await asyncio.sleep(1.0)
    return {**metrics, **soak_monitor.process_figures(pid)}
