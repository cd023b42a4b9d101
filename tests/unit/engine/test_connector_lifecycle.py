"""The KV-connector lifecycle around each step, observed through a connector loaded by module path."""
from __future__ import annotations

import pytest

import recording_connector
from disagg.worker import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
MODULE_PATH = "recording_connector:RecordingConnector"


@pytest.fixture
def calls():
    recording_connector.CALLS.clear()
    yield recording_connector.CALLS
    recording_connector.CALLS.clear()


def make_llm(model_dir, **kw):
    return LLM(model_dir, max_model_len=256, num_kv_blocks=64,
               kv_transfer_config={"kv_connector_module_path": MODULE_PATH, "kv_load_failure_policy": kw.pop("policy", "recompute")},
               **kw)


def steps(calls):
    """Split the flat call log into steps (each starts with bind)."""
    out = []
    for c in calls:
        if c[0] == "bind":
            out.append([])
        out[-1].append(c)
    return out


def test_call_order_of_a_step_with_a_forward(tiny_model_dir, calls):
    llm = make_llm(tiny_model_dir)
    num_layers = llm.engine.model_config.num_hidden_layers
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0))
    first = steps(calls)[0]
    layer_calls = []
    for i in range(num_layers):
        name = f"model.layers.{i}.self_attn"
        layer_calls += [("wait_for_layer_load", name), ("save_kv_layer", name)]
    assert first == [("bind", 5), ("start_load_kv",), *layer_calls, ("wait_for_save",),
                     ("get_finished", frozenset()), ("get_block_ids_with_load_errors",),
                     ("get_kv_connector_stats",), ("clear",)]
    # the finished request is handed to get_finished in the next step
    llm.generate([[5, 6]], SamplingParams(max_tokens=1, temperature=0))
    assert any(c[0] == "get_finished" and "req-0" in c[1] for c in calls)


def test_clear_runs_even_when_the_forward_raises(tiny_model_dir, calls, monkeypatch):
    llm = make_llm(tiny_model_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(llm.engine.model, "forward", broken)
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert out.outputs[0].finish_reason == "error" and "simulated kernel failure" in out.error
    assert calls[-1] == ("clear",) and ("get_finished", frozenset()) in calls
    assert llm.engine.worker_connector._connector_metadata is None
    assert llm.engine.kv_cache_manager.num_free_blocks == 64
    monkeypatch.undo()  # the engine keeps serving
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].finish_reason == "length"


def test_step_with_nothing_scheduled_still_reports_finished_loads(tiny_model_dir, calls):
    llm = make_llm(tiny_model_dir)
    reference = llm.generate([[11, 12, 13, 14, 15, 16]], GREEDY)[0].outputs[0].token_ids
    calls.clear()
    # remote load that "fails": the blocks are reported invalid, the prompt is recomputed
    out = llm.generate([[11, 12, 13, 14, 15, 16]], GREEDY, kv_transfer_params=[{"fake_remote": True, "fail": True}])[0]
    idle = [s for s in steps(calls) if s[0] == ("bind", 0)]
    assert idle, "no step without scheduled tokens"
    assert all(("wait_for_save",) not in s and s[-1] == ("clear",) for s in idle)
    assert all(c[0] not in ("wait_for_layer_load", "save_kv_layer") for s in idle for c in s)
    assert out.outputs[0].token_ids == reference
    assert llm.engine.kv_cache_manager.num_free_blocks == 64


def test_failed_load_under_fail_policy_is_a_clear_error(tiny_model_dir, calls):
    llm = make_llm(tiny_model_dir, policy="fail")
    out = llm.generate([[11, 12, 13]], GREEDY, kv_transfer_params=[{"fake_remote": True, "fail": True}])[0]
    assert out.outputs[0].finish_reason == "error" and "loading remote KV" in out.error
    assert llm.engine.kv_cache_manager.num_free_blocks == 64


def test_no_connector_gives_none(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request([1, 2, 3], GREEDY)
    so = engine.scheduler.schedule()
    out = engine.runner.execute_model(so)
    assert out.kv_connector_output is None
    engine.scheduler.update_from_output(so, out)  # the scheduler accepts None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks == 64


def test_unknown_connector_names_the_choices(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown KV connector 'Nope'.*SharedStorageConnector"):
        LLM(tiny_model_dir, max_model_len=256, kv_transfer_config={"kv_connector": "Nope"})
    with pytest.raises(ModuleNotFoundError):
        LLM(tiny_model_dir, max_model_len=256, kv_transfer_config={"kv_connector_module_path": "no_such_mod:X"})
