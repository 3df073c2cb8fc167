"""Per-request pooling options and a served model's one job, checked before anything is queued.

As in vLLM, a model has one job: a generation model answers generation requests, an embedding
or classification model pooling requests; a request of the other kind is a `WrongJobError`
(the server answers it 400, naming the model's job).
"""

from __future__ import annotations

from dataclasses import dataclass

# What a served model does: generate tokens, return a pooled embedding, or classify (scores
# and rerankers are classification of a text pair).
MODEL_JOBS = ("generate", "embed", "classify")
POOLING_JOBS = ("embed", "classify")


class WrongJobError(ValueError):
    """A request of another kind than the served model's job."""

    def __init__(self, model_job: str, asked: str) -> None:
        self.model_job, self.asked = model_job, asked
        super().__init__(f"this model's job is {model_job!r}: it does not serve {asked!r} "
                         f"requests")


@dataclass(slots=True)
class PoolingParams:
    """A pooling request's options: `task` ("embed" or "classify"); `dimensions`, the leading
    dimensions an embedding keeps (Matryoshka), normalised after the cut; `normalize`, L2
    normalisation of an embedding (None: the model's own default)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_JOBS:
            raise ValueError(f"pooling task must be one of {POOLING_JOBS} (got {self.task!r})")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer (got {d!r})")
        if d is not None and self.task != "embed":
            raise ValueError("dimensions applies to embeddings only")

    def check(self, model_job: str, hidden_size: int) -> None:
        """Raise WrongJobError for a model of another job, ValueError for dimensions past the
        model's embedding size."""
        if model_job != self.task:
            raise WrongJobError(model_job, self.task)
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions {self.dimensions} exceeds the model's embedding "
                             f"size ({hidden_size})")
