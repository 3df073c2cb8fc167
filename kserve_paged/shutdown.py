"""Graceful shutdown: on SIGTERM, drain before KServe's ModelServer stops."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

from kserve import ModelServer

from kserve_paged.model import PagedLLMModel

logger = logging.getLogger("kserve.paged")


class PagedModelServer(ModelServer):
    """KServe's ModelServer with a bind address and a graceful drain on SIGTERM.

    What KServe 0.21 does alone: uvicorn's own signal handler (installed while it serves)
    closes the listening socket at once, waits up to ``grace_period`` for open requests, then
    re-raises the signal to KServe's handler, which stops gRPC and unloads the models. So new
    requests meet a refused connection while readiness never turned false, and Kubernetes may
    still route to the pod. Here the first SIGTERM/SIGINT starts a drain instead: readiness
    turns false and new requests get 503 while the socket stays open; in-flight requests get
    ``shutdown_grace_s`` to finish (then they are aborted); only then does uvicorn's shutdown
    (and KServe's after it) run, and the process exits 0. A second signal skips the drain."""

    def __init__(self, *, http_host: str, shutdown_grace_s: float,
                 models: list[PagedLLMModel], rest_options: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.http_host = http_host
        self.rest_options = rest_options  # gateway.RestOptions: mTLS, refresh, access log
        self.shutdown_grace_s = shutdown_grace_s
        self._models = models
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        rest = self._rest_server
        if rest is not None:
            rest.config.host = self.http_host
            if self.rest_options is not None:
                self.rest_options.apply(rest)
            uvicorn_server = rest._server
            exit_now = uvicorn_server.handle_exit
            # uvicorn installs ``self.handle_exit`` as its signal handler when it starts serving;
            # the instance attribute takes precedence over the method.
            uvicorn_server.handle_exit = lambda sig, frame: self._on_signal(sig, frame, exit_now)
        await super()._serve()

    def _on_signal(self, sig: int, frame: FrameType | None, exit_now: Any) -> None:
        if self._draining or self._loop is None:
            exit_now(sig, frame)
            return
        self._draining = True
        logger.info("received %s: draining (readiness false, new requests 503, up to %.0fs for "
                    "%d request(s) in flight)", signal.Signals(sig).name, self.shutdown_grace_s,
                    sum(m.llm.num_unfinished for m in self._models))
        for model in self._models:
            model.begin_drain()
        self._loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._drain_then_exit(sig, frame, exit_now)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None, exit_now: Any) -> None:
        deadline = time.monotonic() + self.shutdown_grace_s
        while (any(m.llm.num_unfinished for m in self._models)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        left = sum(m.llm.num_unfinished for m in self._models)
        if left:
            logger.warning("grace period over: aborting %d request(s) still in flight", left)
            for model in self._models:
                await asyncio.to_thread(model.llm.shutdown, 5.0)
        else:
            logger.info("drained: no request in flight")
        exit_now(sig, frame)
