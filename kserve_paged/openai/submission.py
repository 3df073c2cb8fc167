"""The OpenAI-shaped routes' one way to hand a request's prompts to the engine: every prompt's
options checked, then every prompt submitted (served.submit_all), a refusal a 400 in OpenAI's
error shape.

All or nothing: a prompt the engine refuses, or a client that leaves while the prompts are
still being submitted (its handler is cancelled: kserve_paged/middleware.py), aborts the
prompts already queued and the one being queued; nothing of the request is left running.
"""

from __future__ import annotations

from collections.abc import Sequence

from kserve_paged.openai.errors import APIError
from kserve_paged.request_options import OptionError, SamplingRequest
from kserve_paged.served import ServedModel, submit_all
from kserve_paged_engine.frontend.async_llm import RequestStream


async def submit_prompts(model: ServedModel, prompts: Sequence[list[int]],
                         options: SamplingRequest, *, kind: str, priority: int = 0,
                         cache_salt: str | None = None, deadline: float | None = None
                         ) -> list[RequestStream]:
    """Each prompt's stream, in order; APIError 400 for options or a prompt the engine
    refuses (RequestRefused, 429, and ModelNotReady pass through)."""
    try:
        _, streams = await submit_all(model, prompts, options, kind=kind, priority=priority,
                                      cache_salt=cache_salt, deadline=deadline)
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return streams
