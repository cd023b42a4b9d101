"""Metric sources: exposition parsing, histogram arithmetic, direct scrape and the Prometheus API, against tiny
HTTP servers on 127.0.0.1 (free port, stopped by the fixture)."""
from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from disagg.operator.autoscaling.samples import (
    FAILED_TRANSFERS, ITL, KV_CACHE_USAGE, NUM_REQUESTS_WAITING, PENDING_SENDS, TTFT, Histogram, histogram_delta,
    histogram_quantile, merge_histograms,
)
from disagg.operator.autoscaling.sources import PrometheusSource, parse_prometheus_text, scrape_pod

# what prometheus_client writes for a prefill worker serving one model (two label sets for waiting: LoRA-less
# workers have one, but summing must not depend on that)
EXPOSITION = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny",role="prefill"} 3.0
vllm:num_requests_waiting{model_name="tiny-b",role="prefill"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny",role="prefill"} 0.25
# HELP disagg:kv_pending_sends Requests whose KV waits at prefill to be pulled.
# TYPE disagg:kv_pending_sends gauge
disagg:kv_pending_sends{model_name="tiny",role="prefill"} 7.0
# HELP vllm:nixl_num_failed_transfers_total Failed NIXL transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{model_name="tiny",role="prefill"} 4.0
# HELP vllm:nixl_num_failed_transfers_created Failed NIXL transfers.
# TYPE vllm:nixl_num_failed_transfers_created gauge
vllm:nixl_num_failed_transfers_created{model_name="tiny",role="prefill"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny",role="prefill"} 2.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="tiny",role="prefill"} 6.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="tiny",role="prefill"} 9.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny",role="prefill"} 10.0
vllm:time_to_first_token_seconds_count{model_name="tiny",role="prefill"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="tiny",role="prefill"} 4.5
"""


def test_parse_realistic_exposition():
    s = parse_prometheus_text(EXPOSITION, pod="p-0", timestamp=12.0)
    assert (s.pod, s.role, s.timestamp, s.missing) == ("p-0", "prefill", 12.0, False)
    assert s.values[NUM_REQUESTS_WAITING] == 5.0  # summed over label sets
    assert s.values[KV_CACHE_USAGE] == 0.25
    assert s.values[PENDING_SENDS] == 7.0
    assert s.values[FAILED_TRANSFERS] == 4.0  # counter keyed without _total
    assert not any(k.endswith("_created") for k in s.values)
    h = s.histograms[TTFT]
    assert h.buckets == ((0.1, 2.0), (0.5, 6.0), (1.0, 9.0), (math.inf, 10.0))
    assert (h.sum, h.count, h.mean) == (4.5, 10.0, 0.45)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_prometheus_text("this is { not metrics")


def H(*buckets, s=0.0):
    return Histogram(tuple(buckets), s, buckets[-1][1])


@pytest.mark.parametrize("name, hist, q, expected", [
    ("uniform in first bucket", H((1.0, 10), (math.inf, 10)), 0.5, 0.5),
    ("interpolated in second", H((0.1, 0), (0.5, 10), (math.inf, 10)), 0.9, 0.46),
    ("in +Inf returns last bound", H((0.1, 1), (0.5, 2), (math.inf, 10)), 0.9, 0.5),
    ("empty", H((0.1, 0), (math.inf, 0)), 0.9, None),
])
def test_histogram_quantile(name, hist, q, expected):
    got = histogram_quantile(q, hist)
    assert got == pytest.approx(expected) if expected is not None else got is None, name


@pytest.mark.parametrize("name, cur, prev, expected", [
    ("window", H((0.1, 5), (math.inf, 8), s=3.0), H((0.1, 1), (math.inf, 2), s=1.0),
     H((0.1, 4), (math.inf, 6), s=2.0)),
    ("first read", H((0.1, 5), (math.inf, 8)), None, None),
    ("reset (pod restarted)", H((0.1, 0), (math.inf, 1)), H((0.1, 1), (math.inf, 2)), None),
    ("bounds changed", H((0.2, 5), (math.inf, 8)), H((0.1, 1), (math.inf, 2)), None),
])
def test_histogram_delta(name, cur, prev, expected):
    assert histogram_delta(cur, prev) == expected, name


def test_merge_histograms_sums_buckets():
    m = merge_histograms([H((0.1, 1), (math.inf, 2), s=1.0), H((0.1, 3), (math.inf, 3), s=0.5)])
    assert m == Histogram(((0.1, 4), (math.inf, 5)), 1.5, 5)
    assert merge_histograms([]) is None


# ---------------------------------------------------------------- live servers
def _serve(handler_cls):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)  # port 0: the OS picks a free one
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def metrics_server():
    class Handler(BaseHTTPRequestHandler):
        delay = 0.0

        def do_GET(self):
            time.sleep(Handler.delay)
            if self.path != "/metrics":
                self.send_error(404)
                return
            _reply(self, 200, EXPOSITION.encode(), "text/plain; version=0.0.4")

        def log_message(self, *_):
            pass

    server = _serve(Handler)
    yield server, Handler
    server.shutdown()
    server.server_close()


def test_scrape_pod(metrics_server):
    server, _ = metrics_server
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    s = scrape_pod(url, pod="p-0", role="prefill", timeout=2.0, clock=lambda: 100.0)
    assert not s.missing and s.timestamp == 100.0
    assert s.values[NUM_REQUESTS_WAITING] == 5.0 and s.histograms[TTFT].count == 10.0


def test_scrape_http_error_is_missing(metrics_server):
    server, _ = metrics_server
    s = scrape_pod(f"http://127.0.0.1:{server.server_address[1]}/nope", pod="p-0", role="prefill", timeout=2.0)
    assert s.missing and "404" in s.error


def test_scrape_timeout_is_missing(metrics_server):
    server, handler = metrics_server
    handler.delay = 1.0
    t = time.monotonic()
    s = scrape_pod(f"http://127.0.0.1:{server.server_address[1]}/metrics", pod="p-0", role="prefill", timeout=0.2)
    assert s.missing and "Timeout" in s.error
    assert time.monotonic() - t < 0.9


def test_scrape_refused_is_missing():
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scrape_pod(f"http://127.0.0.1:{port}/metrics", pod="d-1", role="decode", timeout=1.0, clock=lambda: 5.0)
    assert s.missing and s.role == "decode" and s.timestamp == 5.0 and "Connect" in s.error


# ---------------------------------------------------------------- Prometheus API
def _vector(*series):
    return {"status": "success", "data": {"resultType": "vector", "result": list(series)}}


def _s(name, value, pod, role, ts=1000.0, **labels):
    return {"metric": {"__name__": name, "pod": pod, "role": role, "model_name": "tiny", **labels},
            "value": [ts, str(value)]}


SERIES = _vector(
    _s("vllm:num_requests_waiting", 3, "p-0", "prefill"),
    _s("disagg:kv_pending_sends", 1, "p-0", "prefill"),
    _s("vllm:kv_cache_usage_perc", 0.5, "d-0", "decode"),
    _s("vllm:nixl_num_failed_transfers_total", 2, "d-0", "decode"),
    _s("vllm:inter_token_latency_seconds_bucket", 4, "d-0", "decode", le="0.05"),
    _s("vllm:inter_token_latency_seconds_bucket", 10, "d-0", "decode", le="+Inf"),
    _s("vllm:inter_token_latency_seconds_sum", 0.6, "d-0", "decode"),
    _s("vllm:inter_token_latency_seconds_count", 10, "d-0", "decode"),
)
STAMPS = _vector({"metric": {"pod": "p-0", "role": "prefill"}, "value": [1000.0, "990.5"]},
                 {"metric": {"pod": "d-0", "role": "decode"}, "value": [1000.0, "940.0"]})


@pytest.fixture
def prometheus_server():
    queries = []

    class Handler(BaseHTTPRequestHandler):
        broken = False

        def do_GET(self):
            url = urlparse(self.path)
            query = parse_qs(url.query)["query"][0]
            queries.append(query)
            if Handler.broken:
                body, status = b'{"status":"error","errorType":"bad_data","error":"parse error"}', 400
            else:
                body, status = json.dumps(STAMPS if query.startswith("timestamp(") else SERIES).encode(), 200
            _reply(self, status, body, "application/json")

        def log_message(self, *_):
            pass

    server = _serve(Handler)
    yield server, Handler, queries
    server.shutdown()
    server.server_close()


def test_prometheus_source(prometheus_server):
    server, _, queries = prometheus_server
    src = PrometheusSource(f"http://127.0.0.1:{server.server_address[1]}/", timeout=2.0, selector='namespace="ml"')
    samples = {s.pod: s for s in src.fetch()}
    assert set(samples) == {"p-0", "d-0"}
    p, d = samples["p-0"], samples["d-0"]
    assert (p.role, p.timestamp, p.values[NUM_REQUESTS_WAITING], p.values[PENDING_SENDS]) == ("prefill", 990.5, 3, 1)
    assert (d.role, d.timestamp, d.values[KV_CACHE_USAGE], d.values[FAILED_TRANSFERS]) == ("decode", 940.0, 0.5, 2)
    assert d.histograms[ITL] == Histogram(((0.05, 4), (math.inf, 10)), 0.6, 10)
    assert all('namespace="ml"' in q for q in queries) and queries[1].startswith("timestamp(")


def test_prometheus_error_is_reported_not_raised(prometheus_server):
    server, handler, _ = prometheus_server
    handler.broken = True
    got = PrometheusSource(f"http://127.0.0.1:{server.server_address[1]}", timeout=2.0).fetch()
    assert isinstance(got, str) and "400" in got
