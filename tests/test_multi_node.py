"""Multi-node tensor parallelism (engine config/multi_node.py, worker/worker_node.py): the
layout from vLLM's flags or a LeaderWorkerSet's variables, and two "nodes" on loopback, each a
separately started process, giving TP = 1's greedy tokens; a worker node that dies fails the
leader with a reason while it is idle.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from kserve_paged.args import engine_kwargs, parse_args
from kserve_paged.multi_node_flags import run_if_worker_node
from kserve_paged.vllm_cli import serve_argv
from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.config.multi_node import (
    DEFAULT_MASTER_PORT,
    NodeLayout,
    resolve_layout,
)
from kserve_paged_engine.distributed import node_heartbeat
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.worker import worker_node
from kserve_paged_engine.worker.tp_executor import TPWorkerError
from tests.helpers.tiny_models import common_config, save_random, save_tokenizer

REPO = Path(__file__).resolve().parents[1]
LWS = {"LWS_LEADER_ADDRESS": "leader.svc", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}


def test_a_leaderworkerset_pod_reads_its_place_from_the_lws_variables():
    assert resolve_layout(env=LWS) == NodeLayout(2, 1, "leader.svc", DEFAULT_MASTER_PORT)
    leader = resolve_layout(env={**LWS, "LWS_WORKER_INDEX": "0"})
    assert leader is not None and leader.is_leader
    # vLLM's flags win over the variables; one node is no layout at all.
    assert resolve_layout(3, 2, "10.0.0.1", 4000, env=LWS) == NodeLayout(3, 2, "10.0.0.1", 4000)
    assert resolve_layout(env={}) is None
    assert NodeLayout(2, 1).node_ranks(4) == range(2, 4)


def test_vllm_multi_node_flags_parse_and_bad_layouts_are_usage_errors(capsys, monkeypatch):
    for name in LWS:
        monkeypatch.delenv(name, raising=False)
    argv = serve_argv(["/tmp/m", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank",
                       "1", "--master-addr", "10.1.2.3", "--master-port", "29600",
                       "--headless"])
    assert engine_kwargs(parse_args(argv))["multi_node"] == NodeLayout(2, 1, "10.1.2.3", 29600)
    for bad, message in (
            (["--tensor-parallel-size", "3", "--nnodes", "2"], "multiple of nnodes 2"),
            (["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "2"],
             "node_rank must be in 0..1"),
            (["--data-parallel-size", "2", "--data-parallel-size-local", "1"],
             "data parallelism across pods is not built")):
        with pytest.raises(SystemExit):
            parse_args(serve_argv(["/tmp/m", *bad]))
        assert message in capsys.readouterr().err
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")  # the variables alone make a layout too
    with pytest.raises(SystemExit):
        parse_args(serve_argv(["/tmp/m"]))  # TP 1 over 2 pods cannot split
    assert "multiple of nnodes 2" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.slow
def test_two_nodes_on_loopback_match_tp1_and_a_dead_node_fails_the_leader(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    save_random(LlamaConfig(**common_config()), folder, seed=3)
    save_tokenizer(folder)
    prompts = [[5, 17, 40, 3, 9], list(range(20, 33))]
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=32,
                  max_num_batched_tokens=16, max_model_len=64)
    engine = LLMEngine(EngineConfig(**config))
    try:
        expected = _greedy(engine, prompts)
    finally:
        engine.close()

    port = _free_port()
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2"}
    # The worker pod's process, started as the pod starts it: `vllm serve` with LWS's variables.
    worker_env = {**os.environ, **lws, "LWS_WORKER_INDEX": "1", "OMP_NUM_THREADS": "1",
                  "PYTHONPATH": str(REPO)}
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "kserve_paged.vllm_cli", "serve", str(folder),
         "--tensor-parallel-size", "2", "--master-port", str(port)],
        env=worker_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    monkeypatch.setattr(node_heartbeat, "SILENCE_S", 2.0)
    try:
        layout = resolve_layout(master_port=port, env={**lws, "LWS_WORKER_INDEX": "0"})
        assert layout is not None and layout.is_leader
        leader = LLMEngine(EngineConfig(**config, tensor_parallel_size=2, multi_node=layout))
        try:
            assert leader.executor.procs == []  # rank 1 is the other process, not a child
            assert _greedy(leader, prompts) == expected
            died = threading.Event()
            leader.on_fatal(lambda _: died.set())
            os.killpg(worker.pid, signal.SIGKILL)  # the worker pod dies while the leader idles
            assert died.wait(60), (tmp_path / "worker.log").read_text()
            with pytest.raises(TPWorkerError, match="worker node 1 .*ranks 1..1.* no heartbeat"):
                leader.executor.check_alive()
        finally:
            leader.close()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(30)
        log.close()


def _watch(nodes: dict[int, str]) -> tuple[Any, threading.Thread, threading.Event, list[str]]:
    """A leader's store and its node watcher over `nodes` (node -> its ranks, in words)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    stopped, reasons = threading.Event(), []
    watch = threading.Thread(target=node_heartbeat.watch_nodes, daemon=True,
                             args=(store.port, nodes, stopped, reasons.append))
    return store, watch, stopped, reasons


