"""vLLM's command line on our server: the argv KServe's LLMInferenceService writes, both
spellings of every flag, and `vllm --version` (kserve_paged/vllm_cli.py, vllm_flags.py)."""

from __future__ import annotations

import json
import shlex

import pytest

from kserve_paged.args import build_parser, engine_kwargs, parse_args
from kserve_paged.vllm_cli import main as vllm_main
from kserve_paged.vllm_cli import serve_argv
from kserve_paged.vllm_flags import VLLM_FLAGS


def kserve_preset_argv(name: str, namespace: str, *, adapters: tuple[str, ...] = (),
                       tracing: str | None = None, tls: tuple[str, str] | None = None,
                       user_args: tuple[str, ...] = ()) -> list[str]:
    """The container's argv after `vllm`, built by the rules of KServe 0.20's controller
    (config-llm-template.yaml; workload_lora.go puts the adapters' flags before the user's
    args, each JSON object single-quoted for the bash `eval`; tracing.go and the TLS switch
    append theirs), then split the way bash's eval splits it."""
    command = (f"serve /mnt/models --served-model-name {name} "
               f"publishers/{namespace}/models/{name} --port 8000 "
               "--disable-access-log-for-endpoints /health,/metrics,/ping --shutdown-timeout 30")
    if adapters:
        command += " --enable-lora --max-lora-rank=16 --max-loras=2 --max-cpu-loras=4"
        command += " --lora-modules"
        for a in adapters:
            for served in (a, f"publishers/{namespace}/models/{a}"):
                command += " '" + json.dumps({"name": served, "path": f"/mnt/lora/{a}"},
                                             separators=(",", ":")) + "'"
    command += "".join(f" {shlex.quote(arg)}" for arg in user_args)
    if tracing:
        command += f" --otlp-traces-endpoint {tracing} --collect-detailed-traces all"
    if tls:
        command += f" --enable-ssl-refresh --ssl-certfile {tls[0]} --ssl-keyfile {tls[1]}"
    return shlex.split(command)


def test_the_preset_command_line_parses_into_our_settings() -> None:
    argv = kserve_preset_argv("smol", "team-a", adapters=("sql", "chat"),
                              tracing="http://otel-collector:4317", tls=("/c.pem", "/k.pem"),
                              user_args=("--max-model-len", "2048", "--dtype=float32"))
    assert argv[0] == "serve"
    args = parse_args(serve_argv(argv[1:]))
    assert args.model_dir == "/mnt/models"
    assert args.model_name == "smol"
    assert args.served_model_name == ["smol", "publishers/team-a/models/smol"]
    assert args.http_port == 8000 and args.enable_grpc is False
    assert args.disable_access_log_for_endpoints == "/health,/metrics,/ping"
    assert args.shutdown_grace_s == 30.0
    assert args.enable_lora is True
    assert (args.max_lora_rank, args.max_loras, args.max_cpu_loras) == (16, 2, 4)
    assert args.lora_modules == [
        ("sql", "/mnt/lora/sql"), ("publishers/team-a/models/sql", "/mnt/lora/sql"),
        ("chat", "/mnt/lora/chat"), ("publishers/team-a/models/chat", "/mnt/lora/chat")]
    assert args.max_model_len == 2048 and args.dtype == "float32"
    assert args.otlp_traces_endpoint == "http://otel-collector:4317"
    assert args.collect_detailed_traces == "all"
    assert args.enable_ssl_refresh is True
    assert (args.ssl_certfile, args.ssl_keyfile) == ("/c.pem", "/k.pem")


def test_lora_modules_keep_their_quotes_when_no_shell_removed_them() -> None:
    entry = '\'{"name":"sql","path":"/mnt/lora/sql","base_model_name":"smol"}\''
    args = parse_args(["--lora-modules", entry, "b=/mnt/lora/b"])
    assert args.lora_modules == [("sql", "/mnt/lora/sql"), ("b", "/mnt/lora/b")]


@pytest.mark.parametrize("bad", ['{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}',
                                 "{not json", "no-equals-sign"])
