"""logit_bias, allowed_token_ids and bad words in the form a step applies in time that does
not grow with the client's lists.

Why: the lists come from the client and may be as long as a request body allows; applied from
the lists every step, a long one made every other request of the batch wait (issue 49). So a
request's lists are prepared once, at its first step, into:

- one additive row `[V]`: each logit_bias value at its token, -inf at every token outside
  allowed_token_ids and at every one-token bad word. A step adds it to the request's row:
  O(V), like the softmax after it, whatever the lists' lengths;
- the bad words of several tokens as a trie of their leading tokens read backwards (the
  word's last token but one at the top), each node holding the last tokens of the words whose
  leading tokens end there (`BadWordTrie`). A step walks the output backwards from its end
  only while some word's tokens still match, and bans what the nodes it reaches hold: its cost
  is the tokens that match and the tokens banned, not the number of words.

The prepared form is kept where every copy of the request's SamplingParams finds it
(`SamplingParams.shared`: its n samples, the prompts of one server request), so it is built
once per request, and the bad words are tokenized once (`admit`). A request's lists must not
change once it has been admitted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kserve_paged_engine.model_executor.host_io import upload


@dataclass(slots=True)
class BadWordTrie:
    """The bad words of two tokens or more: a trie of their leading tokens read backwards.
    Node 0 is the root; `edges[node * stride + token]` is the node the token before leads to,
    and `bans[node]` the last tokens of the words whose leading tokens end at that node. Flat
    dicts of ints: building it for many words allocates no object per node (nothing for the
    garbage collector to walk)."""

    edges: dict[int, int]
    bans: dict[int, list[int]]
    stride: int  # above every token id in `edges`

    @classmethod
    def of(cls, words: Sequence[Sequence[int]], vocab: int) -> BadWordTrie | None:
        """None when no word has two tokens (with its last one in the vocabulary)."""
        kept = [w for w in words if len(w) > 1 and w[-1] < vocab]
        if not kept:
            return None
        trie = cls({}, {}, 1 + max(max(w[:-1]) for w in kept))
        nodes = 1
        for word in kept:
            node = 0
            for position in range(len(word) - 2, -1, -1):
                key = node * trie.stride + word[position]
                child = trie.edges.get(key)
                if child is None:
                    child = trie.edges[key] = nodes
                    nodes += 1
                node = child
            trie.bans.setdefault(node, []).append(word[-1])
        return trie

    def banned(self, output_ids: Sequence[int]) -> list[int]:
        """The tokens that would complete a word after `output_ids`: the output is read
        backwards only while some word's leading tokens still match."""
        banned: list[int] = []
        node: int | None = 0
        for position in range(len(output_ids) - 1, -1, -1):
            token = output_ids[position]
            if token >= self.stride:
                break
            node = self.edges.get(node * self.stride + token)
            if node is None:
                break
            banned.extend(self.bans.get(node, ()))
        return banned


@dataclass(slots=True)
class PreparedFilter:
    """One request's filters for one vocabulary size, device and dtype."""

    addend: torch.Tensor | None  # [V], added to the row; None: nothing to add
    words: BadWordTrie | None  # the bad words of two tokens or more; None: none

    def apply(self, row: torch.Tensor, output_ids: Sequence[int]) -> None:
        """Filter one row of logits in place, given the request's output so far."""
        if self.addend is not None:
            row += self.addend
        if self.words is not None:
            banned = self.words.banned(output_ids)
            if banned:
                row[upload(banned, torch.long, row.device)] = float("-inf")


def prepare(allowed: Sequence[int] | None, logit_bias: Mapping[int, float] | None,
            words: Sequence[Sequence[int]], vocab: int, device: torch.device,
            dtype: torch.dtype) -> PreparedFilter:
    """The prepared form of the lists for a vocabulary of `vocab` tokens (ids past it are
    ignored, as vLLM does). O(V + the lists' lengths), once."""
    addend = None
    if allowed is not None or logit_bias or any(len(w) == 1 for w in words):
        addend = torch.zeros(vocab, dtype=dtype)
        if logit_bias:
            ids = torch.tensor(list(logit_bias.keys()), dtype=torch.long)
            values = torch.tensor(list(logit_bias.values()), dtype=dtype)
            inside = ids < vocab
            addend[ids[inside]] = values[inside]
        if allowed is not None:
            keep = torch.zeros(vocab, dtype=torch.bool)
            ids = torch.as_tensor(allowed, dtype=torch.long)
            keep[ids[ids < vocab]] = True
            addend.masked_fill_(~keep, float("-inf"))
        single = [w[0] for w in words if len(w) == 1 and w[0] < vocab]
        if single:
            addend[torch.tensor(single, dtype=torch.long)] = float("-inf")
        addend = addend.to(device)
    return PreparedFilter(addend, BadWordTrie.of(words, vocab))


def admit(params: Any, vocab_size: int, tokenizer: Any) -> None:
    """At admission (the engine's input processor), once for all copies of a request's
    SamplingParams: its allowed ids checked against the vocabulary (ValueError), its bad words
    tokenized into `params.bad_words_token_ids`."""
    shared = params.shared.entries
    if params.allowed_token_ids and shared.get("allowed_checked") != vocab_size:
        if max(params.allowed_token_ids) >= vocab_size:
            bad = [t for t in params.allowed_token_ids if t >= vocab_size][:5]
            raise ValueError(f"allowed_token_ids: {bad} out of the vocabulary "
                             f"({vocab_size} tokens)")
        shared["allowed_checked"] = vocab_size
    if params.bad_words and not params.bad_words_token_ids:
        words = shared.get("bad_words_token_ids")
        if words is None:
            words = shared["bad_words_token_ids"] = bad_words_token_ids(params.bad_words,
                                                                        tokenizer)
        params.bad_words_token_ids = words


def prepared(params: Any, vocab: int, device: torch.device, dtype: torch.dtype
             ) -> PreparedFilter:
    """The request's prepared filter for this vocabulary size, device and dtype: made at its
    first step, then shared by every copy of its SamplingParams."""
    key = ("token_filter", vocab, device, dtype)
    shared = params.shared.entries
    found = shared.get(key)
    if found is None:
        found = shared[key] = prepare(params.allowed_token_ids, params.logit_bias,
                                      params.bad_words_token_ids, vocab, device, dtype)
    return found


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each bad word's token sequences (vLLM's rule): the word as written at the start of the
    text, and after a space when that tokenizes to a different first token with as many
    tokens (a word in mid-text)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out
