"""The argv KServe's LLMInferenceService preset hands `vllm serve`, through the preset's own bash
script (tests/helpers/llmisvc_preset.py), parsed by our server's parser; and our `vllm --version`
choosing the preset's newest flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kserve_paged.args import parse_args
from kserve_paged.vllm_cli import VLLM_CLI_VERSION, serve_argv
from tests.helpers.llmisvc_preset import Preset, preset_argv


def _argv(preset: Preset, tmp_path: Path, version: str = VLLM_CLI_VERSION) -> list[str]:
    return preset_argv(preset, tmp_path / "bin", version)


def test_the_preset_argv_with_lora_tracing_and_tls_parses(tmp_path: Path) -> None:
    preset = Preset("smol", "team-a", tls=("/tls/tls.crt", "/tls/tls.key"), tensor=None,
                    adapters={"sql": "/mnt/lora/sql", "chat": "/mnt/lora/chat"},
                    max_lora_rank=8, tracing_endpoint="http://otel-collector:4317",
                    user_args=["--max-model-len=1024"])
    argv = _argv(preset, tmp_path)
    assert argv[:2] == ["serve", "/mnt/models"]
    assert " " in argv  # the blank word the preset's trimmed template leaves behind
    args = parse_args(serve_argv(argv[1:]))
    assert args.served_model_name == ["smol", "publishers/team-a/models/smol"]
    assert args.http_port == 8000
    assert args.disable_access_log_for_endpoints == "/health,/metrics,/ping"
    assert args.shutdown_grace_s == 40.0  # 60 s grace - 15 s preStop - 5 s
    assert args.lora_modules == [
        ("sql", "/mnt/lora/sql"), ("publishers/team-a/models/sql", "/mnt/lora/sql"),
        ("chat", "/mnt/lora/chat"), ("publishers/team-a/models/chat", "/mnt/lora/chat")]
    assert args.max_lora_rank == 8 and args.enable_lora
    assert args.max_model_len == 1024
    assert args.otlp_traces_endpoint == "http://otel-collector:4317"
    assert (args.ssl_certfile, args.ssl_keyfile, args.enable_ssl_refresh) == (
        "/tls/tls.crt", "/tls/tls.key", True)


def test_an_old_vllm_version_gets_the_old_access_log_flag(tmp_path: Path) -> None:
    argv = _argv(Preset("m", "ns", tensor=2), tmp_path, version="0.15.1")
    assert "--disable-uvicorn-access-log" in argv and "--shutdown-timeout" not in argv
    args = parse_args(serve_argv(argv[1:]))
    assert args.disable_uvicorn_access_log is True and args.tensor_parallel_size == 2


def test_our_version_is_new_enough_for_every_flag_the_preset_gates() -> None:
    major, minor, *_ = (int(x) for x in VLLM_CLI_VERSION.split("."))
    assert (major, minor) >= (0, 18)  # --disable-access-log-for-endpoints, --shutdown-timeout


@pytest.mark.parametrize("blank", [" ", "", "\t"])
def test_blank_words_in_the_serve_argv_are_dropped(blank: str) -> None:
    assert serve_argv(["/m", blank, "--port", "1"])[-2:] == ["--port", "1"]
    assert serve_argv(["/m", blank + "--port", "1"])[-2:] == ["--port", "1"]
    assert serve_argv(["/m", "--stop", " x"])[-2:] == ["--stop", " x"]  # values stay
