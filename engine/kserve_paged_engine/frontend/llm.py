"""The offline API: `LLM(...).generate(prompts, params)` runs requests to completion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kserve_paged_engine.config.engine import EngineConfig
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.outputs import RequestOutput
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        # Offline runs measure throughput: the KV cache's leading pages are resident before
        # the first request (the server answers ready without waiting: worker/kv_prefault.py).
        prefault = getattr(self.engine.runner, "prefault", None)
        if prefault is not None:
            prefault.wait()

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = self.engine.next_request_id()
                self.engine.add_request(rid, prompt, p,
                                        priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: bad input leaves nothing queued
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = False
              ) -> list[RequestOutput]:
        """Embed every prompt (an embedding model's job); each output's `pooled` is its
        embedding, in prompt order."""
        return self._pool(prompts, pooling_params or PoolingParams(task="embed"), use_tqdm)

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Classify every prompt (a classification model's job); each output's `pooled` is
        its logits over the model's labels."""
        return self._pool(prompts, PoolingParams(task="classify"), use_tqdm)

    def _pool(self, prompts: Prompt | Sequence[Prompt], params: PoolingParams,
              use_tqdm: bool) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt in _prompt_list(prompts):
                rid = self.engine.next_request_id()
                self.engine.add_request(rid, prompt, pooling_params=params)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing, as generate
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int,
                    max_tokens: int = 16, *, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    num_return: int | None = None, use_tqdm: bool = False
                    ) -> list[RequestOutput]:
        """Beam search in the engine (beams fork and prune shared blocks), as transformers'
        `generate(num_beams=beam_width, do_sample=False)` defines it; each output lists the
        `num_return` (default all) best hypotheses, best first, with `score` and
        `cumulative_logprob` set."""
        params = SamplingParams(n=num_return or beam_width, best_of=beam_width,
                                use_beam_search=True, max_tokens=max_tokens,
                                length_penalty=length_penalty, early_stopping=early_stopping,
                                ignore_eos=ignore_eos, temperature=0.0)
        return self.generate(prompts, params, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        text = tok.apply_chat_template(conversation, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        return list(tok.encode(text, add_special_tokens=False))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests vanished without output: {sorted(pending)}")
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
