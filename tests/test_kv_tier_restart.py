"""A kept disk tier across restarts (PYTHONHASHSEED set, so block keys repeat; issue 49): a
folder holding a dangling link, garbage, a folder and a truncated file starts and serves its
good blocks; a new checkpoint written to the same path, and another adapter given the same
process-local id, are never served the blocks computed before the restart (the tier is keyed
by the model's and the adapter's content: engine/kserve_paged_engine/core/kv_tier/identity.py, lora/digest.py), while
the same adapter's content under another name and id still finds its blocks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kserve_paged_engine.lora import LoRARequest
from tests.helpers.kv_tier_engine import PROMPT, engine, flood, hits, run, tier_dirs
from tests.helpers.lora import make_adapter, tiny_base
from tests.helpers.tiny_models import save_random

ADAPTER = dict(r=4, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tier_dirs(tmp_path_factory)


@pytest.fixture(autouse=True)
def fixed_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block keys that repeat across processes: the tier keeps its files at start-up."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def computed_then_closed(dirs: dict[str, Path], tier: Path) -> list[int]:
    """PROMPT's greedy tokens on an engine whose tier then holds its blocks, closed."""
    llm = engine(dirs, "float32", tier)
    first = run(llm, PROMPT)
    flood(llm)
    llm.engine.close()
    return first


def test_a_restart_on_a_tier_with_bad_entries_starts_and_serves_its_blocks(dirs, tmp_path):
    tier = tmp_path / "tier"
    first = computed_then_closed(dirs, tier)
    (folder,) = tier.iterdir()
    good = sorted(folder.glob("*.kv"))[0]
    names = [os.urandom(32).hex() + ".kv" for _ in range(4)]
    (folder / names[0]).symlink_to(folder / "gone")  # dangling
    (folder / names[1]).write_bytes(os.urandom(300))  # garbage
    (folder / names[2]).mkdir()
    (folder / names[3]).write_bytes(good.read_bytes()[:30])  # a truncated header
    llm = engine(dirs, "float32", tier)
    assert llm.engine.kv_tier.stats.corrupt == 4
    assert run(llm, PROMPT) == first
    assert hits(llm) == 10  # every full block before the last token, kept across the restart
    llm.engine.close()


def test_a_new_checkpoint_at_the_same_path_is_not_served_the_old_ones_blocks(tmp_path):
    from transformers import AutoConfig

    model = tmp_path / "model"
    tiny_base(model)
    dirs, tier = {"base": model}, tmp_path / "tier"
    first = computed_then_closed(dirs, tier)
    save_random(AutoConfig.from_pretrained(model), model, seed=1)  # new weights, same path
    llm = engine(dirs, "float32", tier)
    restored = run(llm, PROMPT)
    assert hits(llm) == 0
    scratch = engine(dirs, "float32", None, enable_prefix_caching=False)
    assert restored == run(scratch, PROMPT) != first  # the new weights' answer
    llm.engine.close()


@pytest.mark.slow
def test_another_adapter_with_the_same_id_after_a_restart_gets_none_of_its_blocks(
        dirs, tmp_path):
    for name, seed in (("first", 3), ("second", 5)):
        make_adapter(dirs["base"], tmp_path / name, seed=seed, **ADAPTER)
    shutil.copytree(tmp_path / "first", tmp_path / "first-again")
    lora = dict(enable_lora=True, max_lora_rank=16)
    tier = tmp_path / "tier"
    llm = engine(dirs, "float32", tier, **lora)
    first = run(llm, PROMPT, lora=LoRARequest("a", 1, str(tmp_path / "first")))
    flood(llm)
    llm.engine.close()

    llm = engine(dirs, "float32", tier, **lora)  # the next process: ids start again
    second = LoRARequest("b", 1, str(tmp_path / "second"))
    answer = run(llm, PROMPT, lora=second)
    assert hits(llm) == 0
    scratch = engine(dirs, "float32", None, enable_prefix_caching=False, **lora)
    assert answer == run(scratch, PROMPT, lora=second) != first
    again = LoRARequest("a-again", 2, str(tmp_path / "first-again"))  # same content
    assert run(llm, PROMPT, lora=again) == first
    assert hits(llm) == 10
    llm.engine.close()
