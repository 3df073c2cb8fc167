"""kserve_paged.testing.ServerProcess, the launcher shared by the e2e tests and the benchmarks,
on a stand-in server: not ready, then ready; every answer recorded; the whole group stopped."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from kserve_paged.testing import ServerProcess, _group_pids, free_port

# Answers 503 to its first two GETs, then 200; with a second argument, starts a child that must
# be stopped with it.
_STANDIN = """
import http.server, subprocess, sys
if len(sys.argv) > 2:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
calls = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        calls.append(1)
        self.send_response(200 if len(calls) > 2 else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="process groups are read from /proc")
def test_launcher_waits_for_ready_records_answers_and_stops_the_group(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    srv = ServerProcess([sys.executable, "-c", _STANDIN, str(port), "with-child"],
                        [f"http://127.0.0.1:{port}/ready"], log_path=log, timeout_s=60,
                        poll_s=0.05)
    with srv:
        assert srv.time_to_ready_s is not None and srv.time_to_ready_s > 0
        codes = [code for _, code in srv.ready_history]
        assert codes[-1] == 200 and codes.count(503) == 2
        assert all(code in (0, 503) for code in codes[:-1])
        pgid = srv.proc.pid
    assert srv.proc.returncode is not None
    assert _group_pids(pgid) == []


def test_launcher_reports_a_server_that_exits_before_ready(tmp_path: Path) -> None:
    srv = ServerProcess([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
                        [f"http://127.0.0.1:{free_port()}/ready"], log_path=tmp_path / "log",
                        timeout_s=60, poll_s=0.05)
    with pytest.raises(RuntimeError, match="exited with 3"), srv:
        pass
    assert "bad flag" in srv.log()


def test_launcher_without_its_own_session_stays_in_the_callers_group(tmp_path: Path) -> None:
    """The e2e tests' servers: a signal to the test runner's group reaches them too."""
    port = free_port()
    srv = ServerProcess([sys.executable, "-c", _STANDIN, str(port)],
                        [f"http://127.0.0.1:{port}/ready"], log_path=tmp_path / "log",
                        timeout_s=60, poll_s=0.05, own_session=False)
    with srv:
        assert os.getpgid(srv.proc.pid) == os.getpgrp()
    assert srv.proc.returncode == -signal.SIGTERM
