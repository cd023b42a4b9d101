"""Pure parts of serving: request validation, endpoint choice, metric mapping, the launcher's plan."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.operator.autoscaling.samples import WAITING_PROMPT_TOKENS
from disagg.operator.spec import parse_spec
from disagg.worker.engine.stats import engine_snapshot
from disagg.worker.local.launcher import curl_example, plan
from disagg.worker.server.metrics import WorkerMetrics
from disagg.worker.server.engine_loop import EngineLoop
from disagg.worker.router.discovery import pod_urls
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.hop_bodies import check_max_tokens, prefill_body
from disagg.worker.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_kv_transfer_params

GOOD_REMOTE = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [0, 3], "remote_host": "h",
               "remote_port": 5600, "remote_request_id": "r1"}


@pytest.mark.parametrize("params, param", [
    ([1], "kv_transfer_params"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params"),
    ({**GOOD_REMOTE, "remote_block_ids": "0,3"}, "kv_transfer_params.remote_block_ids"),
    ({**GOOD_REMOTE, "remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids"),
    ({**GOOD_REMOTE, "remote_port": 70000}, "kv_transfer_params.remote_port"),
    ({**GOOD_REMOTE, "remote_port": True}, "kv_transfer_params.remote_port"),
    ({k: v for k, v in GOOD_REMOTE.items() if k != "remote_host"}, "kv_transfer_params.remote_host"),
])
def test_malformed_kv_transfer_params_name_the_field(params, param):
    with pytest.raises(APIError) as e:
        check_kv_transfer_params(params, "NixlConnector")
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, GOOD_REMOTE])
def test_well_formed_kv_transfer_params_pass(params):
    check_kv_transfer_params(params, "NixlConnector")


def test_kv_transfer_params_on_a_worker_without_a_connector_are_rejected_not_ignored():
    check_kv_transfer_params(None, None)
    with pytest.raises(APIError) as e:
        check_kv_transfer_params({"do_remote_decode": True}, None)
    assert e.value.status == 400 and "no KV connector" in e.value.message
    check_kv_transfer_params({"anything": 1}, "pkg.mod:Custom")  # out of tree: the connector checks its own


def test_sampling_fields_map_to_sampling_params_and_reject_max_tokens_below_one():
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 4, "temperature": 0, "stop": "\n"})
    sp = req.sampling_params(num_prompt_tokens=3, max_model_len=16)
    assert (sp.max_tokens, sp.temperature, sp.stop) == (4, 0, ["\n"])
    assert CompletionRequest(prompt="x").sampling_params(3, 16).max_tokens == 13  # the rest of the context
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", max_tokens=0).sampling_params(3, 16)
    assert e.value.status == 400 and e.value.param == "max_tokens"


def test_chat_max_completion_tokens_wins_and_batches_are_refused():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 3})
    assert req.max_tokens == 3
    assert CompletionRequest(prompt=["one"]).single_prompt() == "one"
    with pytest.raises(APIError):
        CompletionRequest(prompt=["one", "two"]).single_prompt()


def test_prefill_hop_body_and_max_tokens_check():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50, "the client's body is not changed"
    assert check_max_tokens({"max_tokens": 3}) is None
    assert "max_tokens" in check_max_tokens({"max_tokens": 0})
    assert "max_completion_tokens" in check_max_tokens({"max_completion_tokens": "5"})


def make_pool(policy: str, **outstanding: int) -> EndpointPool:
    pool = EndpointPool("decode", policy)
    pool.set_urls(list(outstanding))
    for url, n in outstanding.items():
        pool.endpoints[url].ready, pool.endpoints[url].outstanding = True, n
    return pool


def test_least_loaded_picks_fewest_outstanding_and_skips_not_ready_and_excluded():
    pool = make_pool("least-loaded", a=3, b=1, c=0)
    pool.endpoints["c"].ready = False
    assert pool.pick().url == "b"
    assert pool.pick(exclude={"b"}).url == "a"
    assert pool.pick(exclude={"a", "b"}) is None


def test_ties_and_round_robin_rotate():
    pool = make_pool("least-loaded", a=0, b=0)
    assert {pool.pick().url for _ in range(4)} == {"a", "b"}
    rr = make_pool("round-robin", a=9, b=0)
    assert [rr.pick().url for _ in range(4)] == ["a", "b", "a", "b"]


def test_membership_change_keeps_known_endpoint_state():
    pool = make_pool("least-loaded", a=2)
    pool.set_urls(["a/", "b"])
    assert pool.endpoints["a"].outstanding == 2 and not pool.endpoints["b"].ready


def sample(metrics: WorkerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "role": "decode"}) or 0.0


def test_connector_stats_map_to_vllm_names_and_unknown_keys_are_ignored():
    m = WorkerMetrics("m", "decode")
    m.observe_connector_stats({"xfer_time_s": [0.01, 0.02], "post_time_s": [0.001, 0.001], "bytes": [100, 300],
                               "num_descriptors": [1, 2], "num_failed_transfers": 1, "num_kv_expired_reqs": 2,
                               "something_new": [1]})
    m.observe_connector_stats({"bytes_loaded": 50, "bytes_saved": 70, "num_loads": 1, "num_saves": 1})
    assert sample(m, "vllm:nixl_xfer_time_seconds_count") == 2
    assert sample(m, "vllm:nixl_bytes_transferred_sum") == 400
    assert sample(m, "vllm:nixl_num_descriptors_sum") == 3
    assert sample(m, "vllm:nixl_num_failed_transfers_total") == 1
    assert sample(m, "vllm:nixl_num_kv_expired_reqs_total") == 2
    assert sample(m, "disagg:kv_bytes_loaded_total") == 450
    assert sample(m, "disagg:kv_bytes_saved_total") == 70


def test_worker_metrics_are_per_instance_and_labelled():
    a, b = WorkerMetrics("m", "decode"), WorkerMetrics("m", "decode")
    a.observe_finished(arrival=0.0, first_token=0.5, finished=2.0)
    assert sample(a, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert sample(a, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert sample(b, "vllm:time_to_first_token_seconds_count") == 0.0
    text = a.render().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total", "disagg:kv_pending_sends",
                 "disagg:kv_pending_loads", WAITING_PROMPT_TOKENS):
        assert f'{name}{{' in text, name


def test_waiting_prompt_tokens_gauge_sums_the_waiting_queue_under_the_name_the_autoscaler_reads():
    # the engine's snapshot reads the scheduler's waiting deque; the gauge carries the name the autoscaler reads
    waiting = [SimpleNamespace(num_prompt_tokens=n) for n in (7, 30)]
    scheduler = SimpleNamespace(num_running=1, num_waiting=2, waiting=waiting, num_preemptions_total=0,
                                prefix_cache_queries_total=0, prefix_cache_hits_total=0)
    stats = SimpleNamespace(prompt_tokens=0, generation_tokens=0)
    engine = SimpleNamespace(metrics_snapshot=lambda: engine_snapshot(scheduler, 0.25, None, stats),
                             take_kv_connector_stats=list)
    loop = EngineLoop(lambda: engine, lambda _: WorkerMetrics("m", "decode"))
    loop.metrics = WorkerMetrics("m", "decode")
    loop._update_metrics(engine)
    assert sample(loop.metrics, WAITING_PROMPT_TOKENS) == 37
    assert sample(loop.metrics, "vllm:num_requests_waiting") == 2


LOCAL = {"model": {"servedName": "tiny", "dtype": "float32", "maxModelLen": 256},
         "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 7}, "prefill": {"replicas": 1},
         "decode": {"replicas": 2, "extraArgs": ["--max-num-seqs", "8"]}, "router": {"policy": "round-robin"}}


def test_launcher_plan_gives_each_worker_its_ports_and_the_router_every_url():
    ports = iter(range(9000, 9100))
    procs = plan(parse_spec(LOCAL), "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").processes
    assert [p.name for p in procs] == ["prefill-0", "decode-0", "decode-1", "router"]
    prefill = procs[0].argv
    assert prefill[prefill.index("--role") + 1] == "prefill"
    assert prefill[prefill.index("--port") + 1] == "9000"
    assert prefill[prefill.index("--kv-side-channel-port") + 1] == "9001"
    assert prefill[prefill.index("--kv-lease-seconds") + 1] == "7"
    assert prefill[prefill.index("--max-model-len") + 1] == "256"
    assert procs[1].argv[-2:] == ["--max-num-seqs", "8"]
    router = procs[-1].argv
    assert router[router.index("--prefill") + 1] == "http://127.0.0.1:9000"
    assert router[router.index("--decode") + 1:router.index("--decode") + 3] == [p.url for p in procs[1:3]]
    assert router[router.index("--policy") + 1] == "round-robin"
    shared = plan(parse_spec({**LOCAL, "kvTransfer": {"connector": "SharedStorageConnector"}}), "/ckpt",
                  "127.0.0.1", 8000, lambda: next(ports), "/kv").processes
    assert "--kv-shared-storage-path" in shared[0].argv and "--kv-side-channel-port" not in shared[0].argv
    assert "'{\"model\": \"tiny\"" in curl_example("http://r", "tiny")


def test_every_local_worker_gets_the_runs_hand_off_key_and_a_key_the_spec_names_wins():
    from disagg.worker.local.launcher import handoff_env

    ports = iter(range(9000, 9100))
    key = handoff_env("demo")
    assert key["DISAGG_HANDOFF_RESOURCE"] == "local/demo" and key != handoff_env("demo")  # fresh per run
    procs = plan(parse_spec(LOCAL), "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv", handoff=key).processes
    assert [p.env.get("DISAGG_HANDOFF_KEY") for p in procs] == [key["DISAGG_HANDOFF_KEY"]] * 3 + [None]
    own = {**LOCAL, "decode": {"replicas": 1, "env": [{"name": "DISAGG_HANDOFF_KEY", "value": "mine"}]}}
    procs = plan(parse_spec(own), "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv", handoff=key).processes
    assert procs[1].env["DISAGG_HANDOFF_KEY"] == "mine"


def test_pod_urls_keep_running_pods_with_an_ip():
    def pod(phase: str, ip: str | None, deleting: bool = False) -> SimpleNamespace:
        return SimpleNamespace(status=SimpleNamespace(phase=phase, pod_ip=ip),
                               metadata=SimpleNamespace(deletion_timestamp="t" if deleting else None))
    pods = [pod("Running", "10.0.0.2"), pod("Pending", None), pod("Running", "10.0.0.3", deleting=True),
            pod("Running", "10.0.0.1")]
    assert pod_urls(pods, 8000) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_pools_prefer_the_paired_revision_during_a_rollout():
    pool = EndpointPool("decode")
    pool.set_urls(["old", "new"], {"old": "r1", "new": "r2"})
    for ep in pool.endpoints.values():
        ep.ready = True
    assert {pool.pick(revisions={"r2"}).url for _ in range(4)} == {"new"}
    assert {pool.pick(revisions={"r1"}).url for _ in range(4)} == {"old"}
    assert pool.pick(revisions={"r3"}) is not None  # no pod of that revision: any ready one
    assert pool.pick(exclude={"new"}, revisions={"r2"}).url == "old"  # retry falls back
    assert pool.ready_revisions() == {"r1", "r2"}


def test_pod_revisions_read_the_operator_label():
    from disagg.worker.router.discovery import pod_revisions

    pod = SimpleNamespace(status=SimpleNamespace(phase="Running", pod_ip="10.0.0.9"),
                          metadata=SimpleNamespace(deletion_timestamp=None, labels={"disagg.dev/revision": "abc"}))
    assert pod_revisions([pod], 8000) == {"http://10.0.0.9:8000": "abc"}


def test_local_vllm_processes_get_cores_of_their_own():
    """Every vLLM process bound to every core (vLLM's default) made three of them on 2 cores decode at
    0.1-1.4 tokens/s; `disagg up` splits the cores among the most workers the spec runs."""
    from disagg.worker.local.launcher import vllm_cpu_bind

    vllm = {**LOCAL, "engine": "vllm", "kvTransfer": {"connector": "NixlConnector"}}
    spec = parse_spec({**vllm, "decode": {**LOCAL["decode"], "replicas": 2}})
    binds = [vllm_cpu_bind(spec, role, i, cores=list(range(8))) for role, i in
             (("prefill", 0), ("decode", 0), ("decode", 1))]
    assert binds == ["0,1", "2,3", "4,5"]  # 8 cores // 3 slots, the rest left free
    assert [vllm_cpu_bind(spec, r, i, cores=[0, 1]) for r, i in (("prefill", 0), ("decode", 0), ("decode", 1))] \
        == ["0", "1", "0"]
    decode_only = parse_spec({**vllm, "prefill": {"replicas": 0}, "decode": {**LOCAL["decode"], "replicas": 2}})
    assert [vllm_cpu_bind(decode_only, "decode", i, cores=list(range(8))) for i in (0, 1)] == ["0,1,2,3", "4,5,6,7"]
    auto = parse_spec({**vllm, "autoscaling": {"enabled": True, "prefill": {"minReplicas": 1, "maxReplicas": 2},
                                               "decode": {"minReplicas": 1, "maxReplicas": 2}}})
    assert vllm_cpu_bind(auto, "decode", 1, cores=list(range(8))) == "6,7"  # sized for the max replicas
    tp = parse_spec({**vllm, "decode": {**LOCAL["decode"], "replicas": 1, "tensorParallelSize": 2}})
    assert vllm_cpu_bind(tp, "decode", 0, cores=list(range(8))) == "4,5|6,7"  # one list per rank


def test_local_workers_of_our_engine_get_a_thread_per_core_of_their_share(monkeypatch):
    """torch starts a thread per core in every worker; several workers on one machine then wait on each other's
    descheduled threads (2 workers on 2 cores: 26 req/s within the SLO with 2 threads each, 38 with one)."""
    from disagg.worker.local import launcher

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = parse_spec({**LOCAL, "decode": {**LOCAL["decode"], "replicas": 1}})
    ports = iter(range(9000, 9100))
    monkeypatch.setattr(launcher, "usable_cores", lambda: list(range(8)))
    procs = launcher.plan(spec, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").workers
    assert [p.env["OMP_NUM_THREADS"] for p in procs] == ["4", "4"]  # 8 cores, 1 prefill + 1 decode
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1])
    three = parse_spec({**LOCAL, "decode": {**LOCAL["decode"], "replicas": 2}})
    procs = launcher.plan(three, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").workers
    assert [p.env["OMP_NUM_THREADS"] for p in procs] == ["1", "1", "1"]  # fewer cores than workers: one each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is inherited, not replaced
    procs = launcher.plan(three, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").workers
    assert all("OMP_NUM_THREADS" not in p.env for p in procs)


@pytest.mark.parametrize("requested, env, expected", [
    (3, {"OMP_NUM_THREADS": "2"}, (3, "--cpu-threads")),
    (0, {"OMP_NUM_THREADS": "2"}, (2, "OMP_NUM_THREADS")),
    (0, {"OMP_NUM_THREADS": "lots"}, (5, "the usable cores")),
    (0, {}, (5, "the usable cores")),
])
def test_a_worker_sizes_its_cpu_kernels_flag_then_environment_then_usable_cores(monkeypatch, requested, env,
                                                                                 expected):
    from disagg.worker import cores

    monkeypatch.setattr(cores, "usable_cores", lambda: list(range(5)))
    assert cores.cpu_threads(requested, env) == expected


def test_a_vllm_bind_the_user_set_is_kept(monkeypatch):
    vllm = parse_spec({**LOCAL, "engine": "vllm", "kvTransfer": {"connector": "NixlConnector"},
                       "prefill": {**LOCAL["prefill"], "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND",
                                                                "value": "nobind"}]}})
    ports = iter(range(9000, 9100))
    procs = plan(vllm, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv", vllm_executable="/bin/true").processes
    assert procs[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert procs[1].env["VLLM_CPU_OMP_THREADS_BIND"]  # decode: the launcher's choice
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    procs = plan(vllm, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv", vllm_executable="/bin/true").processes
    assert "VLLM_CPU_OMP_THREADS_BIND" not in procs[1].env  # inherited from the caller's environment


def test_the_worker_sets_torchs_thread_pool_to_what_it_chose():
    import torch

    from disagg.worker.cores import set_cpu_threads

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
