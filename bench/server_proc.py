"""Launch a server command, time it to ready, and stop it (with all its children) afterwards.

The launcher itself is `kserve_paged.testing.ServerProcess` (shared with the e2e tests); this is
its command line:

    python bench/server_proc.py --ready /v2/models/smol/ready -- \
        .venv/bin/python -m kserve_paged --model_name smol --http_port {port}

`{port}` in the command is replaced by a free loopback port.
"""

from __future__ import annotations

import argparse
import sys

from kserve_paged.testing import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time a server command to ready, then stop it.")
    ap.add_argument("--ready", action="append", required=True,
                    help="readiness path (or full URL); repeat for several, checked in order")
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--log", default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the server command after --")
    port = args.port or free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    urls = [u if "://" in u else f"http://127.0.0.1:{port}{u}" for u in args.ready]
    with ServerProcess(cmd, urls, log_path=args.log, timeout_s=args.timeout) as srv:
        print(f"ready after {srv.time_to_ready_s:.2f} s (port {port})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
