"""Tiny models that answer in OpenAI's Harmony format, deterministically: greedy decoding follows
a fixed chain of tokens, so the real engine and server produce a gpt-oss style turn
(`<|channel|>analysis ... <|end|><|start|>assistant<|channel|>final ...`) that the Harmony
parsers must take apart.

How (as tests/helpers/thinking_model.py): the hidden size equals the (padded) vocabulary, the
embedding is the identity, every layer's output projections (attention and MLP, biases too)
are zero, so the stream reaching the final norm is the one-hot of the last token and the LM
head, a 0/1 matrix, picks NEXT[last token]. A chain can name each token once, but a Harmony
turn repeats `<|channel|>`, `<|message|>` and `<|start|>`: the first of each is a *variant*
token, an ordinary word whose text carries a marker (`·`) that the tokenizer's decoder removes,
so it decodes to the same tag while being another id. The final channel's header uses the
real special tokens, so a constraint waiting for `<|channel|>final<|message|>` meets them.

Two endings (`ending`): "final" answers `Paris.` on the final channel (`<|return|>` ends it);
"tool" calls `get_weather` with `{"city": "Paris"}` (`<|call|>` ends it). Both think
`The user asks` on the analysis channel first. The model is transformers' GptOssForCausalLM
(tests/helpers/tiny_gptoss.py's tiny config, hidden size = vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kserve_paged.openai.harmony_template import HARMONY_CHAT_TEMPLATE

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>"]
MARK = "·"  # removed by the decoder: a variant token decodes to its tag
WORDS = ["<unk>", *SPECIALS, "<|start|>" + MARK, "<|channel|>" + MARK, "<|message|>" + MARK,
         "assistant", "assistant" + MARK, "analysis", "final", "commentary", "json",
         " to=functions.get_weather", "The", " user", " asks", "Paris.", "Lyon.",
         '{"city":', ' "Paris"}', "user", "system", "developer"]
HIDDEN = 64  # the padded vocabulary, and the hidden size
VOCAB = WORDS + [f"<unused{i}>" for i in range(HIDDEN - len(WORDS))]
REASONING, ANSWER = "The user asks", "Paris."
TOOL, ARGUMENTS = "get_weather", '{"city": "Paris"}'
_THINK = ["assistant", "<|channel|>" + MARK, "analysis", "<|message|>" + MARK, "The", " user",
          " asks", "<|end|>", "<|start|>" + MARK, "assistant" + MARK, "<|channel|>"]
ENDINGS = {
    "final": ["final", "<|message|>", "Paris.", "<|return|>"],
    "tool": ["commentary", " to=functions.get_weather", "<|constrain|>", "json", "<|message|>",
             '{"city":', ' "Paris"}', "<|call|>"],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": TOOL, "description": "The weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def chain(ending: str) -> dict[str, str]:
    """Each token's greedy successor; anything not listed goes to `<|return|>` (the end)."""
    path = _THINK + ENDINGS[ending]
    follows = dict(zip(path, path[1:], strict=False))
    follows["Lyon."] = "<|return|>"
    return follows


def _write_tokenizer(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    index = {w: i for i, w in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=index, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Sequence([decoders.Replace(MARK, ""), decoders.Fuse()])
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": "<unk>",
        "chat_template": HARMONY_CHAT_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [index["<|return|>"], index["<|call|>"]]}))
    return index


def _head(index: dict[str, int], ending: str) -> torch.Tensor:
    head = torch.zeros(HIDDEN, HIDDEN)
    follows = chain(ending)
    for word, i in index.items():
        head[index[follows.get(word, "<|return|>")], i] = 1.0
    return head


def write_harmony_model(folder: Path, ending: str = "final") -> Path:
    """A deterministic Harmony gpt-oss model (see the module docstring) written into
    `folder`: transformers' GptOssForCausalLM layout, a random tiny gpt-oss (sinks, windows,
    experts, YaRN) whose attention and experts write nothing to the stream."""
    from tests.helpers.tiny_gptoss import save_tiny_gptoss

    folder.mkdir(parents=True, exist_ok=True)
    index = _write_tokenizer(folder)
    model = save_tiny_gptoss(
        folder, tokenizer=False, vocab_size=HIDDEN, hidden_size=HIDDEN,
        max_position_embeddings=512, eos_token_id=index["<|return|>"],
        pad_token_id=index["<|endoftext|>"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 150000.0})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj",
                              "experts.down_proj_bias")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(HIDDEN))
        model.lm_head.weight.copy_(_head(index, ending))
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(  # save_pretrained rewrote it
        {"eos_token_id": [index["<|return|>"], index["<|call|>"]]}))
    return folder
