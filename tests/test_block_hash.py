"""Prefix-cache block keys against vLLM's definition (engine/kserve_paged_engine/core/block_hash.py).

The expected values are computed here from the definition itself, with hashlib, pickle and cbor2
(and, for one block, CBOR bytes written out by hand), never with the engine's hasher: a key is
H((parent key, tuple of the block's token ids, extra keys or None)), the first parent is
H(PYTHONHASHSEED), extra keys are the adapter on every block then the cache salt on the first.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from kserve_paged_engine.core.block_hash import BlockHasher, external_block_hash
from kserve_paged_engine.core.kv_cache_manager import KVCacheManager
from kserve_paged_engine.lora.request import LoRARequest
from tests.helpers.core import make_request

SEED = "42"
BS = 4
TOKENS = [1, 2, 3, 4, 23, 24, 255, 256, 65535, 65536, 100_000, 0, 7]  # 3 full blocks


def cbor_h(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def pickle_h(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def chain(h, tokens: list[int], extras: list | None = None) -> list[bytes]:
    """The definition: each full block keyed by its parent, its tokens and its extra keys."""
    parent = h(SEED)
    out = []
    for i in range(len(tokens) // BS):
        extra = extras[i] if extras else None
        parent = h((parent, tuple(tokens[i * BS:(i + 1) * BS]), extra))
        out.append(parent)
    return out


def manager_chain(monkeypatch, algo: str, *, salt=None, lora=None) -> list[bytes]:
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    kv = KVCacheManager(16, BS, hash_algo=algo)
    req = make_request("r", TOKENS, salt=salt)
    req.lora_request = lora
    kv.find_prefix(req)
    return req.block_hashes


def test_sha256_cbor_keys_are_vllms(monkeypatch):
    assert manager_chain(monkeypatch, "sha256_cbor") == chain(cbor_h, TOKENS)


def test_sha256_cbor_bytes_written_out_by_hand():
    """The first block's CBOR, byte by byte, as any canonical encoder (Go's fxamacker/cbor in
    llm-d) writes it: array(3), bytes(32) root, array(4) of uints in their shortest form, null."""
    root = hashlib.sha256(b"\x62" + SEED.encode()).digest()  # text(2) "42"
    assert BlockHasher("sha256_cbor", SEED).root == root
    block = (b"\x83" + b"\x58\x20" + root
             + b"\x84" + b"\x18\x64" + b"\x19\x01\x00" + b"\x1a\x00\x01\x86\xa0" + b"\x17"
             + b"\xf6")
    assert BlockHasher("sha256_cbor", SEED)(None, [100, 256, 100_000, 23]) == \
        hashlib.sha256(block).digest()


def test_default_sha256_is_vllms_pickle_hash(monkeypatch):
    assert manager_chain(monkeypatch, "sha256") == chain(pickle_h, TOKENS)


def test_the_seed_sets_the_root_and_unset_is_random(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    a, b = BlockHasher("sha256_cbor"), BlockHasher("sha256_cbor")
    assert a.root == b.root == cbor_h(SEED) and a(None, [5]) == b(None, [5])
    assert BlockHasher("sha256_cbor", "43").root != a.root
    monkeypatch.delenv("PYTHONHASHSEED")
    c, d = BlockHasher("sha256_cbor"), BlockHasher("sha256_cbor")
    assert c.seed is None and c.root != d.root and c(None, [5]) != d(None, [5])


def test_cache_salt_keys_the_first_block_and_so_the_chain(monkeypatch):
    salted = manager_chain(monkeypatch, "sha256_cbor", salt="tenant-a")
    assert salted == chain(cbor_h, TOKENS, [("tenant-a",), None, None])
    plain = chain(cbor_h, TOKENS)
    assert all(s != p for s, p in zip(salted, plain))
    assert manager_chain(monkeypatch, "sha256_cbor", salt="tenant-b")[0] != salted[0]


def test_lora_adapter_keys_every_block(monkeypatch):
    lora = LoRARequest("sql", 3, "/adapters/sql")
    keyed = manager_chain(monkeypatch, "sha256_cbor", lora=lora)
    assert keyed == chain(cbor_h, TOKENS, [(3,), (3,), (3,)])
    both = manager_chain(monkeypatch, "sha256_cbor", lora=lora, salt="s")
    assert both == chain(cbor_h, TOKENS, [(3, "s"), (3,), (3,)])
    other = manager_chain(monkeypatch, "sha256_cbor", lora=LoRARequest("sql", 4, "/x"))
    assert not set(other) & set(keyed)  # a reload (new id) never hits the old weights' blocks


def test_events_carry_the_low_64_bits():
    h = BlockHasher("sha256_cbor", SEED)(None, [1, 2, 3, 4])
    assert external_block_hash(h) == int.from_bytes(h, "big") & (2**64 - 1) < 2**64


def test_unknown_algorithm_is_refused():
    from kserve_paged.args import parse_args
    from kserve_paged_engine.config.engine import EngineConfig

    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        BlockHasher("xxhash")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig(prefix_caching_hash_algo="builtin")
    assert parse_args([]).prefix_caching_hash_algo == "sha256"
    assert parse_args(["--prefix_caching_hash_algo", "sha256_cbor"]).prefix_caching_hash_algo \
        == "sha256_cbor"
    with pytest.raises(SystemExit):
        parse_args(["--prefix_caching_hash_algo", "md5"])
