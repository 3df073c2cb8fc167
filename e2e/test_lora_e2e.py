"""Multi-LoRA through the real server process: the default model with random rank-8 PEFT
adapters, called by the OpenAI client concurrently with the base model, one adapter loaded and
unloaded at run time; prefix-cache hits never cross adapters (the metric shows it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch

from kserve_paged_engine.frontend.default_model import ensure_default_model
from tests.helpers.e2e_server import MODEL, running_server, scrape

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
          "changed how books were made and read across Europe. Explain why:")
NEW = 12


def _adapter(base: Path, folder: Path, seed: int, targets: list[str]) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                    target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    base = Path(ensure_default_model(progress=lambda _: None))
    root = tmp_path_factory.mktemp("e2e-lora")
    return {"a1": _adapter(base, root / "a1", 1, ["q_proj", "v_proj", "o_proj"]),
            "a2": _adapter(base, root / "a2", 2, ["gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def reference(adapters) -> dict[str | None, str]:
    """transformers (+ PEFT) greedy text of PROMPT per adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = Path(ensure_default_model(progress=lambda _: None))
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    ids = torch.tensor([tok.encode(PROMPT)])
    out: dict[str | None, str] = {}
    for name in (None, "a1", "a2"):
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                     dtype=torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        model.generation_config.eos_token_id = None
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
        out[name] = tok.decode(gen[0, ids.shape[1]:])
    return out


def test_two_adapters_and_the_base_concurrently_with_runtime_load(adapters, reference):
    assert len(set(reference.values())) == 3
    extra = ["--lora_modules", f"a1={adapters['a1']}", "--enable_lora_runtime_updates",
             "--max_loras", "2", "--lora_roots", str(adapters["a2"].parent)]
    with running_server(extra) as srv:
        def client() -> openai.AsyncOpenAI:  # one per asyncio.run: its pool is loop-bound
            return openai.AsyncOpenAI(base_url=f"{srv.url}/openai/v1", api_key="unused",
                                      timeout=120, max_retries=0)

        r = httpx.post(f"{srv.url}/openai/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert r.status_code == 200, r.text
        models = {m.id: getattr(m, "parent", None) for m in asyncio.run(_list(client()))}
        assert models == {MODEL: None, "a1": MODEL, "a2": MODEL}

        async def one(model: str, c: openai.AsyncOpenAI | None = None) -> str:
            c = await (c or client()).completions.create(model=model, prompt=PROMPT, max_tokens=NEW,
                                                temperature=0, extra_body={"ignore_eos": True})
            return c.choices[0].text

        async def all_at_once() -> list[str]:
            shared = client()
            return await asyncio.gather(*(one(m, shared) for m in ("a1", MODEL, "a2")))

        hits0 = scrape(srv).get("vllm:prefix_cache_hits_total", 0.0)
        assert asyncio.run(all_at_once()) == [reference["a1"], reference[None], reference["a2"]]
        # Same prompt under three names, each computed once: no hit crossed adapters.
        assert scrape(srv).get("vllm:prefix_cache_hits_total", 0.0) == hits0
        assert asyncio.run(one("a1")) == reference["a1"]
        assert scrape(srv)["vllm:prefix_cache_hits_total"] > hits0  # its own prefix hits

        r = httpx.post(f"{srv.url}/openai/v1/unload_lora_adapter", timeout=60,
                       json={"lora_name": "a2"})
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            asyncio.run(one("a2"))


async def _list(client: openai.AsyncOpenAI) -> list:
    return [m async for m in client.models.list()]
