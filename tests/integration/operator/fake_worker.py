"""Fake workers for autoscaling tests: each serves the real worker's metrics (disagg.worker.server.metrics.WorkerMetrics:
vLLM/disagg names, model_name and role labels) at /metrics on 127.0.0.1:<free port>, values set by the test.
Each stops on stop(), or by itself after `lifetime_s` so a failed test leaves no server behind."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from disagg.worker.server.metrics import WorkerMetrics


class FakeWorker:
    def __init__(self, role: str, model_name: str = "m", lifetime_s: float = 60.0):
        self.metrics = WorkerMetrics(model_name, role)
        registry = self.metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"fake-{role}-worker", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        self._stopped = False

    def set(self, *, running: int = 0, waiting: int = 0, kv_cache_usage: float = 0.0, pending_sends: int = 0,
            pending_loads: int = 0) -> None:
        m = self.metrics
        m.num_requests_running.set(running)
        m.num_requests_waiting.set(waiting)
        m.kv_cache_usage_perc.set(kv_cache_usage)
        m.kv_pending_sends.set(pending_sends)
        m.kv_pending_loads.set(pending_loads)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()
