"""An adapter's blocks are keyed by its content (engine/kserve_paged_engine/lora/digest.py, issue 49): the same
files give the same digest under any name, id or folder, other files another; a request is
keyed by the digest read at admission, and when the files were rewritten and read again after
an eviction, the request is refused rather than computing blocks under the old content's key."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from kserve_paged_engine import LLM
from kserve_paged_engine.core.prefix_hits import extra_keys
from kserve_paged_engine.core.request import Request
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.sampling_params import SamplingParams
from tests.helpers.lora import make_adapter, tiny_base

ADAPTER = dict(r=4, target_modules=["q_proj", "v_proj"])

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    root = tmp_path_factory.mktemp("lora_digest")
    tiny_base(root / "base")
    return LLM(model=str(root / "base"), block_size=4, num_kv_blocks=24, max_model_len=96,
               dtype="float32", max_num_seqs=2, enable_lora=True, max_lora_rank=16,
               max_loras=1, max_cpu_loras=1)


def base_of(llm: LLM) -> Path:
    return Path(llm.engine.model_path)


def test_the_same_files_give_the_same_digest_and_other_files_another(llm, tmp_path):
    make_adapter(base_of(llm), tmp_path / "a", seed=3, **ADAPTER)
    make_adapter(base_of(llm), tmp_path / "b", seed=4, **ADAPTER)
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")
    manager = llm.engine.lora
    a = manager.add(LoRARequest("a", 11, str(tmp_path / "a"))).digest
    copy = manager.add(LoRARequest("x", 12, str(tmp_path / "a-copy"))).digest
    b = manager.add(LoRARequest("b", 13, str(tmp_path / "b"))).digest
    assert a == copy != b and len(a) == 64


def test_an_admitted_request_is_keyed_by_its_adapters_content(llm, tmp_path):
    make_adapter(base_of(llm), tmp_path / "a", seed=3, **ADAPTER)
    lora = LoRARequest("keyed", 21, str(tmp_path / "a"))
    eng = llm.engine
    eng.add_request("keyed", [5] * 9, SamplingParams(max_tokens=1), lora_request=lora)
    request = eng.scheduler.requests["keyed"]
    keyed = request.lora_request
    assert keyed.content_digest == eng.lora.add(lora).digest
    assert extra_keys(request, 0) == (keyed.content_digest,)
    eng.abort_request("keyed")
    by_hand = Request("by-hand", [5] * 9, SamplingParams(max_tokens=1), lora_request=lora)
    assert extra_keys(by_hand, 0) == (21,)  # never read by the engine: its id


def test_files_rewritten_under_a_loaded_adapter_refuse_requests_keyed_before(llm, tmp_path):
    make_adapter(base_of(llm), tmp_path / "a", seed=3, **ADAPTER)
    make_adapter(base_of(llm), tmp_path / "other", seed=4, **ADAPTER)
    manager = llm.engine.lora
    lora = LoRARequest("rewritten", 31, str(tmp_path / "a"))
    keyed = dataclasses.replace(lora, content_digest=manager.add(lora).digest)
    assert manager.add(keyed) is not None  # unchanged: served
    make_adapter(base_of(llm), tmp_path / "a", seed=9, **ADAPTER)  # new files, same folder
    manager.add(LoRARequest("evicts-it", 32, str(tmp_path / "other")))  # max_cpu_loras 1
    with pytest.raises(ValueError, match="files changed since this request was admitted"):
        manager.add(keyed)
    assert manager.add(lora).digest != keyed.content_digest  # a new request: the new content
