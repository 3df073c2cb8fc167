"""What the soak watches on the server: the process (RSS, open file descriptors, threads, from
/proc) and the engine (/metrics: KV usage, running and waiting requests, a few counters).

Linux only (/proc). Why from outside: a leak must show where an operator would see it, in the
process's own figures and the metrics a dashboard reads.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:num_preemptions_total", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total")


def process_figures(pid: int | None) -> dict[str, float]:
    """RSS (MiB), peak RSS (MiB), open file descriptors and threads of one process ({} when
    there is no such process to read)."""
    try:
        return _process_figures(pid) if pid is not None else {}
    except (OSError, KeyError, ValueError):
        return {}


def _process_figures(pid: int) -> dict[str, float]:
    fields: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "hwm_mib": int(fields["VmHWM"].split()[0]) / 1024,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def parse_metrics(text: str, model: str) -> dict[str, float]:
    """The gauges and counters above for `model` (counters summed over their other labels)."""
    out: dict[str, float] = {}
    wanted = set(GAUGES) | set(COUNTERS)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted and s.labels.get("model_name") == model:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def scrape(session: aiohttp.ClientSession, base_url: str, model: str) -> dict[str, float]:
    """The metrics above; {} when the server does not answer (the checks then fail, since
    an absent gauge is not a zero)."""
    try:
        async with session.get(f"{base_url}/metrics",
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return parse_metrics(await resp.text(), model)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


def idle(metrics: dict[str, float]) -> bool:
    """No request running or waiting and no KV block held (prefix-cached free blocks do not
    count as used)."""
    return all(metrics.get(name, 1.0) == 0 for name in GAUGES)


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on a local TCP port (to watch a server we attach to);
    None when it is not ours to see."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(cols[9])
    targets = {f"socket:[{i}]" for i in inodes}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(f) in targets for f in (d / "fd").iterdir()):
                return int(d.name)
        except OSError:
            continue
    return None