def test_the_leader_names_the_node_whose_heartbeat_stops(monkeypatch):
    """The watcher alone (the slow test above kills a real worker pod's process): node 1
    beats, node 2 never does, and the reason names node 2 and its ranks once SILENCE_S has
    passed. The watcher reads a fake clock that moves tick_s per read, and node 1 beats at each
    read, so no stall of this machine can make node 1 look silent or node 2 beat."""
    tick_s, silence_s = 0.25, 1.0
    monkeypatch.setattr(node_heartbeat, "BEAT_S", 0.01)  # the watcher's real wait per round
    monkeypatch.setattr(node_heartbeat, "SILENCE_S", silence_s)
    store, watch, stopped, reasons = _watch({1: "2..3", 2: "4..5"})
    token, reads = node_heartbeat.node_token(), []

    def clock() -> float:
        """The watcher reads the time once before each round's beats: node 1 beats first."""
        node_heartbeat.write_beat(store, 1, token, len(reads))
        reads.append(len(reads) * tick_s)
        return reads[-1]
    monkeypatch.setattr(node_heartbeat, "time", SimpleNamespace(monotonic=clock))
    watch.start()
    watch.join(30)  # a watcher that never reports fails here, not hangs
    stopped.set()
    assert not watch.is_alive() and len(reasons) == 1, reasons
    assert reasons[0].startswith("worker node 2 (tensor-parallel ranks 4..5) sent no heartbeat")
    assert silence_s < reads[-1] <= silence_s + tick_s  # not before its silence, nor long after


def test_a_worker_node_that_restarts_within_the_silence_fails_the_leader(monkeypatch):
    """A pod that crashed and came back within SILENCE_S beats on, but its new process's
    ranks are not in the leader's group: a new token from a node already heard is its death."""
    monkeypatch.setattr(node_heartbeat, "BEAT_S", 0.05)
    monkeypatch.setattr(node_heartbeat, "SILENCE_S", 600.0)  # silence cannot be the reason
    store, watch, stopped, reasons = _watch({1: "2..3"})
    old, new = node_heartbeat.node_token(), node_heartbeat.node_token()
    assert old != new  # two processes of one pod, even with the same pid
    node_heartbeat.write_beat(store, 1, old, 0)  # start_beating: before the ranks joined
    watch.start()
    for count in range(1, 120):  # at most ~6 s: a watcher that never reports fails, not hangs
        if not watch.is_alive():
            break
        # The pod restarts after 10 beats; its new process beats from 0 again, every BEAT_S.
        node_heartbeat.write_beat(store, 1, *((old, count) if count < 10 else (new, count - 10)))
        watch.join(0.05)
    stopped.set()
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith("worker node 1 (tensor-parallel ranks 2..3) restarted")


def _node_1_of_2(monkeypatch) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Node 1 of 2 with its beat and its rank stubbed: what they would have been started
    with (a rank: rank, world, port, device type, threads, host, local rank)."""
    for name in LWS:
        monkeypatch.delenv(name, raising=False)
    beats: list[tuple[Any, ...]] = []
    ranks: list[tuple[Any, ...]] = []
    monkeypatch.setattr(worker_node, "start_beating", lambda *where: beats.append(where))
    monkeypatch.setattr(worker_node, "worker_main", lambda *rank: ranks.append(rank))
    return beats, ranks


def _serve_node_1_of_2(*flags: str) -> int | None:
    """`vllm serve` of node 1 of 2 at TP 2 (its one rank runs in this process)."""
    argv = serve_argv(["/tmp/m", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank",
                       "1", "--master-addr", "10.1.2.3", "--master-port", "29600", *flags])
    return run_if_worker_node(parse_args(argv))


def test_a_worker_node_runs_its_ranks_on_the_device_the_leader_is_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU pod: auto is cuda
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    beats, ranks = _node_1_of_2(monkeypatch)
    assert _serve_node_1_of_2("--device", "cpu") == 0
    assert beats == [("10.1.2.3", 29600, 1)]
    assert len(ranks) == 1 and ranks[0][:4] == (1, 2, 29600, "cpu")
    assert ranks[0][5:] == ("10.1.2.3", 0)
    assert _serve_node_1_of_2() == 0 and ranks[1][3] == "cuda"  # auto: as the leader's


def test_a_worker_node_given_cuda_without_a_gpu_says_so_before_starting(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU pod
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    beats, ranks = _node_1_of_2(monkeypatch)
    with pytest.raises(SystemExit) as exc:  # parse_args: EngineConfig refuses it, as the leader's
        _serve_node_1_of_2("--device", "cuda")
    assert exc.value.code == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err
    assert beats == [] and ranks == []
    assert _serve_node_1_of_2() == 0 and [r[3] for r in ranks] == ["cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU pod, one GPU short
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device cuda: .* needs 2 GPUs in this pod; 1 visible"):
        _serve_node_1_of_2("--device", "cuda", "--tensor-parallel-size", "4")
    assert beats == [("10.1.2.3", 29600, 1)] and len(ranks) == 1  # only the cpu run's
