"""Data parallelism in one server (`--data-parallel-size`, engine frontend/dp_router.py): two
engine replicas behind one model serve concurrent requests with DP = 1's greedy tokens, both
take requests, metrics are summed over them, and a dead replica fails readiness by name.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kserve.errors import ModelNotReady
from prometheus_client import REGISTRY
from transformers import LlamaConfig

from kserve_paged.args import parse_args
from kserve_paged.fault_inject import InjectedFatalFault
from kserve_paged.model import PagedLLMModel
from kserve_paged.server import build_model
from kserve_paged.vllm_cli import serve_argv
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.dp_router import DataParallelLLM, sum_stats
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import common_config, save_random, save_tokenizer

NAME = "dp-tiny"
PROMPTS = [[5, 17, 40, 3, 9], list(range(20, 33)), [7, 7, 8], [60, 2, 11, 90]]
TOKENS = 5
OPTS = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "32",
        "--max-model-len", "64", "--max-num-batched-tokens", "32"]


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dp") / "model"
    save_random(LlamaConfig(**common_config(hidden_size=32, intermediate_size=64,
                                            head_dim=8)), path, seed=5)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def served(folder: Path) -> Iterator[PagedLLMModel]:
    """The server's model as `vllm serve DIR --data-parallel-size 2` builds it, loaded."""
    argv = serve_argv([str(folder), "--data-parallel-size", "2", "--served-model-name", NAME,
                       *OPTS])
    model = build_model(parse_args(argv), argv)
    asyncio.run(model.start_engine())
    yield model
    model.stop_engine()


async def _complete(model: PagedLLMModel, prompt: list[int]) -> list[int]:
    stream = await model.submit(prompt, _params(), kind="cmpl")
    tokens: list[int] = []
    async for out in stream:
        assert out.error is None, out.error
        if out.finished:
            tokens = list(out.outputs[0].token_ids)
    return tokens


def _dp1(folder: Path) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=4,
                                    num_kv_blocks=32, max_model_len=64,
                                    max_num_batched_tokens=32))
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, _params())
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[f"r{i}"] for i in range(len(PROMPTS))]
    finally:
        engine.close()


def test_dp2_serves_concurrent_requests_as_dp1_on_both_replicas(served, folder):
    llm = served.llm
    assert isinstance(llm, DataParallelLLM) and len(llm.replicas) == 2
    tokens = [r.stats().get("generation_tokens", 0) for r in llm.replicas]
    assert tokens == [0, 0]

    seen: list[int] = []  # generation_tokens as step callbacks (the metrics) see them
    llm.add_step_callback(lambda info: seen.append(info.stats["generation_tokens"]))
    gate = threading.Event()  # both engine threads wait on it while the burst is routed

    async def burst() -> list[list[int]]:
        holds = [r.call_engine(lambda _: gate.wait(60)) for r in llm.replicas]
        held = asyncio.gather(*holds)
        tasks = [asyncio.ensure_future(_complete(served, p)) for p in PROMPTS]
        while sum(llm.routed) < len(PROMPTS):
            await asyncio.sleep(0.01)
        gate.set()  # no step ran, so no request ended, while the four were routed
        await held
        return list(await asyncio.gather(*tasks))

    got = asyncio.run(asyncio.wait_for(burst(), 120))
    assert got == _dp1(folder)
    # Least-loaded routing spreads a burst: each replica's own engine generated its share.
    assert llm.routed == [2, 2]
    assert [r.stats()["generation_tokens"] for r in llm.replicas] == [2 * TOKENS, 2 * TOKENS]
    assert [llm.load(i) for i in range(2)] == [0, 0]
    # Step callbacks see the sum over replicas, in order (so counters never step back), and
    # the model's metrics are that sum (no `engine` label).
    assert seen == sorted(seen) and seen[-1] == len(PROMPTS) * TOKENS
    assert REGISTRY.get_sample_value("vllm:generation_tokens_total",
                                     {"model_name": NAME}) == len(PROMPTS) * TOKENS
    # On CPU each replica's engine thread runs its share of the torch threads.
    share = max(1, torch.get_num_threads() // 2)
    per_replica = asyncio.run(llm.call_engine(lambda _: torch.get_num_threads()))
    assert per_replica == [share, share]


def test_a_dead_replica_fails_readiness_naming_it(served):
    llm = served.llm
    assert served.accepting

    def fatal(_ids: list[str]) -> None:
        raise InjectedFatalFault("replica one's engine thread dies")

    async def kill_replica_1() -> None:
        replica = llm.replicas[1]
        await replica.call_engine(lambda engine: setattr(engine, "fault_hook", fatal))
        stream = await replica.add([5, 6, 7], _params())
        async for _ in stream:
            pass

    with pytest.raises(Exception, match="engine failed"):
        asyncio.run(asyncio.wait_for(kill_replica_1(), 60))
    assert not served.accepting and not asyncio.run(served.healthy())
    reason = served.not_ready_reason()
    assert "data-parallel replica 1 of 2 died" in reason and "InjectedFatalFault" in reason
    with pytest.raises(ModelNotReady, match="replica 1 of 2"):
        served.check_ready()


def test_vllm_data_parallel_flags_parse_and_unbuilt_layouts_are_usage_errors(capsys):
    args = parse_args(serve_argv(["/tmp/m", "--data-parallel-size", "3",
                                  "--data-parallel-size-local", "3",
                                  "--data-parallel-address", "10.0.0.1",
                                  "--data-parallel-rpc-port", "13345"]))
    assert args.data_parallel_size == 3 and args.data_parallel_size_local == 3
    for bad, message in (
            (["--data-parallel-size", "4", "--data-parallel-size-local", "2"],
             "data parallelism across pods is not built"),
            (["--data-parallel-size", "2", "--data-parallel-start-rank", "1"],
             "data parallelism across pods is not built"),
            (["--data-parallel-size", "2", "--tensor-parallel-size", "2"],
             "data_parallel_size 2 with tensor_parallel_size 2 is not built"),
            (["--data-parallel-size", "2", "--nnodes", "2"],
             "data_parallel_size 2 over several pods (nnodes) is not built")):
        with pytest.raises(SystemExit):
            parse_args(serve_argv(["/tmp/m", *bad]))
        assert message in capsys.readouterr().err


def test_summed_stats_average_usage_and_keep_shape_facts():
    summed = sum_stats([
        {"num_running": 2, "kv_usage": 0.5, "num_kv_blocks": 32, "generation_tokens": 7,
         "running_lora_adapters": "a,b", "spec_decode_num_accepted_tokens_per_pos": [3, 1]},
        {"num_running": 1, "kv_usage": 0.25, "num_kv_blocks": 32, "generation_tokens": 5,
         "running_lora_adapters": "c", "spec_decode_num_accepted_tokens_per_pos": [2]}])
    assert summed == {"num_running": 3, "kv_usage": 0.375, "num_kv_blocks": 32,
                      "generation_tokens": 12, "running_lora_adapters": "a,b,c",
                      "spec_decode_num_accepted_tokens_per_pos": [5, 1]}
