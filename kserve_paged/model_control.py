"""Model control apart from inference: KServe's model repository routes
(``POST /v2/repository/models/{name}/load`` and ``/unload``, gRPC's RepositoryModelLoad and
RepositoryModelUnload).

Why: KServe answers them for whoever may infer, and unloading the served model stops its
engine until the pod restarts (readiness 404, every inference 503): anyone holding the
inference key (anyone at all without ``--api-key``) could stop the server for everyone. Here
they are off unless ``--model_control_key`` (or ``$KSERVE_PAGED_MODEL_CONTROL_KEY``,
gateway.py) gives them a credential of their own:

- off (the default): 403 on HTTP and PERMISSION_DENIED on gRPC, whatever key is sent;
- on: HTTP only (the gateway refuses the key with gRPC on: KServe's gRPC server has no
  authentication), with ``Authorization: Bearer <model control key>``; the inference key is
  not it (401), and the inference key is not asked for besides. Unloading an adapter's name
  unloads that adapter, as ``/unload_lora_adapter`` does; unloading the model or one of its
  served names stops its engine until a restart, as KServe's does.

The HTTP guard is a middleware outside every other (auth.py's included), matching the path
prefix, so the routes KServe registers later are guarded without being named; the repository
extension of the server (:class:`ModelControl`) refuses too, for gRPC and as a second lock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from grpc_interceptor.exceptions import PermissionDenied
from kserve.model_repository import ModelRepository
from kserve.protocol.model_repository_extension import ModelRepositoryExtension

from kserve_paged.auth import GRANTED, bearer_token, key_matches, send_refusal
from kserve_paged.model import PagedLLMModel

CONTROL_PREFIX = "/v2/repository"
_OFF = ("model control (KServe's /v2/repository load and unload) is off: start the server "
        "with --model_control_key (or $KSERVE_PAGED_MODEL_CONTROL_KEY) to turn it on")
_WRONG_KEY = ("missing or wrong model control key: send it as 'Authorization: Bearer <key>' "
              "(the inference key is not it)")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def is_control_path(path: str) -> bool:
    """A route of KServe's model repository extension (any present or future one)."""
    return path == CONTROL_PREFIX or path.startswith(CONTROL_PREFIX + "/")


class ModelControlOff(PermissionDenied):
    """Model control is off (403 on HTTP, PERMISSION_DENIED on gRPC)."""

    def __str__(self) -> str:
        return self.details


async def model_control_off_route(request: Request, exc: ModelControlOff) -> Response:
    return JSONResponse(status_code=403, content={"error": str(exc)})


class ModelControl(ModelRepositoryExtension):
    """KServe's repository extension, on only with a model control key; an adapter's name
    unloads the adapter (the engine keeps serving)."""

    def __init__(self, registry: ModelRepository, model: PagedLLMModel | None, *,
                 enabled: bool) -> None:
        super().__init__(model_registry=registry)
        self.model = model
        self.enabled = enabled

    def _check(self) -> None:
        if not self.enabled:
            raise ModelControlOff(_OFF)

    async def load(self, model_name: str) -> None:
        self._check()
        await super().load(model_name)

    async def unload(self, model_name: str) -> None:
        self._check()
        if self.model is not None and model_name in self.model.loras:
            await self.model.unload_lora(model_name)
            return
        await super().unload(model_name)


class ModelControlMiddleware:
    """ASGI middleware: the repository routes answer only to the model control key (403
    while there is none), and the requests it lets in pass auth.py's guard (``GRANTED``)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        if key is not None and not key:
            raise ValueError("an empty model control key would let everyone in")
        self.app = app
        self._key = key.encode() if key is not None else None

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not is_control_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._key is None:
            await send_refusal(send, 403, {"error": _OFF})
            return
        if not key_matches(bearer_token(dict(scope["headers"])), self._key):
            await send_refusal(send, 401, {"error": _WRONG_KEY})
            return
        scope[GRANTED] = True
        await self.app(scope, receive, send)
