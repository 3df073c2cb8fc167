"""TLS of the HTTP server (kserve_paged/gateway.py's RestOptions on KServe's RESTServer): HTTPS
with the certificate and key, client certificates required with --ssl-ca-certs, and, with
--enable-ssl-refresh, KServe's refresher serving a replaced certificate to new connections.
A real uvicorn server on loopback, with a small app; the whole server over HTTPS is in
e2e/test_llmisvc_e2e.py."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from cryptography import x509
from fastapi import FastAPI
from kserve.model_repository import ModelRepository
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.model_repository_extension import ModelRepositoryExtension
from kserve.protocol.rest.server import RESTServer

from kserve_paged.gateway import RestOptions
from kserve_paged.testing import free_port
from tests.helpers.tls import CA, Issued


def _app() -> FastAPI:
    app = FastAPI()
    app.add_api_route("/hello", lambda: {"hello": "tls"}, methods=["GET"])
    return app


@contextmanager
def serving(issued: Issued, options: RestOptions) -> Iterator[tuple[RESTServer, int]]:
    """KServe's RESTServer with `options` applied, serving a small app in a thread."""
    port = free_port()
    registry = ModelRepository()
    rest = RESTServer("kserve.model_server:app", DataPlane(model_registry=registry),
                      ModelRepositoryExtension(model_registry=registry), port,
                      ssl_certfile=str(issued.cert), ssl_keyfile=str(issued.key))
    rest.config.app = _app()
    rest.config.host = "127.0.0.1"
    options.apply(rest)
    server = rest._server
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield rest, port
    finally:
        server.should_exit = True
        thread.join(10)


def _peer_serial(port: int, ca: CA) -> int:
    context = _context(ca, None)
    with (socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
          context.wrap_socket(raw, server_hostname="127.0.0.1") as tls):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_https_with_client_certificates_required(tmp_path):
    ca = CA(tmp_path / "ca")
    server_cert = ca.issue("server")
    client_cert = ca.issue("client", client=True)
    stranger = CA(tmp_path / "other", "other-ca").issue("stranger", client=True)
    options = RestOptions(ssl_ca_certs=str(ca.cert))
    with serving(server_cert, options) as (rest, port):
        assert type(rest._server) is uvicorn.Server  # no refresher without the flag
        url = f"https://127.0.0.1:{port}/hello"
        r = httpx.get(url, verify=_context(ca, client_cert))
        assert r.json() == {"hello": "tls"}
        for who in (None, stranger):
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.get(url, verify=_context(ca, who)).raise_for_status()
        with pytest.raises(httpx.ConnectError):  # plain HTTP clients do not see the server
            httpx.get(url, verify=True)


def _context(ca: CA, client: Issued | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def test_a_replaced_certificate_is_served_with_refresh_on(tmp_path):
    ca = CA(tmp_path / "ca")
    first, second = ca.issue("first"), ca.issue("second")
    live = Issued(tmp_path / "tls.crt", tmp_path / "tls.key", first.serial)
    shutil.copy(first.cert, live.cert)
    shutil.copy(first.key, live.key)
    with serving(live, RestOptions(ssl_refresh=True)) as (rest, port):
        assert type(rest._server) is not uvicorn.Server  # KServe's refreshing server
        assert _peer_serial(port, ca) == first.serial
        time.sleep(0.5)  # the watcher is up
        shutil.copy(second.key, live.key)
        shutil.copy(second.cert, live.cert)
        deadline = time.monotonic() + 20
        while _peer_serial(port, ca) != second.serial:
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.1)
