"""`--disable-access-log-for-endpoints`: probe and scrape paths kept out of the access log.

Kubelet probes `/health` every few seconds and Prometheus scrapes `/metrics`: logged, they bury
the requests worth reading. uvicorn writes one record per request on the `uvicorn.access`
logger with the path (and query) as its third argument; this filter drops the records of the
listed paths.
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"


def parse_paths(text: str) -> frozenset[str]:
    """`/health,/metrics,/ping` -> the set of paths; blanks ignored."""
    return frozenset(p.strip() for p in text.split(",") if p.strip())


class SkipPaths(logging.Filter):
    """Drops access records whose path (without the query) is one of `paths`."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def skip_access_log(paths: frozenset[str]) -> SkipPaths | None:
    """Install the filter on uvicorn's access logger (None when no path is given)."""
    if not paths:
        return None
    skip = SkipPaths(paths)
    logging.getLogger(ACCESS_LOGGER).addFilter(skip)
    return skip
