"""bench/compare.py's report: the results as one table (ours against each peer, per workload
and figure) and as plots."""

from __future__ import annotations

from pathlib import Path

from benchlib import ratio

US = "kserve-paged"


def log(msg: str) -> None:
    print(f"[compare] {msg}", flush=True)


def median_run(res: dict) -> dict:
    """The run with the median output rate (the lower one of two), so one lucky or unlucky
    repeat does not decide."""
    runs = sorted(res["runs"], key=lambda r: r["output_tok_s"])
    return runs[(len(runs) - 1) // 2]


def rows(results: dict) -> list[tuple[str, str, dict[str, float | None]]]:
    """(metric, 'higher'|'lower' is better, {engine: value}) for everything measured."""
    out = []
    for wl, by in results["offline"].items():
        for key, name in (("output_tok_s", "output tok/s"), ("total_tok_s", "total tok/s")):
            out.append((f"offline {wl}: {name}", "higher",
                        {e: median_run(r)[key] for e, r in by.items()}))
    for wl, by in results["serve"].items():
        out.append((f"serve {wl}: output tok/s", "higher",
                    {e: r["output_throughput"] for e, r in by.items()}))
        out.append((f"serve {wl}: req/s", "higher",
                    {e: r["request_throughput"] for e, r in by.items()}))
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for p in ("p50", "p99"):
                out.append((f"serve {wl}: {m[:-3].upper()} {p} ms", "lower",
                            {e: r[m][p] for e, r in by.items()}))
    for dtype, by in results["ready"].items():
        out.append((f"time to ready s ({dtype})", "lower",
                    {e: r["seconds"] for e, r in by.items()}))
    return out


def table(results: dict, peers: list[str]) -> tuple[str, list[dict]]:
    """A plain-text table of values and ours/peer ratios, and the same as JSON rows."""
    def fmt(v: float | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    head = ["metric", "better", US]
    for p in peers:
        head += [p, f"us/{p}"]
    lines, data = [head], []
    for metric, better, vals in rows(results):
        ours = vals.get(US)
        line = [metric, better, fmt(ours)]
        rec = {"metric": metric, "better": better, US: ours, "ratios": {}}
        for p in peers:
            r = ratio(ours, vals.get(p))
            line += [fmt(vals.get(p)), fmt(r, 2)]
            rec[p] = vals.get(p)
            rec["ratios"][p] = r
        lines.append(line)
        data.append(rec)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in lines)
    return text, data


def plot(results: dict, out_prefix: Path) -> list[str]:
    """Throughput bars and latency CDFs; nothing (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install -e '.[bench]'): no plots")
        return []
    written = []
    groups: list[tuple[str, dict[str, float]]] = []
    for wl, by in results["offline"].items():
        groups.append((f"offline {wl}", {e: median_run(r)["output_tok_s"] for e, r in by.items()}))
    for wl, by in results["serve"].items():
        groups.append((f"serve {wl}", {e: r["output_throughput"] or 0 for e, r in by.items()}))
    if groups:
        engines = sorted({e for _, g in groups for e in g}, key=lambda e: (e != US, e))
        width = 0.8 / len(engines)
        fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
        for i, e in enumerate(engines):
            # Only where the engine took part (no transformers server: no bar, not a 0).
            pts = [(g + (i - (len(engines) - 1) / 2) * width, vals[e])
                   for g, (_, vals) in enumerate(groups) if e in vals]
            bars = ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=e)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(groups)), [name for name, _ in groups])
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput (same run, same machine)")
        ax.legend()
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + "-throughput.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    if results["serve"]:
        metrics = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
        wls = list(results["serve"])
        fig, axes = plt.subplots(len(wls), len(metrics), figsize=(16, 3.6 * len(wls)),
                                 squeeze=False)
        for r, wl in enumerate(wls):
            for c, m in enumerate(metrics):
                ax = axes[r][c]
                for e, res in results["serve"][wl].items():
                    xs = sorted(res["samples"][m])
                    if xs:
                        ys = [(i + 1) / len(xs) for i in range(len(xs))]
                        ax.step(xs, ys, where="post", label=e)
                ax.set_xlabel(f"{m[:-3].upper()} (ms)")
                ax.set_ylabel("fraction of requests" if m != "itl_ms" else "fraction of gaps")
                ax.set_title(f"serve {wl}: {m[:-3].upper()}")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + "-latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
