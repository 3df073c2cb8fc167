"""A request's state as the scheduler and KV-cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kserve_paged_engine.limits import EMPTY_PROMPT, past_min_tokens
from kserve_paged_engine.lora.request import LoRARequest
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sample.structured_output import RequestGrammar
from kserve_paged_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0  # lower value is served first, as in vLLM
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first schedule (for outputs and metrics).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Forks (n > 1 samples, beams) carry the id of the first request of them, the one the others
    # forked from: they share blocks, so preempting one preempts all (Scheduler.schedule).
    fork_root: str | None = None
    # Chained block hashes of this request's full blocks, grown as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # When the scheduler first admitted it (monotonic seconds, as `arrival_time`): the one home
    # of both; the token times are the output processor's (RequestOutput.metrics copies all).
    first_scheduled_time: float | None = None
    # The constraint's matcher (structured outputs); the scheduler skips the request while
    # its grammar compiles.
    grammar: RequestGrammar | None = None
    # Draft tokens proposed for the next step (speculative decoding); never part of the
    # request's tokens until verified.
    spec_token_ids: list[int] = field(default_factory=list)
    # A pooling request (embedding, classification): its prompt is computed and pooled, nothing
    # sampled (its sampling params say max_tokens=0).
    pooling_params: PoolingParams | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:  # an invariant of every request the scheduler holds
            raise ValueError(EMPTY_PROMPT)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def past_min_tokens(self) -> bool:
        """Whether stop tokens and strings may end the request now (see kserve_paged_engine.limits)."""
        return past_min_tokens(len(self.output_token_ids), self.sampling_params.min_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def common_prefix_len(self, other: Request) -> int:
        """How many leading tokens this request and `other` (of the same prompt) share."""
        if self.prompt_token_ids != other.prompt_token_ids:
            return 0
        n = 0
        for a, b in zip(self.output_token_ids, other.output_token_ids):
            if a != b:
                break
            n += 1
        return len(self.prompt_token_ids) + n

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 62

    @property
    def wants_token(self) -> bool:
        """Whether computing to the end samples a token: not for max_tokens=0 (prompt
        scoring), which ends once its prompt is computed."""
        return self.num_output_tokens < self.max_tokens

    @property
    def prompt_done_status(self) -> RequestStatus:
        """How a request that samples nothing ends once its prompt is computed: a pooling
        request "stop" (as vLLM reports them), prompt scoring (max_tokens=0) "length"."""
        if self.pooling_params is not None:
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.status.finished:
            return self.status.value
        return None
