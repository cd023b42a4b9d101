"""Scheduler driven step by step: schedule() -> fake runner output -> update_from_output()."""
from __future__ import annotations

import pytest

from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.engine.scheduler import Scheduler, SchedulerConfig
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole, KVTransferConfig
from disagg.worker.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from disagg.worker.sampling_params import SamplingParams

BLOCK = 4
EOS = 0


class FakeRemoteConnector(KVConnectorBase):
    """Scheduler side of an asynchronous connector: prompts with do_remote_prefill load remotely;
    finished prompts with do_remote_decode keep their blocks for a reader."""

    def __init__(self):
        spec = KVCacheSpec("m", 1, 1, 1, BLOCK, 16, "float32")
        super().__init__(KVTransferConfig(kv_connector="fake"), KVConnectorRole.SCHEDULER, spec)
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            return request.num_prompt_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return {"step": True}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            return True, {"remote_block_ids": list(block_ids)}
        return False, None


def make_scheduler(num_blocks=16, connector=None, **cfg) -> Scheduler:
    config = SchedulerConfig(max_model_len=64, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True), connector)


def make_req(req_id, n_prompt, max_tokens=3, kv=None) -> Request:
    prompt = [1000 * (ord(req_id[0]) - 90) + i for i in range(n_prompt)]  # no shared prefixes
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), {EOS},
                   Handoff(**kv) if kv else None)


def run_output(so: SchedulerOutput, token=7, kv_output=None, sched=None) -> ModelRunnerOutput:
    """What a runner returns: one token for every request whose prompt is complete."""
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        sampled[req_id] = [token] if req.num_computed_tokens >= req.num_tokens else []
    return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled, kv_connector_output=kv_output)


@pytest.fixture
def assert_all_free():
    schedulers: list[Scheduler] = []
    yield schedulers.append
    for s in schedulers:
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks, "blocks leaked"
        assert not s.requests and not s.has_pending_kv_work()


def test_continuous_batching_and_token_budget(assert_all_free):
    s = make_scheduler(max_num_batched_tokens=10)
    assert_all_free(s)
    a, b = make_req("a", 6), make_req("b", 6)
    s.add_request(a)
    s.add_request(b)
    # STEP 1: a's whole prompt (6) and a 4-token chunk of b fit the budget of 10
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}
    s.update_from_output(so, run_output(so, sched=s))
    assert a.output_token_ids == [7] and b.output_token_ids == []
    # STEP 2: a decodes one token, b finishes its prompt
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a", "b"]
    s.update_from_output(so, run_output(so, sched=s))
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, run_output(so, sched=s))
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(a.output_token_ids) == 3


def test_eos_and_stop_token_finish(assert_all_free):
    s = make_scheduler()
    assert_all_free(s)
    a = make_req("a", 3, max_tokens=10)
    a.sampling_params.stop_token_ids = [9]
    s.add_request(a)
    so = s.schedule()
    outs = s.update_from_output(so, run_output(so, token=9, sched=s))
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 9
    b = make_req("b", 3, max_tokens=10)
    s.add_request(b)
    so = s.schedule()
    outs = s.update_from_output(so, run_output(so, token=EOS, sched=s))
    assert outs[0].finish_reason == "stop" and b.output_token_ids == [EOS]
    assert so.finished_req_ids == {"a"}  # runner learns of a's finish in the next step


def test_preemption_by_recompute_when_blocks_run_out(assert_all_free):
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    assert_all_free(s)
    a, b = make_req("a", 8, max_tokens=6), make_req("b", 7, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()  # a: 2 blocks, b: 2 blocks -> pool full
    s.update_from_output(so, run_output(so, sched=s))
    assert s.kv.num_free_blocks == 0
    # STEP 2: a needs a third block -> b (newest) is preempted and goes back to waiting
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert so.preempted_req_ids == {"b"}  # the runner forgets b's state in this step
    s.update_from_output(so, run_output(so, sched=s))
    # b is recomputed later: its prompt plus the token it generated before preemption
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, run_output(so, sched=s))
        for new in so.scheduled_new_reqs:
            if new.req_id == "b":
                assert new.prompt_token_ids == b.prompt_token_ids + [7]  # generated token kept
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6 and b.num_preemptions == 1


def test_remote_prefill_lifecycle(assert_all_free):
    conn = FakeRemoteConnector()
    s = make_scheduler(connector=conn)
    assert_all_free(s)
    req = make_req("d", 9, kv={"do_remote_prefill": True})
    s.add_request(req)
    # STEP 1: blocks allocated for the remote tokens, nothing computed, request parks
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.allocs == [("d", s.kv.get_block_ids("d"), 9)] and len(s.kv.get_block_ids("d")) == 3
    assert so.kv_connector_metadata == {"step": True}
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput()))
    # STEP 2: still loading
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0 and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput(finished_recving={"d"})))
    # STEP 3: loaded; only the last prompt token is recomputed for its logits
    so = s.schedule()
    assert so.num_scheduled_tokens == {"d": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    s.update_from_output(so, run_output(so, sched=s))
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, run_output(so, sched=s))
    assert len(req.output_token_ids) == 3


