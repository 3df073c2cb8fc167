"""The planner sizes quantized weights packed (kserve_paged/plan_weights.py), per rank and for
multi-node layouts: tiny AWQ, GPTQ, FP8 and GGUF checkpoints, planned against their tensors'
bytes as the safetensors library and the gguf package read them (not our header reader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from safetensors import safe_open

from kserve_paged.plan import make_plan, parse_device, resources
from kserve_paged.plan_weights import packed_weight_bytes, stored_weight_bytes
from kserve_paged_engine.model_executor.model_facts import describe_folder
from tests.helpers import tiny_gguf
from tests.helpers.quantized_checkpoints import write_fp8, write_int4
from tests.helpers.tiny_models import CONFIGS, save_checkpoint

TOLERANCE = 0.03  # the config-only rule against the real tensors
WRITERS = {"awq": lambda src, dst: write_int4(src, dst, "awq"),
           "gptq": lambda src, dst: write_int4(src, dst, "gptq"),
           "fp8_tensor": lambda src, dst: write_fp8(src, dst, "tensor_static"),
           "fp8_blocks": lambda src, dst: write_fp8(src, dst, "blocks")}


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], tmp_path_factory.mktemp("float"))
    return folder


def _tensor_bytes(folder: Path, elem: int) -> int:
    """The checkpoint's tensors by the safetensors library: packed ones as stored, float
    weights of unquantized modules at the serving `elem`."""
    total = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        packed_modules = {n.rsplit(".", 1)[0] for n in names if not n.endswith(".weight")
                          or not f.get_tensor(n).is_floating_point()}
        for name in names:
            t = f.get_tensor(name)
            module, leaf = name.rsplit(".", 1)
            floating = t.dtype in (torch.float16, torch.bfloat16, torch.float32)
            if leaf in ("weight", "bias") and floating and module not in packed_modules:
                total += t.numel() * elem
            else:
                total += t.nbytes
    return total


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_planned_weights_are_the_packed_tensors(name: str, float_checkpoint: Path,
                                                tmp_path: Path) -> None:
    folder = WRITERS[name](float_checkpoint, tmp_path / "q")
    for elem in (4, 2):
        actual = _tensor_bytes(folder, elem)
        assert packed_weight_bytes(folder, elem) == actual
        # config.json alone (planning before the weights are downloaded): the rule.
        config_only = tmp_path / f"config-{elem}"
        config_only.mkdir()
        shutil.copy(folder / "config.json", config_only)
        ruled = packed_weight_bytes(config_only, elem)
        assert ruled is not None and abs(ruled - actual) <= TOLERANCE * actual, (ruled, actual)
    facts = describe_folder(folder)
    dense = facts.num_params * 4
    assert packed_weight_bytes(float_checkpoint, 4) is None  # float: the dense rule stays
    assert _tensor_bytes(folder, 4) < 0.6 * dense  # what the old plan was off by


def test_gguf_is_planned_by_its_block_bytes(tmp_path: Path) -> None:
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = tiny_gguf.write(tmp_path / "m.gguf", dict.fromkeys(projections, QT.Q4_0)
                           | {"ffn_down": QT.Q8_0})
    by_gguf = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert stored_weight_bytes(tmp_path, 4) == by_gguf


def test_per_rank_and_multi_node_layouts(float_checkpoint: Path, tmp_path: Path) -> None:
    folder = WRITERS["awq"](float_checkpoint, tmp_path / "q")
    facts = describe_folder(folder)
    packed = packed_weight_bytes(folder, 2)
    assert packed is not None
    h100 = parse_device("h100-80gb")
    one = make_plan(facts, h100, dtype="bfloat16", packed_weights=packed)
    two = make_plan(facts, h100, dtype="bfloat16", tp=2, packed_weights=packed)
    assert one.weights_bytes == packed and two.weights_bytes == -(-packed // 2)
    nodes = make_plan(facts, h100, dtype="bfloat16", tp=2, nnodes=2, packed_weights=packed)
    assert nodes.devices_per_node == 1 and "--nnodes=2" in nodes.server_flags()
    assert resources(nodes)["limits"]["nvidia.com/gpu"] == "1"
    with pytest.raises(ValueError, match="multiple of --nnodes 2"):
        make_plan(facts, h100, tp=1, nnodes=2)
    json.dumps(resources(two))  # the overlay writer's input stays JSON


def test_cli_plans_the_packed_size(float_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from kserve_paged.plan_cli import main

    folder = WRITERS["fp8_blocks"](float_checkpoint, tmp_path / "q")
    main(["--model", str(folder), "--gpu", "h100-80gb", "--dtype", "bfloat16",
          "--tensor_parallel_size", "2", "--nnodes", "2"])
    out = capsys.readouterr().out
    per_rank = -(-_tensor_bytes(folder, 2) // 2)
    assert f"weights      {per_rank / 2**30:.2f} GiB per device ({per_rank} bytes, quantized" in out
    assert "1 per pod x 2 pods" in out
    with pytest.raises(SystemExit):  # one pod per replica: no overlay for two
        main(["--model", str(folder), "--gpu", "h100-80gb", "--tensor_parallel_size", "2",
              "--nnodes", "2", "--write-overlay", str(tmp_path / "overlay")])
    assert "llmisvc-multinode" in capsys.readouterr().err
