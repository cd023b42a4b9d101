"""Slowloris clients against the router in front of 1 prefill + 1 decode worker, and against a worker directly:
connections that trickle their headers a byte at a time, and requests whose body never finishes (Content-Length
says more than ever comes). They hold a socket each and nothing else - no engine resources (the workers read
idle meanwhile) - other clients are served as usual, and a stalled body is answered 408 after
--request-body-timeout (counted by the worker as body_timeout)."""
from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from ctl_fixtures import gauges, router_counter, wait_idle
from overload_fixtures import body, pd_fleet, read_stream

pytestmark = pytest.mark.slow

BODY_TIMEOUT_S = 2.0
FLAGS = ("--request-body-timeout", str(BODY_TIMEOUT_S))
TRICKLERS, STALLERS = 100, 50
SLACK_S = 10.0


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    with pd_fleet(tmp_path_factory.mktemp("slowloris"), tiny_model_dir, router_flags=FLAGS, prefill_extra=FLAGS,
                  decode_extra=FLAGS) as pd:
        yield pd


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def trickle_headers(url: str, stop: threading.Event) -> None:
    """Headers one byte every 0.2 s, never finished."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 10000
    with connect(url) as s:
        for byte in head:
            if stop.wait(0.2):
                return
            s.sendall(bytes([byte]))


def stall_body(url: str) -> bytes:
    """Headers promising 10000 bytes of body, 10 sent; the server's answer (the 408)."""
    with connect(url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000\r\n\r\n{\"prompt\":")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}"):
                break
        return answer


def test_slow_clients_hold_no_engine_resources_and_do_not_stop_others(pd, record_outcome):
    router, decode = pd["router"], pd["decode"]
    stop = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(TRICKLERS + 2 * STALLERS)
    try:
        for _ in range(TRICKLERS):
            pool.submit(trickle_headers, router, stop)
        started = time.monotonic()
        stalled = [pool.submit(stall_body, url) for url in (router, decode) for _ in range(STALLERS)]
        time.sleep(0.5)
        for _ in range(5):  # other clients meanwhile: served as usual
            t = time.monotonic()
            end = read_stream(router, body(16))
            assert end.kind == "whole" and end.tokens == 16 and time.monotonic() - t < SLACK_S, end
        for w in pd["workers"]:  # nothing of the slow ones reached an engine
            g = gauges(w)
            assert g["vllm:num_requests_running"] == g["vllm:num_requests_waiting"] == 0, g
        answers = [f.result(timeout=BODY_TIMEOUT_S + SLACK_S) for f in stalled]
        took = time.monotonic() - started
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:2]
        assert router_counter(decode, "disagg:requests_rejected_total", reason="body_timeout") == STALLERS
        record_outcome("slowloris: trickled headers, stalled bodies", "others served; stalled bodies 408", took,
                       BODY_TIMEOUT_S + SLACK_S)
        end = read_stream(router, body(16, stream=False))
        assert end.kind == "whole" and end.tokens == 16
    finally:
        stop.set()
        pool.shutdown(wait=True)
    wait_idle(pd["workers"])
