"""The gateway flags (gateway_flags.py) put to work: served names, the API key, TLS, tracing,
the access log.

- `--served_model_name A B ...`: every name routes (OpenAI `model`, v1/v2 paths); the first
  is the model's own name, reported in the metrics' `model_name` label.
- `--api_key` (or `$VLLM_API_KEY`): auth.py's middleware, outermost, over every route;
  refused with KServe's gRPC server on (it has no authentication: `--enable_grpc false`).
- `--model_control_key` (or `$KSERVE_PAGED_MODEL_CONTROL_KEY`): turns KServe's model
  repository routes on, behind this key alone (model_control.py); it must differ from the API
  key, and is refused with gRPC on too.
- `--ssl_certfile` / `--ssl_keyfile` (KServe's flags): HTTPS on the HTTP port;
  `--ssl_ca_certs`: clients must show a certificate that CA signed; `--enable_ssl_refresh`:
  KServe's certificate refresher (kserve/protocol/rest/ssl_cert_refresher.py) reloads the
  certificate and key when their files change. Without it the files are read once (KServe
  would always watch them; vLLM only when asked).
- `--otlp_traces_endpoint`: one span per request (tracing.py); nothing runs when unset.
- `--disable_access_log_for_endpoints` drops the listed paths' access records;
  `--disable_uvicorn_access_log` turns the access log off.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from typing import Any

from kserve_paged.access_log import parse_paths, skip_access_log
from kserve_paged.tracing import RequestTracer, detail_levels
from kserve_paged_kernels import settings

API_KEY_ENV = "VLLM_API_KEY"


def api_key(args: argparse.Namespace) -> str | None:
    """The key every protected route asks for: the flag, else `$VLLM_API_KEY`, else None."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def model_control_key(args: argparse.Namespace) -> str | None:
    """The key of the model repository routes: the flag, else
    `$KSERVE_PAGED_MODEL_CONTROL_KEY` (kernels' settings.py), else None (model control off)."""
    return getattr(args, "model_control_key", None) or settings.model_control_key()


def served_names(args: argparse.Namespace) -> list[str]:
    """The names the model answers to, its own first, each once."""
    names = [args.model_name, *(getattr(args, "served_model_name", None) or [])]
    return list(dict.fromkeys(names))


def check_gateway_args(args: argparse.Namespace) -> str | None:
    """The error message for gateway flags that cannot work together, else None."""
    cert, key = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
    if bool(cert) != bool(key):
        return "--ssl-certfile and --ssl-keyfile go together (HTTPS needs both)"
    for flag, value in (("--ssl-ca-certs", args.ssl_ca_certs),
                        ("--enable-ssl-refresh", args.enable_ssl_refresh)):
        if value and not cert:
            return f"{flag} needs --ssl-certfile and --ssl-keyfile"
    for path in (cert, key, args.ssl_ca_certs):
        if path and not os.path.isfile(path):
            return f"TLS file {path} does not exist"
    try:
        levels = detail_levels(args.collect_detailed_traces)
    except ValueError as exc:
        return str(exc)
    if levels and not args.otlp_traces_endpoint:
        return "--collect-detailed-traces needs --otlp-traces-endpoint"
    if getattr(args, "api_key", None) == "":
        return "--api-key is empty: an empty key would let everyone in"
    if api_key(args) and getattr(args, "enable_grpc", False):
        return ("--api-key (or $VLLM_API_KEY) guards the HTTP routes only, and KServe's gRPC "
                "server has no authentication: add --enable_grpc false")
    return _check_model_control_key(args)


def _check_model_control_key(args: argparse.Namespace) -> str | None:
    control = model_control_key(args)
    if getattr(args, "model_control_key", None) == "":
        return "--model-control-key is empty: an empty key would let everyone in"
    if control and control == api_key(args):
        return ("--model-control-key equals the --api-key: model control needs a key of its "
                "own, not the inference key")
    if control and getattr(args, "enable_grpc", False):
        return ("--model-control-key guards the HTTP routes only, and KServe's gRPC server "
                "has no authentication: add --enable_grpc false")
    return None


def make_tracer(args: argparse.Namespace) -> RequestTracer | None:
    """The request tracer of `--otlp_traces_endpoint`, or None (tracing off)."""
    if not args.otlp_traces_endpoint:
        return None
    return RequestTracer(args.otlp_traces_endpoint,
                         detailed=bool(detail_levels(args.collect_detailed_traces)))


@dataclass(frozen=True)
class RestOptions:
    """What the HTTP server's uvicorn config takes from the gateway flags (applied by
    PagedModelServer before the server starts)."""

    ssl_ca_certs: str | None = None
    ssl_refresh: bool = False
    access_log: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RestOptions:
        skip_access_log(parse_paths(args.disable_access_log_for_endpoints))
        return cls(ssl_ca_certs=args.ssl_ca_certs, ssl_refresh=args.enable_ssl_refresh,
                   access_log=not args.disable_uvicorn_access_log)

    def apply(self, rest: Any) -> None:
        """Configure KServe's RESTServer `rest` (its uvicorn Config and Server) in place."""
        import uvicorn

        config = rest.config
        config.access_log = self.access_log
        if self.ssl_ca_certs:
            config.ssl_ca_certs = self.ssl_ca_certs
            config.ssl_cert_reqs = ssl.CERT_REQUIRED
        if not self.ssl_refresh and type(rest._server) is not uvicorn.Server:
            # KServe's server always starts its refresher when TLS is on; read once instead.
            rest._server = uvicorn.Server(config)
