"""The cpu backend against the reference: decode, prefill, chunked prefill, mixes."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from kserve_paged_kernels import cpu_native, paged_attention, store_kv
from kserve_paged_kernels.cpu_backend import paged_attention_cpu, store_kv_cpu
from kserve_paged_kernels.metadata import AttentionMetadata
from kserve_paged_kernels.reference import paged_attention_ref, store_kv_ref
from kserve_paged_kernels.testing import make_case, tolerance

HEAD_RATIOS = [(4, 4), (8, 2), (9, 3), (8, 1)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]



def _torch(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs):
    """The CPU backend on raw tensors: one step's metadata built for the call."""
    meta = AttentionMetadata.build(block_tables, seq_lens, query_start_loc)
    return paged_attention_cpu(query, kv_cache, meta, scale, **kwargs)

def _batch(rng: random.Random, kind: str, n: int) -> tuple[list[int], list[int]]:
    """seq_lens and q_lens for one batch of `kind`."""
    seq_lens = [rng.randint(1, 300) for _ in range(n)]
    if kind == "decode":
        q_lens = [1] * n
    elif kind == "prefill":
        q_lens = list(seq_lens)
    elif kind == "chunked":
        q_lens = [rng.randint(1, s) for s in seq_lens]
    else:  # mixed, with an idle sequence (q_len 0) thrown in
        q_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
        q_lens[0] = 0
    return seq_lens, q_lens


