"""KEDA's scaling rule against a load trace (issue 24): does the replica count follow the load?

A second-by-second simulation of what a GPU deployment would do under tests/data/load_trace.json:
Poisson arrivals, a queue in front of the replicas (the gateway spreads requests evenly), each
replica serving up to the planner's batch at once for the planner's per-request time, new
replicas ready only after the model loads. The autoscaler is KEDA's Prometheus trigger under
the HPA as KServe sets them up: Prometheus scrapes every 15 s, the HPA syncs every 15 s and asks
ceil(query / target) replicas (KEDA's AverageValue metric), ignores changes within its 10 %
tolerance, scales up at once (at most doubling, or +4, per sync) and down only to the highest
recommendation of the last 600 s (the overlay's stabilization window).

Finding: on the queue depth alone (vllm:num_requests_waiting) the count does not follow the
load: whenever capacity suffices the queue is empty, so every window the HPA drops to
minReplicas, the queue then builds while new replicas load, and it overshoots to maxReplicas.
On requests in flight (running + waiting), with the target the planner prints (80 % of a
replica's batch), it follows the load. The GPU overlay scales on the latter.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from kserve_paged.plan import Plan, keda_target, make_plan, parse_device
from kserve_paged_engine.model_executor.model_facts import describe_folder
from tests.helpers import manifests as h
from tests.helpers import monitoring_checks as mon

DATA = Path(__file__).parent / "data"
TRACE = json.loads((DATA / "load_trace.json").read_text())["rows"]


@dataclass(slots=True)
class Autoscaler:
    query: str  # "waiting" or "in_flight" (running + waiting)
    target: float
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: int = 180  # pod start to Ready: image cached, weights loaded
    scrape_s: int = 15
    sync_s: int = 15
    down_window_s: int = 600
    tolerance: float = 0.1


@dataclass(slots=True)
class Minute:
    rate: float
    needed: int  # replicas the load needs at full batch
    replicas: int  # replicas asked for at the end of the minute
    ready: int  # of which serving
    waiting: int


def rates_per_second() -> list[float]:
    rates: list[float] = []
    for start, rate in TRACE:
        assert start == len(rates)
        rates += [rate] * 60
    return rates


def simulate(scaler: Autoscaler, capacity: int, service_s: float,
             seed: int = 0) -> tuple[list[Minute], list[int]]:
    """Per-minute state and every request's queue wait in seconds."""
    rng = random.Random(seed)
    pods = [0] * scaler.min_replicas  # the second each pod turns ready
    queue: list[int] = []  # arrival seconds, FIFO
    finishing: list[float] = []  # heap of finish times of requests in flight
    waits: list[int] = []
    recommendations: list[tuple[int, int]] = []
    minutes: list[Minute] = []
    metric = 0
    rates = rates_per_second()
    for t, rate in enumerate(rates):
        arrivals, p, floor = 0, rng.random(), math.exp(-rate)  # Poisson(rate) by products
        while p > floor:
            arrivals += 1
            p *= rng.random()
        queue += [t] * arrivals
        while finishing and finishing[0] <= t:
            heapq.heappop(finishing)
        ready = sum(1 for r in pods if r <= t)
        while queue and len(finishing) < ready * capacity:
            waits.append(t - queue.pop(0))
            heapq.heappush(finishing, t + service_s)
        if t % scaler.scrape_s == 0:
            metric = len(queue) + (len(finishing) if scaler.query == "in_flight" else 0)
        if t % scaler.sync_s == 0:
            current = len(pods)
            wanted = math.ceil(metric / scaler.target)
            if abs(metric / (scaler.target * current) - 1) <= scaler.tolerance:
                wanted = current
            wanted = max(scaler.min_replicas, min(scaler.max_replicas, wanted))
            recommendations = [(s, r) for s, r in recommendations
                               if s > t - scaler.down_window_s] + [(t, wanted)]
            if wanted > current:
                new = min(wanted, max(2 * current, current + 4))
                pods += [t + scaler.startup_s] * (new - current)
            else:
                new = min(current, max(r for _, r in recommendations))
                pods = sorted(pods)[:new]  # the newest (maybe not ready) go first
        if t % 60 == 59:
            minutes.append(Minute(rate, math.ceil(rate * service_s / capacity), len(pods),
                                  sum(1 for r in pods if r <= t), len(queue)))
    return minutes, waits


