"""KV-cache events end to end on loopback ZMQ: the block pool's changes as events, the publisher's multipart
messages read by a subscriber written against vLLM's documented schema (its own msgspec structs, not ours), the
replay socket, and the router's subscriber catching up, then seeing a restarted publisher."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from disagg.worker.engine.block_pool import hash_block_tokens
from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.request import Request
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.kv_events.collector import KVEventCollector
from disagg.worker.kv_events.publisher import ZmqEventPublisher
from disagg.worker.kv_events.schema import EventBatch
from disagg.worker.kv_events.subscriber import EndpointSubscriber
from disagg.worker.local.process import free_port
from disagg.worker.router.kv_index import KVIndex
from disagg.worker.router.metrics import RouterMetrics


# ---- a consumer's view of the schema, as vLLM documents it (vllm/distributed/kv_events.py) ----------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(VEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VEvent):
    pass


class VKVEventBatch(VEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


BS = 4


def run_request(kv: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    req = Request(req_id, tokens, SamplingParams(), frozenset())
    hits, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(tokens) - len(hits) * BS, hits) is not None
    kv.cache_blocks(req, len(tokens))
    kv.free(req)


def engine_batches() -> list[EventBatch]:
    """Real pool traffic: a start, a 2-block prompt, the same prompt again (no new event), then a 6-block
    prompt that evicts both cached blocks in a pool of 6."""
    collector = KVEventCollector(BS, "CPU", clock=lambda: 123.0)
    collector.cleared()
    kv = KVCacheManager(6, BS, events=collector)
    out = [collector.take()]
    run_request(kv, "a", list(range(9)))
    out.append(collector.take())
    run_request(kv, "b", list(range(9)))
    assert collector.take() is None, "a prefix hit announced its blocks again"
    run_request(kv, "c", list(range(100, 124)))
    out.append(collector.take())
    return out


def test_block_pool_changes_become_vllm_shaped_events():
    cleared, first, evicting = engine_batches()
    assert [type(e).__name__ for e in cleared.events] == ["AllBlocksCleared"]
    (s,) = first.events
    assert (s.parent_block_hash, s.token_ids, s.block_size, s.medium) == (None, list(range(8)), BS, "CPU")
    assert len(s.block_hashes) == 2  # one chain, one event
    kinds = [type(e).__name__ for e in evicting.events]
    assert kinds[0] == "BlockRemoved" and set(evicting.events[0].block_hashes) == set(s.block_hashes)
    assert "BlockStored" in kinds


def test_a_subscriber_written_against_vllms_schema_reads_our_events_and_replay():
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", BS, topic="kv")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(pub.info.endpoint)
    try:
        time.sleep(0.3)  # PUB drops messages for a subscriber that has not joined yet
        batches = engine_batches()
        for b in batches:
            pub.publish(b)
        decoder = msgspec.msgpack.Decoder(type=VKVEventBatch)
        got = []
        for want_seq in range(len(batches)):
            topic, seq, payload = sub.recv_multipart()
            assert (topic, int.from_bytes(seq, "big")) == (b"kv", want_seq)
            got.append(decoder.decode(payload))
        assert isinstance(got[0].events[0], AllBlocksCleared)
        stored = got[1].events[0]
        assert isinstance(stored, BlockStored) and stored.token_ids == list(range(8)) and stored.lora_id is None
        assert stored.block_hashes == batches[1].events[0].block_hashes
        assert got[1].data_parallel_rank == 0 and got[1].ts == 123.0
        assert any(isinstance(e, BlockRemoved) for e in got[2].events)

        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 10_000)
        replay.connect(pub.info.replay_endpoint)
        replay.send_multipart((b"", (1).to_bytes(8, "big")))
        frames = [replay.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in frames] == [1, 2, -1]
        assert decoder.decode(frames[0][3]).events[0].token_ids == list(range(8))
        replay.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def test_a_replay_holds_every_batch_published_before_it_even_those_not_yet_sent(monkeypatch):
    """A subscriber that joins while the engine's batches are still queued gets them by replay: they were sent
    before its SUB joined, so it would never see them live."""
    import disagg.worker.kv_events.publisher as publisher

    def slow_encode(batch):  # a publisher thread that is behind the engine
        time.sleep(0.02)
        return encode(batch)

    encode = publisher.encode_batch
    monkeypatch.setattr(publisher, "encode_batch", slow_encode)
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", BS)
    ctx = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, 10_000)
    replay.connect(pub.info.replay_endpoint)
    try:
        batches = engine_batches() * 4
        for b in batches:
            pub.publish(b)
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while not seqs or seqs[-1] != -1:
            seqs.append(int.from_bytes(replay.recv_multipart()[2], "big", signed=True))
        assert seqs == list(range(len(batches))) + [-1]
    finally:
        replay.close(linger=0)
        ctx.term()
        pub.close()


def test_a_busy_port_is_a_clear_error():
    port = free_port()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", None, BS)
    try:
        with pytest.raises(ValueError, match=f"cannot bind the KV events socket.*{port}"):
            ZmqEventPublisher(f"tcp://127.0.0.1:{port}", None, BS)
    finally:
        pub.close()


async def _wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_router_subscriber_catches_up_by_replay_and_sees_a_restart():
    port, replay_port = free_port(), free_port()
    endpoints = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    batches = engine_batches()
    stored_hashes = batches[1].events[0].block_hashes

    async def scenario() -> None:
        pub = ZmqEventPublisher(*endpoints, BS)
        for b in batches[:2]:  # before the router subscribes: only the replay has them
            pub.publish(b)
        index, metrics = KVIndex(), RouterMetrics()
        ctx = zmq.asyncio.Context()
        info = {"endpoint": "tcp://0.0.0.0:%d" % port, "replay_endpoint": endpoints[1], "topic": ""}
        task = asyncio.ensure_future(EndpointSubscriber("http://127.0.0.1:1", info, index, metrics, ctx).run())
        try:
            await _wait(lambda: index.prefix_blocks("http://127.0.0.1:1", stored_hashes) == 2)
            await asyncio.sleep(0.3)  # the SUB joins
            pub.publish(batches[2])  # live: evicts them
            await _wait(lambda: index.last_seq("http://127.0.0.1:1") == 2)
            assert index.prefix_blocks("http://127.0.0.1:1", stored_hashes) == 0
            pub.publish(batches[1])  # stored again (seq 3)
            await _wait(lambda: index.prefix_blocks("http://127.0.0.1:1", stored_hashes) == 2)
            pub.close()
            pub = ZmqEventPublisher(*endpoints, BS)  # a restarted worker: sequence starts at 0 again
            await asyncio.sleep(0.5)
            restarted = KVEventCollector(BS)
            another = hash_block_tokens(None, range(90, 94))  # the index holds our hash of the block's tokens
            restarted.stored(another, None, range(90, 94))
            pub.publish(restarted.take())
            await _wait(lambda: index.last_seq("http://127.0.0.1:1") == 0)
            assert index.prefix_blocks("http://127.0.0.1:1", stored_hashes) == 0, "blocks of before the restart"
            assert index.prefix_blocks("http://127.0.0.1:1", [another]) == 1
            assert counter(metrics, "disagg:router_kv_events_total") >= 5
            assert counter(metrics, "disagg:router_kv_events_lost_total") == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(linger=0)
            pub.close()

    asyncio.run(scenario())


def counter(metrics: RouterMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_subscriber_address_uses_the_worker_host_for_a_wildcard_bind():
    from disagg.worker.kv_events.subscriber import subscriber_address

    assert subscriber_address("http://10.1.2.3:8000", "tcp://0.0.0.0:5557") == "tcp://10.1.2.3:5557"
    assert subscriber_address("http://10.1.2.3:8000", "tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"




@pytest.mark.parametrize("endpoint, replay", [("tcp://*:5557", "tcp://*:5558"), ("tcp://127.0.0.1:0", "tcp://127.0.0.1:*"),
                                              ("tcp://0.0.0.0:*", "tcp://0.0.0.0:*")])
def test_the_replay_socket_defaults_to_the_next_port(endpoint, replay):
    from disagg.worker.kv_events.publisher import replay_endpoint_for

    assert replay_endpoint_for(endpoint) == replay


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x", "tcp://host:port", "localhost:5557"])
def test_a_bad_events_endpoint_is_named(endpoint):
    from disagg.worker.kv_events.publisher import replay_endpoint_for

    with pytest.raises(ValueError, match="--kv-events-endpoint"):
        replay_endpoint_for(endpoint)


def test_the_framing_reads_back_what_it_writes_and_names_nothing_malformed():
    """One framing for publisher and subscriber: a replay answer's end marker reads back as END_OF_REPLAY."""
    from disagg.worker.kv_events import wire

    assert wire.parse_live(list(wire.live_frames(b"t", 7, b"p"))) == (7, b"p")
    assert wire.parse_replay_request([b"peer", *wire.replay_request(3)]) == (b"peer", 3)
    assert wire.parse_replay_answer(list(wire.replay_frames(b"peer", b"t", 4, b"p"))[1:]) == (4, b"p")
    assert wire.parse_replay_answer(list(wire.end_of_replay_frames(b"peer"))[1:])[0] == wire.END_OF_REPLAY
    assert wire.parse_live([b"t", b"\x00", b"p"]) is None and wire.parse_replay_answer([b"", b"t"]) is None


