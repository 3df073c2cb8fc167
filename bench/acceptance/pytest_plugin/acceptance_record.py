"""pytest plugin of the acceptance run's pytest stages (bench/acceptance/kernel_tests.py loads it
with `-p acceptance_record`): this shard's share of the collected tests, and each test's start
and outcome appended to a JSON-lines file as it happens.

Why a file written per test: a shard killed at its stage's limit has already recorded what
passed and which test it was in (pytest's own reports are written at the end). Why shards of
one collection rather than pytest-xdist: the image may not have xdist, and a plain process per
shard needs nothing but pytest. Tests of a file listed with `--acceptance-whole` stay in one
shard (a module-scoped fixture that computes every test's result at once would run in each).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

_record: list[Path] = []  # the file of this process's records, once configured


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("acceptance", "bench/gpu_acceptance.py's pytest stages")
    group.addoption("--acceptance-record", default=None,
                    help="append each test's start and outcome to this JSON-lines file")
    group.addoption("--acceptance-shard", default="0/1",
                    help="K/N: run the K-th of N shares of the collected tests")
    group.addoption("--acceptance-whole", action="append", default=[],
                    help="a test file whose tests stay in one shard (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("acceptance_record")
    if path:
        _record[:] = [Path(path)]


def _append(**fields: object) -> None:
    if _record:
        with _record[0].open("a") as f:
            f.write(json.dumps(fields) + "\n")


def shard_of(nodeids: list[str], whole: set[str], shards: int) -> list[int]:
    """Each test's shard: round robin over units in collection order, where a unit is one test,
    or all tests of a file in `whole`."""
    units: dict[str, int] = {}
    out = []
    for nodeid in nodeids:
        path = nodeid.split("::")[0]
        unit = units.setdefault(path if path in whole else nodeid, len(units))
        out.append(unit % shards)
    return out


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected theirs: shares of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    k, n = (int(x) for x in config.getoption("acceptance_shard").split("/"))
    if n <= 1:
        return
    whole = set(config.getoption("acceptance_whole"))
    shards = shard_of([item.nodeid for item in items], whole, n)
    keep = [item for item, s in zip(items, shards) if s == k]
    drop = [item for item, s in zip(items, shards) if s != k]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _append(test=nodeid, outcome="running", at=round(time.time(), 1))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One record per test: the call's outcome, or a setup/teardown that did not pass."""
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        fields: dict[str, object] = {"test": report.nodeid, "outcome": outcome,
                                     "seconds": round(report.duration, 2), "when": report.when}
        if report.failed:
            fields["why"] = report.longreprtext[-800:]
        elif report.skipped and isinstance(report.longrepr, tuple):
            fields["why"] = str(report.longrepr[2])[:300]
        _append(**fields)
