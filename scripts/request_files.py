"""Print the project files one streamed chat completion enters, on the default settings (the
default model served 4-bit from its GGUF) and on its dense folder in float32.

    python scripts/request_files.py [default|float32 ...]

docs/architecture.md names each of them in its trace; tests/test_docs.py holds the two together
and the count at its cap.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.request_trace import default_config, float32_config, streamed_chat_files  # noqa: E402

CONFIGS = {"default": default_config, "float32": float32_config}


def main(names: list[str]) -> int:
    for name in names or list(CONFIGS):
        files, _ = streamed_chat_files(CONFIGS[name]())
        python = sum(f.endswith(".py") for f in files)
        print(f"{name}: {len(files)} files ({python} Python)")
        for f in sorted(files):
            print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
