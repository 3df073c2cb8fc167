"""OpenAI-compatible routes (``/openai/v1/...``) on KServe's FastAPI app.

KServe 0.21's own OpenAI routes need vLLM installed (docs/kserve.md), so these are ours. One job per
module: ``errors`` (OpenAI's error shape), ``schemas`` (request/response bodies, the refusal
rules of their fields, and a request's JSON read into one), ``completions``, ``chat`` and
``responses`` (the routes; ``chat_turn`` the chat turn they share, from messages to the
template's conversation and the engine's streams; ``responses_convert`` /
``responses_stream`` the Responses API's shapes), ``render``
(engine outputs -> response pieces), ``stream`` (server-sent events, client disconnects),
``tools`` (tool calls), ``reasoning`` (reasoning parsers), ``turn`` (a streamed turn as
reasoning, answer and tool-call pieces),
``handlers`` (which model a request names; the routes, which kserve_paged/routes.py
registers), ``openapi`` (what
/openapi.json publishes), ``pooling`` and ``pooling_schemas`` (embeddings, rerank, score,
classify: a pooling model's routes and their bodies).

Imported as ``kserve_paged.openai``: inside it, ``import openai`` (absolute) is still the
``openai`` client package whose types the responses use.
"""

from __future__ import annotations

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.handlers import PREFIX, OpenAIRoutes, register_openai_routes

__all__ = ["APIError", "OpenAIRoutes", "PREFIX", "register_openai_routes"]
