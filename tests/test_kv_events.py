"""KV-cache events (engine/kserve_paged_engine/core/kv_events.py) received by a plain ZMQ subscriber.

The subscriber keeps a mirror of the publishing engine's prefix-cache index from nothing but the
messages: BlockStored adds hashes, BlockRemoved takes them away, AllBlocksCleared empties it.
After every engine step the mirror must equal the pool's own index, and no hash may be stored
while already announced or removed while not: so every stored and every evicted block was
announced exactly once, and in order. Sequence numbers must count up from 0 without a gap.
"""

from __future__ import annotations

import hashlib
import time

import cbor2
import msgpack
import pytest
import zmq

from kserve_paged_engine.config.kv_events import KVEventsConfig
from kserve_paged_engine.core.block_hash import external_block_hash
from kserve_paged_engine.core.kv_event_publisher import ZmqEventPublisher
from tests.helpers.core import apply_step, fake_step, make_request, make_scheduler

TOPIC = "kv@test-pod@smol"


class Mirror:
    """A plain SUB socket and the index a router would build from what it receives."""

    def __init__(self, endpoint: str, topic: str = TOPIC, bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic.encode()
        self.live: dict[int, list[int]] = {}  # 64-bit hash -> its block's token ids
        self.parents: dict[int, int | None] = {}  # 64-bit hash -> its parent's
        self.next_seq = 0
        self.stored = self.removed = self.cleared = 0
        if bind:  # as llm-d's endpoint picker: the pods connect to it
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
            self.joined()

    def joined(self) -> None:
        """ZMQ's slow joiner: wait until the subscription reached the PUB socket. The SUB side
        attaches a new connection (and sends it the subscription) only inside its own socket
        calls, so poll meanwhile, as a subscriber's event loop does."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert not self.sub.poll(20), "a message before anything was published"

    def drain(self, expect_messages: int) -> None:
        for _ in range(expect_messages):
            assert self.sub.poll(5000), f"message {self.next_seq} never arrived"
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            assert int.from_bytes(seq, "big") == self.next_seq, "gap or reordering"
            self.next_seq += 1
            self.apply(msgpack.unpackb(payload, raw=False))
        assert not self.sub.poll(50), "more messages than batches published"

    def apply(self, batch: list) -> None:
        ts, events = batch
        assert isinstance(ts, float) and events
        for event in events:
            kind = event[0]
            if kind == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium = event
                assert lora_id is None and medium in ("CPU", "GPU")
                assert len(tokens) == len(hashes) * block_size
                assert parent is None or 0 <= parent < 2**64  # vLLM's default: 64-bit ints
                for i, h in enumerate(hashes):
                    assert 0 <= h < 2**64
                    assert h not in self.live, "a block announced twice"
                    self.live[h] = tokens[i * block_size:(i + 1) * block_size]
                    self.parents[h] = parent
                    parent = h
                self.stored += len(hashes)
            elif kind == "BlockRemoved":
                _, hashes, _medium = event
                for h in hashes:
                    assert h in self.live, "removal of a block never announced (or twice)"
                    del self.live[h]
                self.removed += len(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.live.clear()
                self.cleared += 1

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


@pytest.mark.parametrize("pod_binds", [True, False], ids=["pod-binds", "pod-connects"])
def test_scheduler_stores_hits_and_evictions_announced_once_in_order(pod_binds, tmp_path):
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64, max_model_len=48,
                           record_events=True)
    pool = sched.kv.pool
    if pod_binds:  # vLLM's default: tcp://*:5557, subscribers connect to each pod
        pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/kv", TOPIC),
                                "CPU")
        mirror = Mirror(pub.endpoint)
    else:  # llm-d: the endpoint picker binds, every pod connects to it
        mirror = Mirror("tcp://127.0.0.1:*", bind=True)
        pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", mirror.endpoint, TOPIC), "CPU")
        assert not pub.binds
        mirror.joined()
    shared = list(range(100, 112))  # three full blocks shared by the first prompts
    prompts = [shared + [1, 2, 3, 4, 5], shared + [6, 7, 8, 9, 10], shared + [11, 12],
               list(range(200, 230)), list(range(300, 330)), shared + [13, 14, 15]]
    try:
        sent = 0
        for i, prompt in enumerate(prompts):
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=6))
            while sched.has_unfinished():
                out = sched.schedule()
                apply_step(sched, out, fake_step(sched, out))
                events = pool.take_events()
                pub.publish(events)
                sent += bool(events)
                mirror.drain(int(bool(events)))
                cached = {external_block_hash(h): b for h, b in pool.cached.items()}
                assert set(mirror.live) == set(cached)
                for h, tokens in mirror.live.items():  # the announced tokens are the block's
                    assert external_block_hash(cached[h].block_hash) == h and len(tokens) == 4
        assert sched.kv.prefix_cache_hits > 0, "the shared prefix was never hit"
        assert mirror.removed > 0, "nothing was evicted: the test would not show evictions"
        assert pool.reset_prefix_cache()
        pub.publish(pool.take_events())
        mirror.drain(1)
        assert mirror.cleared == 1 and not mirror.live and not pool.cached
        assert mirror.next_seq == sent + 1
    finally:
        mirror.close()
        pub.close()


def test_stored_event_carries_the_chain():
    sched = make_scheduler(num_blocks=16, block_size=4, record_events=True)
    req = make_request("a", list(range(10, 23)), max_tokens=4)  # 13 tokens: 3 full blocks
    sched.add_request(req)
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out, token=5))
    (event,) = sched.kv.pool.take_events()
    assert event.block_hashes == req.block_hashes[:3]
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(10, 22)) and event.block_size == 4
    # Decoding fills the fourth block: a new event whose parent is the third block's hash.
    while len(req.block_hashes) < 4 or sched.kv.pool.events == []:
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out, token=5))
    (event,) = sched.kv.pool.take_events()
    assert event.parent_block_hash == req.block_hashes[2]
    assert event.block_hashes == [req.block_hashes[3]]
    assert event.token_ids == [22, 5, 5, 5]


def test_wire_hashes_are_64_bit_ints_or_vllms_raw_bytes(monkeypatch):
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: unset or 1, the low 64 bits; 0, the 32
    bytes; a LoRA request's BlockStored names its adapter by lora_int_id."""
    from kserve_paged_engine.core.kv_events import encode_batch, int_hashes_from_env
    from kserve_paged_engine.lora.request import LoRARequest

    sched = make_scheduler(num_blocks=16, block_size=4, record_events=True)
    req = make_request("a", list(range(10, 19)), max_tokens=1)  # 2 full blocks
    req.lora_request = LoRARequest("sql", 7, "/adapters/sql")
    sched.add_request(req)
    out = sched.schedule()
    apply_step(sched, out, fake_step(sched, out))
    events = sched.kv.pool.take_events()
    h0, h1 = req.block_hashes[:2]
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert int_hashes_from_env()
    _, (stored,) = msgpack.unpackb(encode_batch(1.0, events, "CPU", int_hashes_from_env()))
    assert stored == ["BlockStored", [int.from_bytes(h0[-8:], "big"),
                                      int.from_bytes(h1[-8:], "big")],
                      None, list(range(10, 18)), 4, 7, "CPU"]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    _, (stored,) = msgpack.unpackb(encode_batch(1.0, events, "CPU", int_hashes_from_env()))
    assert stored[1] == [h0, h1]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        int_hashes_from_env()


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": "5557"}', "endpoint"),
    ('{"enable_kv_cache_events": "yes"}', "true or false"),
    ('{"enable_kv_cache_events": true, "topik": "x"}', "unknown keys"),
    ("[1]", "JSON object"),
    ("{", "Expecting"),
])
def test_bad_config_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


