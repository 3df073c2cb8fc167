"""``python -m kserve_paged``: KServe's model server with the paged-attention engine."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Console-script entry (``kserve-paged``); see kserve_paged.server."""
    from kserve_paged.server import main as serve_main

    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
