"""Speculative decoding: proposers guess the next tokens, one forward verifies them.

`config.SpeculativeConfig` is the flag, `ngram.NgramProposer` the prompt-lookup proposer,
`draft_model.DraftModelProposer` the draft-model proposer (its own runner and paged KV cache),
`rejection.py` the verification rules (greedy and rejection sampling) and `decoder.SpecDecoder`
the engine's glue: who speculates, what a verified step appends, when to stop proposing.
"""

from kserve_paged_engine.config.speculative import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
