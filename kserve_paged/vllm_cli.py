"""`vllm`: vLLM's command for our server, installed as `vllm` in the container image only.

KServe's LLMInferenceService preset runs `vllm --version`, then `vllm serve /mnt/models
--served-model-name NAME ... --port 8000 ...`. This module answers both, so the preset runs
unchanged: `serve MODEL [flags]` becomes our server's command line with vLLM's defaults in front
(port 8000, no gRPC, MODEL as the served name) and the user's flags after them (the last value
wins), and every flag is parsed by our parser in either spelling (`vllm_flags.py`). It is not a
console script of the package: on a user's machine it would shadow a real vLLM.
"""

from __future__ import annotations

import sys

from kserve_paged.vllm_flags import VLLM_CLI_VERSION, package_version

USAGE = "usage: vllm serve MODEL_PATH [flags]   |   vllm --version"
VLLM_DEFAULT_PORT = 8000


def serve_argv(argv: list[str]) -> list[str]:
    """`serve MODEL [flags]` (after `serve`) -> our server's argv. ValueError without MODEL."""
    if not argv or argv[0].startswith("-"):
        if "-h" in argv or "--help" in argv:
            return ["--help"]
        raise ValueError("vllm serve needs the model path first (" + USAGE + ")")
    # KServe's preset template glues a space to the next word where a conditional flag sits
    # (Go's `{{-` trims the line break before it, not the backslash that escaped it): a blank
    # word when the flag is off, " --tensor-parallel-size" when on. Both are mended here.
    model = argv[0]
    flags = [a.lstrip() if a.lstrip().startswith("--") else a for a in argv[1:] if a.strip()]
    return ["--model_dir", model, "--model_name", model, "--http_port", str(VLLM_DEFAULT_PORT),
            "--enable_grpc", "false", *flags]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--version"], ["-v"]):
        print(f"kserve-paged {package_version()}, vLLM command line {VLLM_CLI_VERSION}")
        return 0
    if not args or args[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        ours = serve_argv(args[1:])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kserve_paged.__main__ import main as server_main

    sys.argv = ["vllm serve", *ours]  # what the tcmalloc re-exec and KServe's parser read
    return server_main(None)


if __name__ == "__main__":
    sys.exit(main())
