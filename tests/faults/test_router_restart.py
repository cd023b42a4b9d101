"""The router restarted with streams in flight, behind it 1 prefill + 1 decode worker (SharedStorageConnector):

- SIGTERM (a rollout, a scale-down): /ready turns 503 at once while requests are still served for --drain-delay;
  then the listener closes and each open stream ends with its whole answer, or - past --drain-timeout - with an
  SSE error event (503) and [DONE]: never a silent cut; the process exits 0;
- SIGKILL (a crashed node): each client's connection breaks (no [DONE]: the client knows it is incomplete);
- either way the workers abort what the router no longer listens to: nothing left running, KV usage back to 0;
  a router started again on the same port serves."""
from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest
from waiting import wait_for

import serving_fleet
from ctl_fixtures import wait_idle
from overload_fixtures import body, pd_fleet, read_stream

from disagg.worker.local.process import LocalProcess, ProcessSpec, is_ready

pytestmark = pytest.mark.slow

DRAIN_DELAY_S, DRAIN_TIMEOUT_S = 1.0, 2.0
FLAGS = ["--drain-delay", str(DRAIN_DELAY_S), "--drain-timeout", str(DRAIN_TIMEOUT_S)]
SHORT, LONG = 8, 8000  # tokens: done well within the drain timeout; still streaming when it runs out
# a context long enough that a stream outlives the drain: 2000 tokens did not on a quiet machine (the tiny model
# writes 200-700 tokens/s on 2 cores); 4 long streams fit the KV cache (16-token blocks)
MAX_MODEL_LEN = 8192
WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                "--num-kv-blocks", str(4 * MAX_MODEL_LEN // 16 + 64), "--served-model-name", "tiny-llama"]
SLACK_S = 15.0  # a shared 2-core machine


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from disagg.worker.model import write_tiny_checkpoint

    model_dir = str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-8k"),
                                          max_position_embeddings=MAX_MODEL_LEN))
    with pd_fleet(tmp_path_factory.mktemp("router-restart"), model_dir, WORKER_FLAGS, tuple(FLAGS)) as pd:
        yield pd


def restart(fleet: serving_fleet.Fleet, old: LocalProcess) -> str:
    """The same router command again (same port), once it is ready."""
    proc = LocalProcess(ProcessSpec(old.spec.name, old.spec.argv, old.spec.url), fleet.log_dir)
    proc.start()
    fleet.procs[old.spec.name] = proc
    fleet.killed.discard(old.spec.name)
    wait_for(lambda: is_ready(proc.spec.url), 60, "the restarted router ready")
    return proc.spec.url


def streams_in_flight(url: str, lengths: list[int]) -> list[concurrent.futures.Future]:
    pool = concurrent.futures.ThreadPoolExecutor(len(lengths))
    futures = [pool.submit(read_stream, url, body(n)) for n in lengths]
    pool.shutdown(wait=False)
    return futures


def test_sigterm_drains_each_stream_to_its_whole_answer_or_an_error_event(pd, record_outcome):
    fleet = pd["fleet"]
    router = fleet.procs["router"]
    url = router.spec.url
    futures = streams_in_flight(url, [SHORT, SHORT, LONG, LONG])
    time.sleep(1.0)  # every stream has started
    started = time.monotonic()
    router.terminate()
    # the signal is handled within a moment, well inside the drain delay, while the listener is still open
    r = wait_for(lambda: (r := httpx.get(f"{url}/ready", timeout=5)).status_code == 503 and r, DRAIN_DELAY_S / 2,
                 "/ready 503 after SIGTERM")
    assert r.json()["reason"] == "draining"
    late = read_stream(url, body(SHORT))  # still served during the drain delay
    assert late.kind == "whole" and late.tokens == SHORT, late
    ends = [f.result(timeout=DRAIN_DELAY_S + DRAIN_TIMEOUT_S + SLACK_S) for f in futures]
    assert router.popen.wait(30) == 0
    took = time.monotonic() - started
    for end in ends:
        assert end.kind in ("whole", "error"), f"a stream was cut silently: {end}"
        if end.kind == "whole":
            assert end.tokens in (SHORT, LONG)
        else:
            assert end.error["code"] == 503 and "drain timeout" in end.error["message"], end
    assert [e.kind for e in ends[:2]] == ["whole", "whole"], ends
    assert any(e.kind == "error" for e in ends[2:]), "the long streams outlived the drain timeout"
    record_outcome("router SIGTERM, streams in flight", "whole answers; long ones: SSE 503 event", took,
                   DRAIN_DELAY_S + DRAIN_TIMEOUT_S + SLACK_S)
    wait_idle(pd["workers"])
    url = restart(fleet, router)
    assert read_stream(url, body(SHORT)).kind == "whole"


def test_sigkill_breaks_the_clients_connections_and_the_workers_abort_their_requests(pd, record_outcome):
    fleet = pd["fleet"]
    router = fleet.procs["router"]
    futures = streams_in_flight(router.spec.url, [LONG] * 4)
    time.sleep(1.0)
    started = time.monotonic()
    router.kill()
    fleet.killed.add("router")
    ends = [f.result(timeout=SLACK_S) for f in futures]
    assert all(e.kind == "cut" for e in ends), ends  # no [DONE]: the client knows the answer is incomplete
    wait_idle(pd["workers"], timeout_s=10 + SLACK_S)
    record_outcome("router SIGKILL, streams in flight", "connections broken; workers idle",
                   time.monotonic() - started, 10 + SLACK_S)
    url = restart(fleet, router)
    assert read_stream(url, body(SHORT)).kind == "whole"
