"""Request limits: the one place their numbers live.

Why one module: SamplingParams validates against these, the server's parsers refuse against
them before anything is queued, and the published OpenAPI schema takes its minimum/maximum from
them, so the three can never disagree. Engine-side, because the engine is what they protect.
"""

from __future__ import annotations

MIN_N, MAX_N = 1, 128  # samples per prompt
MIN_LOGPROBS, MAX_LOGPROBS = 0, 20  # top log-probabilities per token (and per prompt token)
# Output budget; the upper bound is what the context window leaves. 0 scores the prompt only
# (prompt logprobs, echo), which evaluation harnesses ask for.
MIN_MAX_TOKENS = 0
MIN_MIN_TOKENS = 0
MIN_TEMPERATURE = 0.0
TOP_P_RANGE = (0.0, 1.0)  # exclusive below, inclusive above: (0, 1]
MIN_P_RANGE = (0.0, 1.0)  # inclusive: [0, 1]
MIN_TOP_K = -1  # -1 and 0 both mean off
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, inclusive
REPETITION_PENALTY_RANGE = (0.0, 100.0)  # exclusive below, inclusive above: (0, 100]
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range for one bias value, inclusive

# A prompt longer than this many characters per token of the context window cannot fit, so it
# is refused before it is tokenized (tokenizing 20 MB takes seconds). Generous on purpose: a
# token of real text is 3-5 characters, and a repeated character still merges into tokens of
# at most a few dozen; refusing a prompt that would fit is the error to avoid.
PROMPT_CHARS_PER_TOKEN = 64
# The largest inference request body (any protocol) read before it is refused with 413.
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
# A large body is parsed in the body decoder's child process (kserve_paged/body_decode.py),
# which is killed, and the request refused with 413, when it has not answered within
# body_decode_seconds(). Generous on purpose: the child parses even the slowest JSON shapes
# (long arrays of floats) many times faster than BODY_DECODE_BYTES_PER_S on one idle core, so
# a legitimate body under any --max_request_bytes meets its bound. The bound counts the child's
# CPU time, so a busy server that leaves the child (at nice 19) little CPU delays a parse but
# does not refuse it. What meets it is a parse gone pathological, or a child that hangs without
# using CPU, killed on the clock at BODY_DECODE_WALL_FACTOR times the bound; either would
# otherwise hold that request and every large body queued behind it.
BODY_DECODE_BASE_S = 30.0  # also the bound on the child's start
BODY_DECODE_BYTES_PER_S = 1 << 20
BODY_DECODE_WALL_FACTOR = 10.0


def body_decode_seconds(num_bytes: int) -> float:
    """How long the body decoder's child may take over a body of ``num_bytes`` (grows with
    the body, so raising --max_request_bytes needs no second setting)."""
    return BODY_DECODE_BASE_S + num_bytes / BODY_DECODE_BYTES_PER_S


# -- per-request cost (issue 49): the client lists the engine works through ----------------------
# Each is a server flag (kserve_paged/request_caps.py), refused with a 400 naming it before the
# list is read. vLLM has none of these caps; each default is far above what a real request
# sends, and the engine's per-step work no longer grows with the lists either way
# (engine/kserve_paged_engine/sample/token_filters.py).
# allowed_token_ids: the model's vocabulary size (a longer list repeats ids); this many where
# the vocabulary is not known (Gemma 3's, the largest served).
DEFAULT_MAX_ALLOWED_TOKEN_IDS = 1 << 18
DEFAULT_MAX_BAD_WORDS = 1024
DEFAULT_MAX_STOP = 256  # stop strings, and stop token ids (OpenAI takes 4 stop strings)
DEFAULT_MAX_PROMPTS = 1024  # prompts in one completions or v2 request
# All of a request's bad words together, in characters: they are tokenized on the engine
# thread when the request is admitted.
MAX_BAD_WORDS_CHARS = 64 << 10

EMPTY_PROMPT = "the prompt is empty: at least one token is required"


def max_prompt_chars(max_model_len: int) -> int:
    """The longest prompt text worth tokenizing for a context window of ``max_model_len``."""
    return max_model_len * PROMPT_CHARS_PER_TOKEN


