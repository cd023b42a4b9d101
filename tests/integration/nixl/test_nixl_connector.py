"""NIXL connector between a prefill engine process and a decode engine (this process), over loopback."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from disagg.worker import LLM, SamplingParams  # noqa: E402
from disagg.worker.local.process import free_port  # noqa: E402

PROMPTS = [
    "The history of the city begins with a small harbour and a market by the river",
    "In the morning the engineers measured the latency of every request twice",
    "hi",
    "A prompt whose length is not a multiple of the block size, so its last block is partial!",
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROC = Path(__file__).with_name("prefill_proc.py")


class Prefill:
    def __init__(self, model: str, lease: float = 30.0, port: int = 0):
        self.proc = subprocess.Popen([sys.executable, str(PROC), model, str(lease), str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.read(timeout=120)["ready"]

    def read(self, timeout: float = 60.0) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"prefill process exited with {self.proc.poll()}")
                if line.startswith("{"):
                    return json.loads(line)
        raise TimeoutError("prefill process did not answer")

    def send(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=512, num_kv_blocks=96)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def make_decode(model: str, policy: str = "recompute", **kw) -> LLM:
    return LLM(model, max_model_len=512, num_kv_blocks=96, kv_transfer_config={
        "kv_connector": "NixlConnector", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"handshake_timeout_seconds": 2}}, **kw)


def kv_stats(llm: LLM) -> dict:
    stats = llm.engine.stats.kv_connector_stats
    return {"bytes": sum(sum(s["bytes"]) for s in stats), "descriptors": sum(sum(s["num_descriptors"]) for s in stats),
            "transfers": sum(len(s["bytes"]) for s in stats), "failed": sum(s["num_failed_transfers"] for s in stats)}


@pytest.mark.slow
def test_pd_over_nixl_matches_one_engine_and_frees_everything(tiny_model_dir, reference):
    prefill = Prefill(tiny_model_dir)
    decode = make_decode(tiny_model_dir)
    try:
        params = prefill.send({"prompts": PROMPTS})["params"]
        assert all(p["do_remote_prefill"] and p["remote_block_ids"] for p in params)
        outs = decode.generate(PROMPTS, GREEDY, kv_transfer_params=params)  # all four concurrently
        assert [o.outputs[0].token_ids for o in outs] == reference
        stats = kv_stats(decode)
        assert stats["transfers"] == 4 and stats["failed"] == 0
        assert stats["bytes"] > 0 and stats["descriptors"] >= 4
        after = prefill.send({"cmd": "wait"})
        assert after["free"] == after["num_blocks"] and after["pending_sends"] == 0 and after["expired"] == 0
        assert decode.engine.kv_cache_manager.num_free_blocks == 96
        assert decode.engine.scheduler_connector.get_pending_counts() == {"pending_sends": 0, "pending_loads": 0}
    finally:
        prefill.close()
        decode.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_decode_reads(tiny_model_dir, reference, policy):
    prefill = Prefill(tiny_model_dir)
    decode = make_decode(tiny_model_dir, policy=policy)
    try:
        params = prefill.send({"prompts": PROMPTS})["params"]
        prefill.kill()
        outs = decode.generate(PROMPTS, GREEDY, kv_transfer_params=params)
        if policy == "recompute":
            assert [o.outputs[0].token_ids for o in outs] == reference
        else:
            assert all(o.outputs[0].finish_reason == "error" for o in outs)
            assert all("handshake with the prefill engine failed" in o.error for o in outs)
        assert decode.engine.kv_cache_manager.num_free_blocks == 96
    finally:
        prefill.close()
        decode.shutdown()


@pytest.mark.slow
def test_unread_blocks_are_freed_at_lease_expiry(tiny_model_dir):
    prefill = Prefill(tiny_model_dir, lease=1.0)
    try:
        prefill.send({"prompts": PROMPTS[:2]})
        t = time.monotonic()
        after = prefill.send({"cmd": "wait"})
        assert 0.5 < time.monotonic() - t < 10
        assert after["free"] == after["num_blocks"] and after["expired"] == 2
    finally:
        prefill.close()


@pytest.mark.slow
def test_bad_block_ids_fail_only_that_request(tiny_model_dir, reference):
    prefill = Prefill(tiny_model_dir, lease=4.0)
    decode = make_decode(tiny_model_dir)
    try:
        params = prefill.send({"prompts": PROMPTS})["params"]
        params[1] = dict(params[1], remote_block_ids=[10_000 + i for i in range(len(params[1]["remote_block_ids"]))])
        outs = decode.generate(PROMPTS, GREEDY, kv_transfer_params=params)
        assert outs[1].outputs[0].finish_reason == "error"
        assert "outside prefill engine" in outs[1].error and "10000" in outs[1].error
        assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
        # a block count that does not match the prompt is refused on arrival
        wrong = dict(params[0], remote_block_ids=params[0]["remote_block_ids"][:1])
        with pytest.raises(ValueError, match="remote_block_ids has 1 ids but the prompt's"):
            decode.generate([PROMPTS[0]], GREEDY, kv_transfer_params=[wrong])
        assert decode.engine.kv_cache_manager.num_free_blocks == 96
        after = prefill.send({"cmd": "wait"})  # request 1 was never read: its lease frees it
        assert after["free"] == after["num_blocks"] and after["expired"] == 1
    finally:
        prefill.close()
        decode.shutdown()


@pytest.mark.slow
def test_incompatible_engines_refuse_with_a_clear_error(tiny_model_dir):
    prefill = Prefill(tiny_model_dir)
    decode = make_decode(tiny_model_dir, dtype="bfloat16")
    try:
        params = prefill.send({"prompts": PROMPTS[:1]})["params"]
        out = decode.generate(PROMPTS[:1], GREEDY, kv_transfer_params=params)[0]
        assert out.outputs[0].finish_reason == "error"
        assert "incompatible" in out.error and "dtype 'float32' != 'bfloat16'" in out.error
        assert kv_stats(decode)["transfers"] == 0
    finally:
        prefill.close()
        decode.shutdown()


@pytest.mark.slow
def test_prefill_restarted_then_next_transfer_works(tiny_model_dir, reference):
    port = free_port()
    decode = make_decode(tiny_model_dir)
    first = Prefill(tiny_model_dir, port=port)
    try:
        params = first.send({"prompts": PROMPTS[:1]})["params"]
        assert decode.generate(PROMPTS[:1], GREEDY, kv_transfer_params=params)[0].outputs[0].token_ids == reference[0]
        stale = first.send({"prompts": PROMPTS[1:2]})["params"]
        first.kill()
        second = Prefill(tiny_model_dir, port=port)  # same side channel, new engine
        try:
            # params from the dead engine: recomputed locally, still the right tokens
            out = decode.generate(PROMPTS[1:2], GREEDY, kv_transfer_params=stale)[0]
            assert out.outputs[0].token_ids == reference[1]
            before = kv_stats(decode)["transfers"]
            fresh = second.send({"prompts": PROMPTS[2:4]})["params"]
            outs = decode.generate(PROMPTS[2:4], GREEDY, kv_transfer_params=fresh)
            assert [o.outputs[0].token_ids for o in outs] == reference[2:4]
            assert kv_stats(decode)["transfers"] - before == 2
            assert second.send({"cmd": "wait"})["free"] == 96
        finally:
            second.close()
    finally:
        first.close()
        decode.shutdown()
    assert decode.engine.kv_cache_manager.num_free_blocks == 96


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_no_read_after_the_senders_lease_ran_out(tiny_model_dir, reference, policy):
    """Prefill may reuse unread blocks once the lease is over: reading them then would copy another
    request's KV silently, so decode must not start that READ."""
    prefill = Prefill(tiny_model_dir)
    decode = make_decode(tiny_model_dir, policy=policy)
    try:
        params = prefill.send({"prompts": PROMPTS[:2]})["params"]
        assert all(p["remote_lease_expires_at"] > time.time() + 20 for p in params)
        params[0] = dict(params[0], remote_lease_expires_at=time.time() - 1)  # as if queued past the lease
        outs = decode.generate(PROMPTS[:2], GREEDY, kv_transfer_params=params)
        if policy == "recompute":
            assert outs[0].outputs[0].token_ids == reference[0]
        else:
            assert outs[0].outputs[0].finish_reason == "error" and "lease" in outs[0].error
        assert outs[1].outputs[0].token_ids == reference[1]
        assert kv_stats(decode)["transfers"] == 1  # only the request whose lease was still running
        assert decode.engine.kv_cache_manager.num_free_blocks == 96
    finally:
        prefill.close()
        decode.shutdown()


@pytest.mark.slow
def test_full_prefix_hit_reads_nothing_and_still_releases_the_sender(tiny_model_dir):
    """Every block decode needs is already in its prefix cache: no READ, only the notification
    that lets prefill free its copy (no lease expiry)."""
    from disagg.worker.model import Tokenizer

    ids = Tokenizer(tiny_model_dir).encode(PROMPTS[0] + " " + PROMPTS[1])[:33]  # 2 full blocks + 1 token
    assert len(ids) == 33
    prefill = Prefill(tiny_model_dir)
    decode = make_decode(tiny_model_dir)
    try:
        local = decode.generate([ids], GREEDY)[0].outputs[0].token_ids  # caches blocks 0 and 1
        params = prefill.send({"prompts": [ids]})["params"]
        out = decode.generate([ids], GREEDY, kv_transfer_params=params)[0]
        assert out.outputs[0].token_ids == local
        assert kv_stats(decode)["transfers"] == 0
        after = prefill.send({"cmd": "wait"})
        assert after["free"] == after["num_blocks"] and after["expired"] == 0  # freed by the notification
    finally:
        prefill.close()
        decode.shutdown()
