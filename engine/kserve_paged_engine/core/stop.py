"""Why a request ends with the token it just appended: the one home of the stop rules."""

from __future__ import annotations

from collections.abc import Callable

from kserve_paged_engine.core.request import Request, RequestStatus

# Told of each appended token (whether EOS or a stop token would end the request); returns the
# stop string its text now ends in, if any (the engine's detokenizer).
StopStrings = Callable[[Request, bool], str | None]


def check_stop(request: Request, token: int, stop_strings: StopStrings | None,
               max_model_len: int) -> tuple[RequestStatus | None, int | str | None]:
    """(status, stop_reason) if the request ends with `token`, else (None, None). A stop string
    wins over the token that ended the request; EOS or a stop token over length. None of the
    first three ends a request before `min_tokens` outputs (`Request.past_min_tokens`)."""
    params = request.sampling_params
    by_token: tuple[RequestStatus, int | None] | None = None
    if request.past_min_tokens:
        if (not params.ignore_eos and request.eos_token_id is not None
                and token == request.eos_token_id):
            by_token = (RequestStatus.FINISHED_STOPPED, None)
        elif token in params.stop_token_ids:
            by_token = (RequestStatus.FINISHED_STOPPED, token)
    text_stop = stop_strings(request, by_token is not None) if stop_strings else None
    if text_stop is not None:
        return RequestStatus.FINISHED_STOPPED, text_stop
    if by_token is not None:
        return by_token
    if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
