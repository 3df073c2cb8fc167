"""``python -m kserve_paged``: KServe's model server with the paged-attention engine."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Console-script entry (``kserve-paged``); see kserve_paged.server.

    The tcmalloc re-exec comes first and kserve_paged_engine.worker.cpu_memory imports nothing heavy, so the
    process re-executes before torch (or anything else that allocates much) is loaded.
    ``kserve-paged plan ...`` is the capacity planner instead (kserve_paged/plan_cli.py)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["plan"]:
        from kserve_paged.plan_cli import main as plan_main

        return plan_main(args[1:])
    if argv is None:
        from kserve_paged_engine.worker.cpu_memory import reexec_with_tcmalloc

        reexec_with_tcmalloc()  # returns only when tcmalloc is absent, disabled or loaded
    from kserve_paged_engine.frontend.installation import check_or_exit

    check_or_exit()  # a broken environment in words, before transformers can fail inside
    from kserve_paged.server import main as serve_main

    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
