"""The soak's verdicts from its raw report, and the summary it prints.

A verdict is {"ok": True | False | None, "detail": ...}; None means not measured (e.g. no
pid to watch when attached to a remote server), which fails nothing but says so.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Any

import soak_checks
from soak_requests import WEIGHTS


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "loadavg_end": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%d %H:%M",
                                                                      time.gmtime())}


def verdicts(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if report.get("setup_error"):
        return {"setup": {"ok": False, "detail": report["setup_error"]}}
    j = report["judged"]
    settings = report["settings"]
    out = {
        "all_valid_finished": {
            "ok": not j["failures"],
            "detail": f"{len(j['failures'])} requests without their expected answer "
                      f"(5xx {j['server_errors_5xx']}, timeouts {j['timeouts']})"},
        "greedy_equal_alone": {
            "ok": not j["mismatches"],
            "detail": f"{len(j['mismatches'])} of {j['compared']} greedy/beam answers differ "
                      f"from alone "
                      f"({report['tolerance']})"},
        "drained": {
            "ok": report["drain"]["ok"],
            "detail": f"idle after {report['drain']['seconds']} s: kv "
                      f"{report['drain'].get('vllm:kv_cache_usage_perc')}, running "
                      f"{report['drain'].get('vllm:num_requests_running')}, waiting "
                      f"{report['drain'].get('vllm:num_requests_waiting')}"},
        "rss_growth": soak_checks.rss_growth(
            [s for s in report["samples"] if "rss_mib" in s], settings["warmup_s"]),
    }
    leak = soak_checks.leaks(report["idle_before"], report["idle_after"])
    out["no_leaks"] = {**leak, "detail": f"{leak['count']} found {leak['found']}; fds "
                                         f"{leak['fds_delta']:+}, threads "
                                         f"{leak['threads_delta']:+} (idle after vs before)"
                       if leak["fds_delta"] is not None else f"{leak['count']} found"}
    out["mix_covered"] = coverage(report)
    return out


def coverage(report: dict[str, Any]) -> dict[str, Any]:
    """The soak tested what it says: every kind sent, and during the load speculation
    drafted, prefixes hit and were evicted, clients disconnected, adapters cycled."""
    settings = report["settings"]
    j = report["judged"]
    wanted = set(WEIGHTS) - (set() if settings["lora"] else {"lora"})
    missing = sorted(wanted - set(j["by_kind"]))
    during = [s for s in report["samples"] if "vllm:prefix_cache_hits_total" in s]
    for name, what in (("vllm:spec_decode_num_drafts_total", "speculative drafts"),
                       ("vllm:prefix_cache_hits_total", "prefix-cache hits")):
        if not during or during[-1][name] - during[0][name] <= 0:  # during the load
            missing.append(what)
    if j["prefix_cache"]["evicted"] + j["prefix_cache"]["none"] == 0:
        missing.append("a shared prefix evicted")
    if j["disconnected"] == 0:
        missing.append("disconnects")
    if settings["lora"] and not report["adapter_events"]:
        missing.append("adapter unload/load cycles")
    return {"ok": not missing, "detail": f"missing: {missing}" if missing else "every part"}


def summary(report: dict[str, Any]) -> str:
    lines = [f"soak: {report['settings']['minutes']} min, {report['settings']['concurrency']} "
             f"clients, machine {report['machine']['cpu']} x{report['machine']['cores']}"]
    if report.get("setup_error"):
        return "\n".join([*lines, f"SETUP FAILED: {report['setup_error']}"])
    j = report["judged"]
    lines += [f"sent {j['sent']}, answered {j['answered']}, refused by code "
              f"{j['refused_by_code']}, 5xx {j['server_errors_5xx']}, timeouts "
              f"{j['timeouts']}, disconnected on purpose {j['disconnected']}",
              f"by kind: {j['by_kind']}",
              f"seeded sampled vs alone (reported, not judged): {j['seeded_vs_alone']}",
              f"shared-prefix requests by cache hit: {j['prefix_cache']}",
              f"adapter cycles: {len(report['adapter_events']) // 2}"]
    last = report["samples"][-1]
    lines.append("samples (t s: rss MiB, fds, threads, kv, running, waiting):")
    for s in report["samples"]:
        lines.append(f"  {s['t']:>7}: {s.get('rss_mib', 0):7.1f} {s.get('fds', '-'):>4} "
                     f"{s.get('threads', '-'):>4} {s.get('vllm:kv_cache_usage_perc', '-')!s:>6} "
                     f"{s.get('vllm:num_requests_running', '-')!s:>4} "
                     f"{s.get('vllm:num_requests_waiting', '-')!s:>4} [{s['phase']}]")
    lines.append(f"counters: { {k: v for k, v in last.items() if k.endswith('_total')} }")
    for name, v in report["verdicts"].items():
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[v["ok"]]
        lines.append(f"{mark} {name}: {v['detail']}")
    for f in j["failures"][:5] + j["mismatches"][:5]:
        lines.append(f"  {f}")
    return "\n".join(lines)
