"""The project files one streamed chat completion enters, followed through every thread it
touches (the event loop's, the engine's) with `sys.setprofile`.

tests/test_docs.py holds docs/architecture.md's trace against it; `python
scripts/request_files.py` prints it (docs/contributing.md).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

from tests.helpers.server import NAME, build, client

REPO = Path(__file__).resolve().parents[2]
CODE = ("engine/", "kernels/", "kserve_paged/")
SETTINGS = {"max_model_len": 512, "num_kv_blocks": 64, "max_num_batched_tokens": 256}


def default_config() -> Any:
    """What `python -m kserve_paged` serves with no flags: the default model, 4-bit from its
    GGUF, at the server's default options (sized down to the trace's one short request)."""
    from kserve_paged.args import engine_kwargs, parse_args
    from kserve_paged_engine.config.engine import EngineConfig

    return EngineConfig(model=None, **{**engine_kwargs(parse_args([])), **SETTINGS})


def float32_config() -> Any:
    """The default model's dense folder in float32 (`--dtype float32`, no quantization)."""
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.default_model import ensure_default_model

    path = str(ensure_default_model(progress=lambda _: None))
    return EngineConfig(model=path, dtype="float32", **SETTINGS)


def _profile(entered: set[str], threads: set[int]):
    """Records the project files entered on the request's threads: the event loop's, the
    engine's (`threads`) and the loop's worker threads (asyncio.to_thread: template rendering,
    tokenizing). Background work that happens to run meanwhile (a grammar compiler's spare
    process starting, say) is not the request's."""
    root = str(REPO) + "/"

    def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and name[len(root):].startswith(CODE) and (
                    threading.get_ident() in threads
                    or threading.current_thread().name.startswith("asyncio")):
                entered.add(name[len(root):])
    return profile


def streamed_chat_files(config: Any) -> tuple[set[str], str]:
    """The files a streamed chat completion enters once the engine is up, and the body."""
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    app, model = build(factory=lambda: LLMEngine(config))
    entered: set[str] = set()
    threads = {threading.get_ident()}
    profile = _profile(entered, threads)

    async def main() -> str:
        await model.start_engine()
        threads.add(await model.llm.call_engine(lambda _: threading.get_ident()))
        await model.llm.call_engine(lambda _: sys.setprofile(profile))
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            async with client(app) as c:
                r = await c.post("/openai/v1/chat/completions", json={
                    "model": NAME, "messages": [{"role": "user", "content": "Hi!"}],
                    "max_tokens": 4, "stream": True})
                await asyncio.sleep(0)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            await model.llm.call_engine(lambda _: sys.setprofile(None))
            model.stop_engine()
        return r.text

    body = asyncio.run(asyncio.wait_for(main(), 600))  # loading the model takes a while
    return entered, body