def test_a_bad_lora_module_is_an_error_that_shows_it(bad: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--lora-modules", bad])
    assert exc.value.code == 2
    assert "lora" in capsys.readouterr().err.lower()


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--max-model-len", "512"], "max_model_len", 512),
    (["--max_model_len=512"], "max_model_len", 512),
    (["--max-model-len=512"], "max_model_len", 512),
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no_enable_prefix_caching"], "enable_prefix_caching", False),
    (["--enable-prefix-caching=false"], "enable_prefix_caching", False),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--enforce-eager"], "enforce_eager", True),
    (["--kv-cache-dtype", "auto"], "kv_cache_dtype", "auto"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--kv_cache_dtype=int8"], "kv_cache_dtype", "int8"),
    (["--kv-cache-dtype=fp8_e5m2"], "kv_cache_dtype", "fp8_e5m2"),
    (["--host", "127.0.0.1"], "http_host", "127.0.0.1"),
    (["--port=9000"], "http_port", 9000),
    (["--api-key", "s3cret"], "api_key", "s3cret"),
    (["--reasoning-parser", "qwen3"], "reasoning_parser", "qwen3"),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'],
     "default_chat_template_kwargs", {"enable_thinking": False}),
])
def test_both_spellings_and_both_value_forms(argv: list[str], field: str, value: object) -> None:
    assert getattr(parse_args(argv), field) == value


@pytest.mark.parametrize(("argv", "named"), [
    (["--max-modle-len", "5"], "--max-modle-len"),
    (["--kv-cache-dtype", "fp4"], "--kv_cache_dtype"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], "LMCacheConnectorV1"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}'], "no second KV tier"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_'
      'config": {"cpu_bytes_to_use": 1073741824}}'], "cpu_bytes_to_use adds none"),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_'
      'config": {"secondary_tiers": [{"type": "s3", "root_dir": "b"}]}}'], '"type": "fs"'),
    (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_connector_extra_'
      'config": {"secondary_tiers": [{"type": "fs", "root_dir": "a"}, {"type": "fs", '
      '"root_dir": "b"}]}}'], "2 fs tiers given"),
    (["--reasoning-parser", "r2"], "--reasoning-parser"),
])
def test_a_flag_we_do_not_honour_is_an_error_that_names_it(argv: list[str], named: str,
                                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


KSERVE_OFFLOADING = {  # KServe 0.20's rendering of spec.kvCacheOffloading
    "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4294967296,
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv-cache-0"}]}}


def test_kserve_kv_offloading_config_parses_into_a_disk_tier() -> None:
    text = json.dumps(KSERVE_OFFLOADING, separators=(",", ":"))
    argv = kserve_preset_argv("smol", "team-a", user_args=("--kv-transfer-config", text))
    cfg = parse_args(serve_argv(argv[1:])).kv_transfer_config
    assert cfg.cpu_bytes_to_use == 4294967296 and cfg.eviction_policy == "arc"
    assert [t.root_dir for t in cfg.fs_tiers] == ["/mnt/kv-cache-0"]
    assert engine_kwargs(parse_args(["--kv_transfer_config", text]))["kv_transfer_config"] == cfg


def test_the_simple_offloading_form_with_a_disk_tier_parses() -> None:
    text = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {
                           "cpu_bytes_to_use": 1 << 30,
                           "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv"}]}})
    cfg = parse_args(["--kv-transfer-config", text]).kv_transfer_config
    assert cfg.cpu_bytes_to_use == 1 << 30 and cfg.eviction_policy == "lru"
    assert cfg.fs_tiers[0].root_dir == "/tmp/kv"


def test_every_vllm_name_in_the_table_is_a_flag_and_help_shows_both_spellings() -> None:
    parser = build_parser()
    text = parser.format_help()
    for vllm, ours in VLLM_FLAGS.items():
        assert parser._option_string_actions[vllm] is parser._option_string_actions[ours]
        assert vllm in text and ours in text
    assert "--max_model_len MAX_MODEL_LEN, --max-model-len MAX_MODEL_LEN" in text
    build_parser()  # a second parser in one process does not repeat KServe's spellings
    assert build_parser().format_help().count("--http-port HTTP_PORT") == 1


def test_vllm_version_and_usage(capsys: pytest.CaptureFixture) -> None:
    assert vllm_main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kserve-paged ")
    assert vllm_main(["chat"]) == 2
    assert "usage: vllm serve MODEL_PATH" in capsys.readouterr().err
    assert vllm_main(["serve", "--port", "8000"]) == 2
    assert "model path first" in capsys.readouterr().err