def test_none_connector_output_is_accepted(assert_all_free):
    s = make_scheduler(connector=FakeRemoteConnector())
    assert_all_free(s)
    s.add_request(make_req("a", 5))
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, run_output(so, kv_output=None, sched=s))


def test_delay_free_until_finished_sending(assert_all_free):
    conn = FakeRemoteConnector()
    s = make_scheduler(connector=conn)
    assert_all_free(s)
    p = make_req("p", 9, max_tokens=1, kv={"do_remote_decode": True})
    s.add_request(p)
    so = s.schedule()
    outs = s.update_from_output(so, run_output(so, sched=s))
    assert outs[0].finish_reason == "length"
    # the blocks for the reader, and the token the prefill chose (a router may stream it first)
    assert outs[0].kv_transfer_params.to_wire() == {"remote_block_ids": [0, 1, 2], "output_token_ids": outs[0].new_token_ids}
    assert outs[0].new_token_ids and s.kv.num_free_blocks == 16 - 3 and s.has_pending_kv_work()  # held for the reader
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput(finished_sending={"p"})))
    assert s.kv.num_free_blocks == 16 and not s.has_pending_kv_work()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_async_load_failure(policy, assert_all_free):
    s = make_scheduler(connector=FakeRemoteConnector(), kv_load_failure_policy=policy)
    assert_all_free(s)
    req = make_req("d", 9, kv={"do_remote_prefill": True})
    other = make_req("o", 5)
    s.add_request(req)
    s.add_request(other)
    so = s.schedule()
    bad_block = s.kv.get_block_ids("d")[1]
    s.update_from_output(so, run_output(so, sched=s))
    # STEP 2: the load fails: the connector reports the request done and its block invalid
    so = s.schedule()
    kvo = KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={bad_block})
    s.update_from_output(so, run_output(so, kv_output=kvo, sched=s))
    so = s.schedule()
    outs = s.update_from_output(so, run_output(so, sched=s))
    if policy == "recompute":
        # the whole prompt is computed locally this time
        assert so.num_scheduled_tokens["d"] == 9 and so.scheduled_new_reqs[0].num_computed_tokens == 0
    else:
        err = [o for o in outs if o.req_id == "d"]
        assert err[0].finish_reason == "error" and "loading remote KV for request d failed" in err[0].error
    while s.has_unfinished_requests():
        so = s.schedule()
        s.update_from_output(so, run_output(so, sched=s))
    assert len(other.output_token_ids) == 3  # the other request is unaffected
    assert len(req.output_token_ids) == (3 if policy == "recompute" else 0)


def test_abort_while_loading_frees_blocks_only_after_the_transfer(assert_all_free):
    s = make_scheduler(connector=FakeRemoteConnector())
    assert_all_free(s)
    s.add_request(make_req("d", 9, kv={"do_remote_prefill": True}))
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput()))
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 13  # a transfer may still write into them
    so = s.schedule()
    assert "d" in so.finished_req_ids
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput(finished_recving={"d"})))


@pytest.mark.parametrize("failed", [False, True])
def test_abort_after_the_load_landed_frees_at_once_and_leaves_the_engine_idle(failed, assert_all_free):
    """The client leaves between its KV landing (reported by a step) and the step that would admit it: no
    transfer writes into its blocks any more, so they are freed now; nothing is left that keeps the engine
    stepping (found under a flood: a decode worker spun a core with no request, one block held for good)."""
    s = make_scheduler(connector=FakeRemoteConnector())
    assert_all_free(s)
    s.add_request(make_req("d", 9, kv={"do_remote_prefill": True}))
    so = s.schedule()
    blocks = s.kv.get_block_ids("d")
    s.update_from_output(so, ModelRunnerOutput.empty(KVConnectorOutput()))
    so = s.schedule()
    kvo = KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={blocks[1]} if failed else set())
    s.update_from_output(so, ModelRunnerOutput.empty(kvo))
    assert s.has_landed_remote_kv()
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert not s.has_landed_remote_kv() and not s.has_pending_kv_work() and not s.has_unfinished_requests()
    so = s.schedule()
    assert "d" in so.finished_req_ids and not so.num_scheduled_tokens


def test_duplicate_request_id_rejected(assert_all_free):
    s = make_scheduler()
    assert_all_free(s)
    s.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="'a' is already in use"):
        s.add_request(make_req("a", 3))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)


def test_scheduler_side_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import disagg.worker.engine.scheduler, disagg.worker.engine.kv_cache_manager\n"
            "import disagg.worker.kv_transfer.base, disagg.worker.outputs")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