@pytest.fixture(scope="module")
def plan() -> Plan:
    """Llama-3-8B on one L4: a small replica, so the trace needs several."""
    shape = describe_folder(DATA / "models" / "llama-3-8b")
    return make_plan(shape, parse_device("l4"), max_model_len=4096, workload=(512, 128))


def replica_model(plan: Plan) -> tuple[int, float]:
    """Requests in flight per replica and seconds per request at that batch (planner figures)."""
    return plan.batch, plan.prefill_seconds + plan.workload[1] * plan.decode_step_seconds(
        plan.batch)


def following(minutes: list[Minute], lag: int = 5) -> float:
    """Correlation of serving replicas with the replicas the load needed ``lag`` minutes before."""
    return correlation([m.ready for m in minutes[lag:]], [m.needed for m in minutes[:-lag]])


def p95(values: list[int]) -> int:
    return sorted(values)[int(0.95 * len(values))]


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def test_the_trace_needs_several_replicas(plan):
    capacity, service_s = replica_model(plan)
    needed = [math.ceil(rate * service_s / capacity) for _, rate in TRACE]
    assert min(needed) == 1 and max(needed) >= 4


def test_in_flight_rule_with_the_planners_target_follows_the_load(plan):
    capacity, service_s = replica_model(plan)
    minutes, waits = simulate(Autoscaler("in_flight", keda_target(plan)), capacity, service_s)
    # Serving replicas against what the load needed 5 minutes earlier (a new replica needs 3
    # to load; the 10-minute scale-down window keeps replicas after a drop, by design).
    assert following(minutes) > 0.8
    plateau = minutes[35:55]  # 18 requests/s, steady
    assert all(m.needed <= m.ready <= m.needed + 2 for m in plateau), plateau
    assert all(m.ready == 1 for m in minutes[-5:])  # night: back to minReplicas
    assert p95(waits) <= 30, "requests queue for long: replicas come too late"


def test_queue_depth_alone_swings_between_min_and_max(plan):
    """The rule the GPU overlay used before (waiting requests, target 4): the count does not
    follow the load, and requests wait minutes while the replicas it dropped reload."""
    capacity, service_s = replica_model(plan)
    minutes, waits = simulate(Autoscaler("waiting", 4), capacity, service_s)
    plateau = [m.ready for m in minutes[30:60]]
    assert min(plateau) == 1 and max(plateau) == 8
    assert max(m.waiting for m in minutes[30:60]) > 1000
    assert p95(waits) > 60
    assert following(minutes) < 0.7


def test_the_gpu_overlays_scale_on_requests_in_flight():
    """Every KEDA-scaled overlay (one GPU, and tensor-parallel over several)."""
    keda = [o for _, o in h.all_objects() if o["kind"] == "InferenceService"
            and o["metadata"]["annotations"].get("serving.kserve.io/autoscalerClass") == "keda"]
    assert len(keda) >= 2
    for isvc in keda:
        (metric,) = isvc["spec"]["predictor"]["autoScaling"]["metrics"]
        query = metric["external"]["metric"]["query"]
        assert mon.promql_metric_names(query) == {"vllm:num_requests_running",
                                                "vllm:num_requests_waiting"}
        # Its target is the planner's rule for the overlay's own batch (--max_num_seqs).
        args = isvc["spec"]["predictor"]["model"]["args"]
        (seqs,) = [int(a.split("=")[1]) for a in args if a.startswith("--max_num_seqs=")]
        assert int(metric["external"]["target"]["value"]) == int(0.8 * seqs)