def test_bind_or_connect_follows_vllms_rule():
    from kserve_paged_engine.core.kv_event_publisher import binds

    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and binds("tcp://0.0.0.0:5557")
    assert not binds("tcp://paged-llm-epp-service.ns.svc.cluster.local:5557")
    assert not binds("tcp://127.0.0.1:5557")


def test_vllm_keys_without_use_here_are_accepted():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                   '"endpoint": "tcp://*:5557", "replay_endpoint": '
                                   '"tcp://*:5558", "buffer_steps": 1000, "topic": "kv"}')
    assert cfg.publishes and cfg.topic == "kv"
    assert not KVEventsConfig.from_json('{"publisher": "zmq"}').publishes


def scorer_keys(token_ids: list[int], block_size: int, seed: str) -> list[int]:
    """The keys llm-d's precise prefix-cache scorer computes for a prompt (its token processor,
    after vLLM's sha256_cbor): root SHA-256(CBOR(seed)); each full block SHA-256(CBOR([parent's
    32 bytes, token ids, null])); the index key is the low 64 bits, big-endian."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    keys = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(cbor2.dumps([parent, block, None], canonical=True)).digest()
        keys.append(int.from_bytes(parent[24:], "big"))
    return keys


@pytest.mark.slow
def test_engine_publishes_through_the_server_flag(tmp_path, monkeypatch):
    """The real engine, switched on by --kv_events_config with --prefix_caching_hash_algo
    sha256_cbor and PYTHONHASHSEED: prefix hits, evictions under a small cache, and a reset;
    the mirror matches the engine's index after every step, and a scorer that knows only the
    prompt's tokens, the seed and the block size finds every full prompt block by its own keys."""
    from kserve_paged.args import engine_kwargs, parse_args
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from kserve_paged_engine.sampling_params import SamplingParams

    seed, bs = "1337", 8
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    endpoint = f"ipc://{tmp_path}/kv.sock"
    args = parse_args(["--num_kv_blocks", "20", "--block_size", str(bs), "--max_model_len",
                       "128", "--prefix_caching_hash_algo", "sha256_cbor",
                       "--kv_events_config",
                       f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                       f'"endpoint": "{endpoint}", "topic": "{TOPIC}"}}'])
    from kserve_paged_engine.config.engine import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(ensure_default_model(progress=lambda _: None)),
                                    **engine_kwargs(args)))
    mirror = Mirror(endpoint)
    pool = engine.kv.pool
    try:
        system = "You are a helpful assistant who answers in one short sentence. " * 2
        prompts = [system + q for q in ("What is the capital of France?", "Name a colour.",
                                        "What is two plus two?")]
        prompts += ["A completely different prompt about the sea and its long tides. " * 5,
                    "Yet another unrelated text about mountains, rivers and old towns. " * 5]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        last_seq = engine.kv_events.seq
        for i, prompt in enumerate(prompts):
            ids = engine.tokenize(prompt)
            keys = scorer_keys(ids, bs, seed)
            assert keys
            engine.add_request(f"q{i}", prompt, params)
            first = True
            while engine.has_unfinished_requests():
                engine.step()
                mirror.drain(engine.kv_events.seq - last_seq)
                last_seq = engine.kv_events.seq
                assert set(mirror.live) == {external_block_hash(h) for h in pool.cached}
                if first:  # the prefill stored the prompt's blocks: all found, chained
                    assert all(k in mirror.live for k in keys), f"prompt {i}: a key not found"
                    assert [mirror.parents[k] for k in keys] == [None] + keys[:-1]
                    # What later llm-d indexers key on instead: each block's own token ids.
                    assert [mirror.live[k] for k in keys] == \
                        [ids[j * bs:(j + 1) * bs] for j in range(len(keys))]
                    first = False
        assert engine.kv.prefix_cache_hits > 0 and mirror.removed > 0
        assert engine.reset_prefix_cache()
        mirror.drain(1)
        assert mirror.cleared == 1 and not mirror.live
    finally:
        mirror.close()
        engine.close()
