"""Bodies of the pooling routes, as OpenAI (embeddings), Jina/Cohere (rerank) and vLLM (score,
classify) spell them; a field of the wrong type or out of range is a 400 before any work."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

Texts = StrictStr | list[StrictStr]
# OpenAI's input: a string, strings, token ids, or lists of token ids.
EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not read
    model: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:  # parse_body's hook: nothing refused
        return []


class EmbeddingBody(_Body):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None  # vLLM's extra: None is the model's own default
    user: str | None = None


class RerankBody(_Body):
    query: StrictStr
    documents: list[StrictStr] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class ScoreBody(_Body):
    """vLLM's `queries`/`documents` or the older `text_1`/`text_2`: one text against one or
    many, or many against as many (pairwise)."""

    queries: Texts | None = None
    documents: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None


class ClassifyBody(_Body):
    input: Texts
