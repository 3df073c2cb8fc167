"""The e2e fixtures: one real server process on the default model per session, and the offline
engine with the same options as the reference; every test here is marked `e2e` (the helpers
are tests/helpers/e2e_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.e2e_server import ENGINE_OPTS, Server, running_server

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with running_server(["--enable_grpc", "true"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine with the server's options: the reference for greedy outputs."""
    from kserve_paged_engine import LLM

    return LLM(**ENGINE_OPTS)
