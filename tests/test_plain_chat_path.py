"""Issue 50, no detours on the server side: a feature's file is entered only when a request
uses it. A plain streamed chat (no tools, no logprobs, no structured output, a generating
model) never enters pooling.py, tools.py, structured.py or logprobs.py; a chat that uses them
does (so the probe itself can see them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.helpers.server import client, ready, run

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
CHAT = "/openai/v1/chat/completions"
FEATURES = {"kserve_paged/openai/pooling.py", "kserve_paged/openai/tools.py",
            "kserve_paged/structured.py", "kserve_paged/logprobs.py"}


def _entered(body: dict[str, Any]) -> set[str]:
    """The server files the request's code (on the event loop) enters."""
    entered: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:  # noqa: ARG001
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ROOT + "kserve_paged/"):
            entered.add(name[len(ROOT):])

    async def main() -> int:
        app, model, _ = await ready()
        try:
            async with client(app) as c:
                sys.setprofile(profile)
                try:
                    r = await c.post(CHAT, json=body)
                finally:
                    sys.setprofile(None)
        finally:
            model.stop_engine()
        return r.status_code
    assert run(main()) == 200
    return entered


def test_a_plain_streamed_chat_enters_no_feature_file():
    entered = _entered({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "stream": True})
    assert "kserve_paged/openai/chat.py" in entered  # the probe sees the route's files
    assert not entered & FEATURES


def test_a_chat_using_the_features_enters_their_files():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    entered = _entered({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "stream": True, "logprobs": True, "tools": [tool],
                        "tool_choice": "required"})
    assert {"kserve_paged/openai/tools.py", "kserve_paged/structured.py",
            "kserve_paged/logprobs.py"} <= entered
