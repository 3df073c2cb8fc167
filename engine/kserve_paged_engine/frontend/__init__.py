"""The engine's front: LLM (offline) and AsyncLLM (the server's) with the engine thread, and
LLMEngine's step with the stages it runs in order (inputs, the sample stage, the stop check,
outputs), forks and beam search, the detokenizer, start-up. Everything below it is imported from
here; nothing below imports it (tests/test_import_layers.py)."""