def prompt_too_long(num_chars: int, limit: int) -> str:
    """The refusal for a prompt text over ``limit`` characters (checked before tokenizing)."""
    return (f"the prompt has {num_chars} characters, more than this server tokenizes "
            f"({limit}): it cannot fit the model's context window. Shorten the prompt.")


def request_id_in_use(request_id: str) -> str:
    """The refusal of a request id that names a live request. The engine loop, the input
    processor and the scheduler each refuse one; one wording, so callers and tests match one."""
    return f"request id {request_id!r} is already in use"


def check_prompt_ids(token_ids: list[int], vocab_size: int | None) -> None:
    """The one check of a prompt's token ids: not empty, every id in the vocabulary.
    Raises ValueError; the engine and the server's parsers both call it."""
    if not token_ids:
        raise ValueError(EMPTY_PROMPT)
    if set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and (
            vocab_size is None or max(token_ids) < vocab_size):
        return  # C-speed passes; the loop below only finds the first bad id to name it
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (
                vocab_size is not None and t >= vocab_size):
            raise ValueError(f"token id {t!r} is out of range for this model"
                             + (f" (vocabulary size {vocab_size})" if vocab_size else ""))


def past_min_tokens(num_output_tokens: int, min_tokens: int) -> bool:
    """The one min_tokens rule: once a request has ``min_tokens`` outputs, its EOS, stop
    tokens and stop strings may end it. The sampler asks before a step (with the outputs so
    far: under it, EOS and stop tokens are banned), the stop checks after it."""
    return num_output_tokens >= min_tokens


# -- structured outputs and tools (issue 37 part 2): refused before anything is compiled -------
# Each bound is far above what a real request needs and well below what makes xgrammar slow:
# compiling a schema costs about the square of its nesting (60 levels: 0.3 s, 500: 10 s and
# a RecursionError), a repetition about its count ([a-z]{1,1000}: 2.5 s).
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays in a JSON schema document (~30 object levels)
MAX_SCHEMA_BYTES = 256 << 10  # a JSON schema, serialized; also a tool's parameters
MAX_ENUM_VALUES = 4096  # one enum; also the choices of a choice constraint
MAX_REGEX_CHARS = 16 << 10
MAX_GRAMMAR_CHARS = 64 << 10  # EBNF or Lark text
MAX_TOOLS = 128  # OpenAI's own limit on tools per request
# JSON the server parses out of a request field (a tool call's `arguments` text, a tool_use
# block's `input`, a v2 schema sent as text): deeper is a 400 before it is parsed further or
# rendered (kserve_paged/json_depth.py). Above MAX_SCHEMA_DEPTH, so a schema sent as text
# meets the schema's own bound.
MAX_JSON_DEPTH = 128
# Compiling one grammar against the tokenizer runs in a worker process killed at this many
# seconds (the server's default; --max_grammar_compile_s); offline, unbounded.
DEFAULT_MAX_GRAMMAR_COMPILE_S = 10.0
# Compiled grammars kept for reuse, by their size in memory (one simple JSON schema compiled
# for a 49k vocabulary takes ~4 MB: its token-mask cache).
GRAMMAR_CACHE_BYTES = 256 << 20


def check_schema_shape(schema: object, what: str = "the JSON schema") -> None:
    """Refuse (ValueError) a schema nested deeper than MAX_SCHEMA_DEPTH or with an enum over
    MAX_ENUM_VALUES, walking it without recursion (a deep one must not overflow the stack)."""
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{what} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_ENUM_VALUES:
                raise ValueError(f"{what} has an enum of {len(enum)} values, more than "
                                 f"{MAX_ENUM_VALUES}")
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def check_text_size(text: str, limit: int, what: str) -> None:
    if len(text) > limit:
        raise ValueError(f"{what} has {len(text)} characters, more than {limit}")
GRAMMAR_CACHE_ENTRIES = 1024  # and at most this many entries (failures and compiles in flight)

# -- admission (issue 37 part 3) -----------------------------------------------------------------
MAX_REQUEST_TIMEOUT_S = 86400.0  # the longest deadline a request may ask for (a day)
QUEUE_FULL_RETRY_AFTER_S = 1  # Retry-After of a 429 for a full waiting queue
