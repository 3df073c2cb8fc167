"""The soak's verdicts, from what the client saw and what the monitor sampled (pure functions,
tested in tests/test_soak_checks.py).

Batch variance: the suite holds greedy float32 outputs to token-for-token equality with the
same request served alone or offline, whatever the batch, preemptions and speculation
(e2e/test_reliability_load.py, e2e/test_openai_options.py, BENCHMARKS.md's speculation note;
only log-probabilities get a tolerance, 2e-3, and the soak does not compare them). So a greedy
(or beam) answer under load must equal its answer alone exactly: the tolerance is zero.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from soak_client import CONN_ERROR, DISCONNECTED, FINISHED, REFUSED, TIMEOUT, Outcome
from soak_requests import REPORT

TOLERANCE = ("exact: greedy float32 text token for token, as the suite holds it "
             "(e2e/test_reliability_load.py, e2e/test_openai_options.py)")
RSS_GROWTH_LIMIT = 0.05
# Open files and threads the server may add after the reference phase without leaking: its
# thread pools (tokenization, JSON, grammar compiles) grow to their caps under concurrency.
FD_SLACK = 16
THREAD_SLACK = 16


def adapter_window(events: list[dict[str, Any]], name: str, t0: float, t1: float) -> str:
    """Whether adapter `name` was surely loaded ("loaded"), surely not ("unloaded") or either
    ("changing") from t0 to t1, from the cycler's events (see soak_adapters.cycle)."""
    calls = [e for e in events if e["name"] == name]
    for unload, load in zip(calls[::2], calls[1::2]):
        away_from, back_at = unload["sent"], load["done"]  # possibly not served in between
        if t1 < away_from or t0 > back_at:
            continue
        gone, back = unload["done"], load["sent"]  # surely not served in between
        if unload["status"] == 200 and gone <= t0 and t1 <= back:
            return "unloaded"
        return "changing"
    if len(calls) % 2 and t1 >= calls[-1]["sent"]:  # an unload with no load after it
        return "changing"
    return "loaded"


def expected_codes(o: Outcome, events: list[dict[str, Any]]) -> set[int]:
    """The status codes this request may get."""
    if o.adapter is None:
        return {o.expect}
    window = adapter_window(events, o.adapter, o.t_send, o.t_end)
    return {"loaded": {200}, "unloaded": {404}, "changing": {200, 404}}[window]


def judge(outcomes: list[Outcome], references: dict[str, list[str]],
          events: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and failures: every valid request finished, every invalid one got its code,
    greedy answers equal their answers alone (seeded sampled ones are only counted)."""
    failures, mismatches, seeded, compared = [], [], Counter(), 0
    for o in outcomes:
        ok_codes = expected_codes(o, events)
        if o.result == DISCONNECTED or (o.kind == "disconnect" and o.result == FINISHED):
            continue  # we closed it (or it finished before we did): its check is the drain
        if o.status not in ok_codes or (o.status == 200 and o.result != FINISHED):
            failures.append(_brief(o, f"expected {sorted(ok_codes)}"))
            continue
        if o.result != FINISHED or o.compare is None or o.ref_key not in references:
            continue
        want = references[o.ref_key] * o.ref_repeat
        compared += o.compare != REPORT
        if o.compare == REPORT:
            seeded["equal" if o.answer == want else "different"] += 1
        elif o.answer != want:
            mismatches.append({**_brief(o, "differs from the answer alone"),
                               "got": o.answer, "alone": want})
    return {"failures": failures, "mismatches": mismatches, "compared": compared,
            "seeded_vs_alone": dict(seeded),
            "prefix_cache": prefix_hits(outcomes), **counts(outcomes)}


def prefix_hits(outcomes: list[Outcome]) -> dict[str, int]:
    """Shared-prefix requests (those whose usage says) by how much of their prompt the prefix
    cache served: all that one of them ever got (`full`), less (`evicted`: its document's
    blocks had been evicted, since every document is sent alone before the load) or none."""
    seen = [o for o in outcomes if o.kind == "prefix" and o.cached_tokens is not None]
    best: dict[int, int] = {}
    for o in seen:
        best[o.variant] = max(best.get(o.variant, 0), o.cached_tokens or 0)
    full = sum(o.cached_tokens == best[o.variant] > 0 for o in seen)
    none = sum(o.cached_tokens == 0 for o in seen)
    return {"requests": len(seen), "full": full, "evicted": len(seen) - full - none,
            "none": none}


def counts(outcomes: list[Outcome]) -> dict[str, Any]:
    """The figures: sent, answered, refused by code, 5xx, timeouts, disconnects; by route."""
    by_route: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        by_route[o.route][o.result if o.result in (DISCONNECTED, TIMEOUT, CONN_ERROR)
                          else str(o.status)] += 1
    codes = Counter(o.status for o in outcomes if o.status is not None)
    return {
        "sent": len(outcomes),
        "answered": sum(o.result == FINISHED for o in outcomes),
        "refused_by_code": {str(c): n for c, n in sorted(codes.items()) if 400 <= c < 500},
        "server_errors_5xx": sum(n for c, n in codes.items() if c >= 500),
        "timeouts": sum(o.result == TIMEOUT for o in outcomes),
        "disconnected": sum(o.result == DISCONNECTED for o in outcomes),
        "refused": sum(o.result == REFUSED for o in outcomes),
        "by_route": {r: dict(c) for r, c in sorted(by_route.items())},
        "by_kind": dict(Counter(o.kind for o in outcomes)),
    }


def rss_growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Peak RSS after warm-up against RSS at the end of warm-up (the first sample taken at or
    after `warmup_s`); None when there are not two such samples."""
    after = [s for s in samples if s["t"] >= warmup_s and s.get("rss_mib") is not None]
    if len(after) < 2:
        return {"ok": None, "detail": f"fewer than 2 samples after {warmup_s:.0f} s of warm-up"}
    base = after[0]["rss_mib"]
    peak = max(s["rss_mib"] for s in after[1:])
    growth = (peak - base) / base
    return {"ok": growth < RSS_GROWTH_LIMIT, "baseline_mib": round(base, 1),
            "peak_mib": round(peak, 1), "last_mib": round(after[-1]["rss_mib"], 1),
            "growth": round(growth, 4),
            "detail": f"{base:.0f} -> peak {peak:.0f} MiB ({100 * growth:+.1f}%, limit "
                      f"{100 * RSS_GROWTH_LIMIT:.0f}%)"}


def leaks(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the server still holds once idle after the load, against idle before it."""
    found = {}
    for gauge in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                  "vllm:num_requests_waiting"):
        if after.get(gauge) != 0:  # absent: the server did not answer, nothing is known
            found[gauge] = after.get(gauge, "not measured")
    for name, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
        if name in before and name in after and after[name] - before[name] > slack:
            found[name] = after[name] - before[name]
    return {"ok": not found, "count": len(found), "found": found,
            "fds_delta": _delta(before, after, "fds"),
            "threads_delta": _delta(before, after, "threads")}


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float | None:
    return after[key] - before[key] if key in before and key in after else None


def _brief(o: Outcome, why: str) -> dict[str, Any]:
    return {"kind": o.kind, "variant": o.variant, "route": o.route, "stream": o.stream,
            "status": o.status, "result": o.result, "error": o.error, "why": why,
            "adapter": o.adapter, "seconds": round(o.t_end - o.t_send, 2)}