@pytest.fixture(params=["native-decode", "native-all-rows", "torch-decode"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the native C kernel and through pure torch. The native kernel takes
    the decode rows only (prefill by torch: the routing without prefill tiles) or every row
    (the routing with them, every level's build: the row kernel serves prefill rows too)."""
    if request.param == "torch-decode":
        monkeypatch.setattr(cpu_native, "usable", lambda *args: False)
    else:
        monkeypatch.setattr(cpu_native, "prefill_tiles",
                            lambda: request.param == "native-all-rows")
        # gcc is part of the supported machine (README); a missing compiler must not pass
        # silently as "tested".
        assert cpu_native.load() is not None, "the native decode kernel did not build"
    return request.param


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = tolerance(dtype)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", ["decode", "prefill", "chunked", "mixed"])
@pytest.mark.parametrize("heads", HEAD_RATIOS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(kind: str, heads: tuple[int, int], dtype: torch.dtype,
                           decode_path: str) -> None:
    rng = random.Random(zlib.crc32(f"{kind}{heads}{dtype}".encode()))
    block_size = rng.choice([16, 32, 64])
    seq_lens, q_lens = _batch(rng, kind, rng.randint(1, 7))
    case = make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                     block_size=block_size, dtype=dtype, seed=rng.randint(0, 999),
                     wide_table=rng.random() < 0.5)
    ref = paged_attention_ref(*case.args())
    # A tiny decode budget forces many chunks; the default one mostly a single chunk.
    for budget in (block_size, None):
        _check(_torch(*case.args(), decode_token_budget=budget), ref, dtype)


@pytest.mark.parametrize("head_dim", [64, 68, 72, 80, 96, 128, 200, 256])
def test_head_dims(head_dim: int, decode_path: str) -> None:
    """64, 128 and 256 take the register passes; the rest the portable item, whose loops take
    whole vectors and then a scalar remainder (68 and 200 leave one at every vector width)."""
    case = make_case([1, 17, 300, 64], [1, 17, 5, 1], num_heads=4, num_kv_heads=2,
                     head_dim=head_dim, block_size=16, seed=head_dim)
    _check(paged_attention(*case.args(), backend="cpu"),
           paged_attention_ref(*case.args()), torch.float32)


@pytest.mark.parametrize("heads", [(4, 1), (3, 1), (8, 1), (2, 2), (8, 2)], ids=str)
@pytest.mark.parametrize("window", [None, 40])
def test_head_dim_256_groups(heads: tuple[int, int], window: int | None, decode_path: str):
    """Head dim 256 (Gemma-3) on the row kernel: query heads of a KV head 4 at a time (3: a
    short pass; 8: two), keys in blocks with every remainder at both widths (a 37-token
    prompt, decode rows of 1 .. 100 keys); a 3x query sharpens the softmax."""
    case = make_case([37, 1, 15, 16, 17, 31, 33, 63, 65, 100], [37] + [1] * 9, num_heads=heads[0],
                     num_kv_heads=heads[1], head_dim=256, seed=sum(heads), wide_table=True)
    case.query.mul_(3)
    _check(_torch(*case.args(), window=window),
           paged_attention_ref(*case.args(), window=window), torch.float32)


def test_padding_tokens_are_zero_and_hints_accepted() -> None:
    case = make_case([40, 3], [1, 3], num_heads=9, num_kv_heads=3, head_dim=64)
    query = torch.cat([case.query, torch.randn(2, 9, 64)])  # 2 trailing padding tokens
    args = (query, *case.args()[1:])
    out = paged_attention(*args, backend="cpu", max_seq_len=40, max_query_len=3)
    _check(out, paged_attention_ref(*args), torch.float32)
    assert out[-2:].abs().max() == 0


def test_plan_lives_with_its_step_metadata(decode_path: str, monkeypatch) -> None:
    """Layers of a step share one metadata object and build the plan once; the next step's
    metadata (the same tensors changed in place, as the runner's buffers are) gets its own."""
    import kserve_paged_kernels.cpu_backend as backend

    builds = []
    real_build = backend._build_plan
    monkeypatch.setattr(backend, "_build_plan",
                        lambda *a, **k: builds.append(1) or real_build(*a, **k))
    case = make_case([50, 70, 90], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=64)
    meta = AttentionMetadata.build(case.block_tables, case.seq_lens, case.query_start_loc)
    for _ in range(3):  # three layers of one step
        out = paged_attention_cpu(case.query, case.kv_cache, meta, case.scale)
        _check(out, paged_attention_ref(*case.args()), torch.float32)
    assert len(builds) == 1
    case.seq_lens[1] = 33  # in place, same tensor object: a new step
    _check(_torch(*case.args()), paged_attention_ref(*case.args()), torch.float32)
    case.block_tables[0, 0] = case.block_tables[2, 0]
    _check(_torch(*case.args()), paged_attention_ref(*case.args()), torch.float32)
    assert len(builds) == 3


def test_large_decode_batch_realistic_shape(decode_path: str) -> None:
    rng = random.Random(7)
    seq_lens = [rng.randint(64, 800) for _ in range(32)] + [700]
    q_lens = [1] * 32 + [200]
    case = make_case(seq_lens, q_lens, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    _check(_torch(*case.args()), paged_attention_ref(*case.args()), torch.float32)


def test_query_may_be_a_view_of_fused_qkv_rows(decode_path: str) -> None:
    """The model hands q as a strided view into its fused qkv output; rows of prefill, chunked
    prefill over a cached prefix and decode all read it in place."""
    case = make_case([90, 40, 300, 12], [90, 7, 1, 12], num_heads=9, num_kv_heads=3,
                     head_dim=64, seed=11)
    t = case.query.shape[0]
    fused = torch.randn(t, (9 + 2 * 3) * 64)
    fused[:, :9 * 64] = case.query.reshape(t, -1)
    view = fused[:, :9 * 64].view(t, 9, 64)
    assert not view.is_contiguous()
    args = (view, *case.args()[1:])
    _check(_torch(*args), paged_attention_ref(*case.args()), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv_matches_reference_and_skips_negative(dtype: torch.dtype,
                                                       contiguous: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kvh, d = 6, 16, 3, 64
    base = torch.randn(2, num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 17, 95, -7, 0, 40], dtype=torch.int64)
    key = torch.randn(len(slots), kvh, d, generator=gen).to(dtype)
    value = torch.randn(len(slots), kvh, d, generator=gen).to(dtype)
    expected = base.clone()
    store_kv_ref(key, value, expected, slots)
    cache = base.clone()
    if not contiguous:  # a strided view of a bigger allocation
        big = torch.zeros(2, num_blocks, block_size, kvh, 2 * d, dtype=dtype)
        big[..., :d] = base
        cache = big[..., :d]
    store_kv_cpu(key, value, cache, slots.int())
    assert torch.equal(cache, expected)
    cache2 = base.clone()
    store_kv(key, value, cache2, slots, backend="cpu")
    assert torch.equal(cache2, expected)
    # The negative slots' rows really were dropped: nothing else changed.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    flat_new, flat_old = cache2.view(2, -1, kvh, d), base.view(2, -1, kvh, d)
    assert torch.equal(flat_new[:, untouched], flat_old[:, untouched])


def test_store_then_attend_roundtrip() -> None:
    """store_kv then paged_attention equals plain causal attention on the unpaged tensors."""
    gen = torch.Generator().manual_seed(0)
    seq, heads, kvh, d, bs = 37, 6, 2, 64, 16
    k = torch.randn(seq, kvh, d, generator=gen)
    v = torch.randn(seq, kvh, d, generator=gen)
    q = torch.randn(seq, heads, d, generator=gen)
    cache = torch.zeros(2, 5, bs, kvh, d)
    blocks = torch.tensor([3, 0, 4], dtype=torch.int32)
    slots = blocks.long().repeat_interleave(bs)[:seq] * bs + torch.arange(seq) % bs
    store_kv(k, v, cache, slots, backend="cpu")
    out = paged_attention(q, cache, blocks.view(1, -1), torch.tensor([seq], dtype=torch.int32),
                          torch.tensor([0, seq], dtype=torch.int32), d ** -0.5, backend="cpu")
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1), (6, 2)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("block_size", [4, 16])
def test_long_prefill_runs_match_reference(head_dim: int, heads: tuple[int, int],
                                           block_size: int) -> None:
    """Prefill chunks of >= 32 rows take the native transposed-key path (csrc/paged_key_tile.c):
    runs of 31 / 32 / 33 rows, chunks over a cached prefix starting at an even and at an odd
    position (the odd one pairs a row whose keys end on a 16-key boundary with one past it),
    one far longer than a block, next to decode rows, with shuffled blocks."""
    seq_lens = [31, 32, 33, 150, 151, 290, 77]
    q_lens = [31, 32, 33, 40, 40, 290, 1]
    case = make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, seed=head_dim + block_size)
    assert cpu_native.load() is not None
    _check(_torch(*case.args()), paged_attention_ref(*case.args()), torch.float32)


@pytest.mark.parametrize("seed", range(12))
def test_decode_rows_over_a_shared_prefix_match_reference(seed: int) -> None:
    """Decode rows of different sequences whose block tables start with the same >= 8 full
    blocks (a shared prompt prefix) go through the cascade path: the prefix once for the group
    with transposed keys, then each row's own keys from the softmax state it left. Groups are
    broken by rows that do not share, and a prefill run sits among them."""
    assert cpu_native.load() is not None
    rng = random.Random(seed)
    heads = rng.choice([(9, 3), (8, 2), (4, 4), (8, 1), (32, 8)])
    head_dim, block_size = rng.choice([64, 128]), rng.choice([4, 16, 32])
    n = rng.randint(9, 24)
    prefix = rng.randint(8 * block_size, 8 * block_size + 300)
    seq_lens = [prefix + rng.randint(1, 60) for _ in range(n)]
    q_lens = [1] * n
    seq_lens.insert(n // 2, 100)
    q_lens.insert(n // 2, 40)  # a prefill run in the middle
    case = make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, block_size=block_size, seed=seed)
    full = prefix // block_size
    for i in range(1, len(seq_lens)):
        if q_lens[i] == 1 and rng.random() < 0.85:  # most rows share sequence 0's prefix
            case.block_tables[i, :full] = case.block_tables[0, :full]
    _check(_torch(*case.args()), paged_attention_ref(*case.args()), torch.float32)


# --- sliding window and soft-capping (Gemma) -------------------------------------------------

WINDOW_CASES = [  # (seq_lens, q_lens): decode, prefill, chunked past the window, idle, short
    ([1, 17, 300, 64], [1, 1, 1, 1]),
    ([5, 33, 120], [5, 33, 120]),
    ([300, 70, 40, 9], [45, 70, 1, 0]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,softcap", [(7, None), (32, None), (None, 5.0), (16, 2.0)])
@pytest.mark.parametrize("lens", WINDOW_CASES, ids=["decode", "prefill", "chunked"])
def test_window_and_softcap_match_reference(lens: tuple, window: int | None,
                                            softcap: float | None, dtype: torch.dtype,
                                            decode_path: str) -> None:
    """fp32 runs the native row kernel and the torch path (`decode_path`); bf16 is the torch
    path's either way (the native kernel is fp32 only)."""
    case = make_case(*lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=dtype, seed=len(lens[0]) + (window or 0), wide_table=True)
    case.query.mul_(4)  # large scores, so the cap bites
    out = _torch(*case.args(), window=window, softcap=softcap)
    ref = paged_attention_ref(*case.args(), window=window, softcap=softcap)
    _check(out, ref, dtype)
    if window is not None:  # the window changes the answer on these lengths
        assert not torch.allclose(ref.float(), paged_attention_ref(*case.args()).float(),
                                  atol=1e-3)


def test_one_step_metadata_serves_windowed_and_global_layers(decode_path: str) -> None:
    """Gemma alternates windowed and global layers over one step's metadata: on the torch
    path each gets its own plan, and where SDPA takes the prefill rows of the native path too;
    when the row kernel takes every row they share one (rows only). Neither disturbs the
    other's answer."""
    case = make_case([70, 40], [70, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=16, seed=3)
    meta = AttentionMetadata.build(*case.args()[2:5])
    for _ in range(2):
        full = paged_attention_cpu(case.query, case.kv_cache, meta, case.scale)
        local = paged_attention_cpu(case.query, case.kv_cache, meta, case.scale, window=8)
        _check(full, paged_attention_ref(*case.args()), torch.float32)
        _check(local, paged_attention_ref(*case.args(), window=8), torch.float32)
    assert len(meta.plan) == (1 if decode_path == "native-all-rows" else 2)


WINDOW_EDGE_CASES = [  # (seq_lens, q_lens, window, block_size, heads, kv_heads, head_dim)
    # windows ending on / starting at block boundaries, decode and a chunk
    ([64, 48, 17], [1, 16, 1], 16, 16, 8, 2, 64),
    ([96, 33], [32, 33], 32, 16, 9, 3, 64),
    # a window larger than every sequence: plain causal attention
    ([40, 7], [40, 1], 500, 16, 4, 1, 64),
    # Gemma-3-270M's attention shape (4 query heads on 1 KV head, head_dim 256), window of 1
    ([50, 30], [3, 30], 1, 32, 4, 1, 256),
    ([200, 129], [1, 65], 64, 32, 4, 1, 256),
]


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("edge", WINDOW_EDGE_CASES, ids=lambda e: f"w{e[2]}-bs{e[3]}-d{e[6]}")
def test_window_edges_match_reference(edge: tuple, softcap: float | None,
                                      decode_path: str) -> None:
    seq_lens, q_lens, window, block_size, heads, kv_heads, head_dim = edge
    case = make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=window + head_dim,
                     wide_table=True)
    case.query.mul_(3)
    out = _torch(*case.args(), window=window, softcap=softcap)
    _check(out, paged_attention_ref(*case.args(), window=window, softcap=softcap),
           torch.float32)
    if window >= max(seq_lens):
        _check(out, paged_attention_ref(*case.args(), softcap=softcap), torch.float32)


def test_blocks_outside_the_window_are_not_read(decode_path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks before the first key any new token's window reaches are filled with NaN: the
    answer stays finite and equal to the reference on a clean cache. On the native path the
    windowed, capped layer goes through the row kernel, not the torch fallback."""
    calls = []
    real = cpu_native.paged_rows
    monkeypatch.setattr(cpu_native, "paged_rows",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    window, block_size = 20, 16
    case = make_case([120, 90, 64], [1, 12, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                     block_size=block_size, seed=11, wide_table=True)
    want = paged_attention_ref(*case.args(), window=window, softcap=2.0)
    for i, (seq_len, q_len) in enumerate(zip([120, 90, 64], [1, 12, 1], strict=True)):
        first_key = seq_len - q_len - window + 1
        for b in range(first_key // block_size):  # wholly before the window
            case.kv_cache[:, case.block_tables[i, b].long()] = float("nan")
    out = _torch(*case.args(), window=window, softcap=2.0)
    assert torch.isfinite(out).all()
    _check(out, want, torch.float32)
    native = decode_path != "torch-decode"
    assert calls == ([{"window": window, "softcap": 2.0}] if native else [])


def test_reference_window_edges() -> None:
    """The reference's window: 1 key sees only itself (output = its value); a window at least
    the context is full causal attention."""
    case = make_case([20, 9], [20, 3], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4,
                     seed=5)
    one = paged_attention_ref(*case.args(), window=1)
    full = paged_attention_ref(*case.args())
    torch.testing.assert_close(paged_attention_ref(*case.args(), window=20), full)
    values = []
    for i, (seq_len, q_len) in enumerate(((20, 20), (9, 3))):
        blocks = case.block_tables[i, :-(-seq_len // 4)].long()
        v = case.kv_cache[1, blocks].reshape(-1, 2, 16)[:seq_len]
        values.append(v[seq_len - q_len:])
    torch.testing.assert_close(one, torch.cat(values))


def test_bad_window_and_softcap_are_refused() -> None:
    case = make_case([4], [4], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="window must be positive"):
        paged_attention(*case.args(), window=0)
    with pytest.raises(ValueError, match="softcap must be positive"):
        paged_attention(*case.args(), softcap=-1.0)


def test_native_kernel_refuses_a_negative_window_or_cap() -> None:
    assert cpu_native.load() is not None, "the native kernel did not build"
    case = make_case([8], [8], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    rows = torch.arange(8)
    out = torch.empty_like(case.query)
    for bad in ({"window": -1}, {"softcap": -2.0}):
        with pytest.raises(ValueError, match="outside the kernel's limits"):
            cpu_native.paged_rows(case.query, case.kv_cache, case.block_tables,
                                  torch.arange(1, 9, dtype=torch.int32), rows,
                                  torch.zeros(8, dtype=torch.long), case.scale, out, **bad)


@pytest.mark.parametrize("window", [None, 24])
def test_without_prefill_tiles_only_decode_rows_reach_the_row_kernel(
        window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step mixing decode rows, a prefill and a chunk over a cached prefix: without the
    prefill tiles the row kernel gets exactly the decode rows, SDPA the rest, and the
    answer is the reference's; with them, one call takes every row."""
    assert cpu_native.load() is not None, "the native kernel did not build"
    calls: list[int] = []
    real = cpu_native.paged_rows
    monkeypatch.setattr(cpu_native, "paged_rows",
                        lambda q, kv, bt, lens, tok, *a, **kw: calls.append(tok.tolist())
                        or real(q, kv, bt, lens, tok, *a, **kw))
    seq_lens, q_lens = [70, 40, 33, 90], [1, 40, 1, 25]
    case = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     seed=3, wide_table=True)
    want = paged_attention_ref(*case.args(), window=window)
    starts = [0, 1, 41, 42]
    for tiles, expected in ((False, [[starts[0], starts[2]]]), (True, [list(range(67))])):
        monkeypatch.setattr(cpu_native, "prefill_tiles", lambda tiles=tiles: tiles)
        calls.clear()
        _check(_torch(*case.args(), window=window), want, torch.float32)
        assert [sorted(c) for c in calls] == expected