@pytest.mark.parametrize("endpoint, worker_host, bound", [
    ("tcp://:5557", "10.0.0.7", "tcp://10.0.0.7:5557"),  # no host: the worker's own address
    ("tcp://:5557", "0.0.0.0", "tcp://127.0.0.1:5557"),  # ... never a wildcard: loopback then
    ("tcp://:*", "", "tcp://127.0.0.1:*"),
    ("tcp://10.0.0.8:5557", "0.0.0.0", "tcp://10.0.0.8:5557"),  # given: kept
    ("tcp://*:5557", "10.0.0.7", "tcp://*:5557"),  # a wildcard asked for by name: kept, and warned about
])
def test_kv_events_bind_a_given_address_never_a_wildcard_by_default(endpoint, worker_host, bound):
    from disagg.worker.kv_events.publisher import bind_endpoint

    assert bind_endpoint(endpoint, worker_host) == bound


def test_a_worker_says_what_it_opens_to_every_interface():
    from disagg.worker.server.args import parse_worker_args
    from disagg.worker.server.cli import exposure_warnings

    quiet = parse_worker_args(["--kv-connector", "NixlConnector", "--kv-events-endpoint", "tcp://10.0.0.7:5557"])
    assert exposure_warnings(quiet) == []
    assert exposure_warnings(parse_worker_args([])) == []  # defaults: events off, side channel on loopback
    loud = parse_worker_args(["--kv-connector", "NixlConnector", "--kv-side-channel-host", "0.0.0.0",
                              "--kv-events-endpoint", "tcp://*:5557"])
    warnings = exposure_warnings(loud)
    assert len(warnings) == 2
    assert "--kv-events-endpoint tcp://*:5557 binds every interface" in warnings[0] and "token ids" in warnings[0]
    assert "--kv-side-channel-host 0.0.0.0" in warnings[1] and "READ its KV cache" in warnings[1]
