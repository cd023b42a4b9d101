"""The engine in one dedicated thread, fed from asyncio.

The engine is synchronous and not thread-safe, so only this thread touches it: it takes commands
(add, abort) from a thread-safe queue, steps, and hands each RequestOutput to the request's asyncio
queue with loop.call_soon_threadsafe. It keeps stepping while KV transfers are pending (empty steps
surface finished transfers) and sleeps briefly only when there is nothing at all to do.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from disagg.worker.server.metrics import EngineSnapshot, WorkerMetrics
from disagg.worker.engine.request_output import RequestOutput
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.kv_transfer.handoff import Handoff

logger = logging.getLogger(__name__)

IDLE_SLEEP_S = 0.001  # between empty steps while transfers are pending, and when idle


@dataclass
class _Add:
    prompt: str | list[int]
    sampling_params: SamplingParams
    request_id: str
    kv_transfer_params: Handoff | None
    sink: asyncio.Queue  # receives RequestOutputs, then None after the final one
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], Any], metrics_factory: Callable[[Any], WorkerMetrics],
                 publish_kv_events: Callable[[Any], None] | None = None):
        self._engine_factory = engine_factory
        self._publish_kv_events = publish_kv_events  # takes an EventBatch (thread-safe); None: events are off
        self._metrics_factory = metrics_factory
        self.engine: Any = None  # set once loaded; read-only outside the thread (name, tokenizer, limits)
        self.metrics: WorkerMetrics | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set when loaded or when loading failed
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: str | None = None  # why the engine thread died, if it did
        self.busy = False  # engine has unfinished requests or pending KV work (written by the engine thread)

    # ---------------------------------------------------------------- lifecycle (event loop side)
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.dead is None

    def idle(self) -> bool:
        """No request in flight and no KV held for or awaited from another worker."""
        return not self._sinks and not self.busy

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- requests (event loop side)
    async def add(self, prompt: str | list[int], sp: SamplingParams, request_id: str,
                  kv_transfer_params: Handoff | None) -> asyncio.Queue:
        """Queue a request; raises ValueError (bad input) as the engine would. Returns the output queue."""
        if not self.ready:
            raise RuntimeError(self.dead or "engine is not loaded")
        cmd = _Add(prompt, sp, request_id, kv_transfer_params, asyncio.Queue())
        self._commands.put(cmd)
        await asyncio.wrap_future(cmd.accepted)
        return cmd.sink

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def stream(self, sink: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            out = await sink.get()
            if out is None:
                return
            yield out
            if out.finished:
                return

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
            self.metrics = self._metrics_factory(self.engine)
        except Exception as e:  # noqa: BLE001 - reported by /health and the CLI
            logger.exception("loading the engine failed")
            self.load_error = self.dead = f"loading the engine failed: {e}"
            self.loaded.set()
            return
        self.loaded.set()
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 - an engine bug: fail every request, /health turns 500
            logger.exception("engine thread died")
            self.dead = f"engine thread died: {e}"
            for sink in self._sinks.values():
                self._loop.call_soon_threadsafe(sink.put_nowait, None)
        finally:
            self.engine.shutdown()

    def _serve(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._take_commands(engine)
            self.busy = engine.has_unfinished_requests() or engine.has_pending_kv_work()
            if not self.busy:
                self._update_metrics(engine)
                try:  # idle: block briefly for the next command instead of spinning
                    self._handle(engine, self._commands.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            outputs = engine.step()
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    self._loop.call_soon_threadsafe(sink.put_nowait, out)
                    if out.finished:
                        del self._sinks[out.request_id]
            self._update_metrics(engine)
            if not outputs and not engine.scheduler.has_landed_remote_kv():
                # waiting on asynchronous KV: let transfers progress. Not when KV has just landed: the
                # next step admits that request; and the wait ends early when the connector sees a
                # load finish, since a plain sleep (1 ms asked, often several on a busy machine) went
                # straight into that request's time to first token
                engine.wait_for_kv_progress(IDLE_SLEEP_S)

    def _take_commands(self, engine: Any) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(engine, cmd)

    def _handle(self, engine: Any, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            if self._sinks.pop(cmd.request_id, None) is not None:  # nobody listens any more
                engine.abort_request(cmd.request_id)
            return
        try:
            engine.add_request(cmd.prompt, cmd.sampling_params, cmd.request_id, cmd.kv_transfer_params)
        except Exception as e:  # noqa: BLE001 - ValueError is bad input; the caller maps the rest to 500
            cmd.accepted.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.accepted.set_result(None)

    def _update_metrics(self, engine: Any) -> None:
        sched = engine.scheduler
        conn = engine.scheduler_connector
        pending = conn.get_pending_counts() if conn is not None else {}
        self.metrics.update_engine(EngineSnapshot(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_waiting_prompt_tokens=sum(r.num_prompt_tokens for r in sched.waiting),
            kv_cache_usage=engine.kv_cache_manager.usage(),
            num_preemptions_total=sched.num_preemptions_total,
            prompt_tokens_total=engine.stats.prompt_tokens, generation_tokens_total=engine.stats.generation_tokens,
            pending_sends=pending.get("pending_sends", 0), pending_loads=pending.get("pending_loads", 0),
            prefix_cache_queries_total=sched.prefix_cache_queries_total,
            prefix_cache_hits_total=sched.prefix_cache_hits_total,
        ))
        stats = engine.stats.kv_connector_stats
        while stats:
            self.metrics.observe_connector_stats(stats.pop(0))
        if self._publish_kv_events is not None:
            batch = engine.take_kv_events()
            if batch is not None:
                self._publish_kv_events(batch)
