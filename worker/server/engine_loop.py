"""The engine in one dedicated thread, fed from asyncio.

The engine is synchronous and not thread-safe, so only this thread touches it: it takes commands
(add, abort) from a thread-safe queue, steps, and hands each RequestOutput to the request's asyncio
queue with loop.call_soon_threadsafe. It keeps stepping while KV transfers are pending (empty steps
surface finished transfers; LLMEngine.step_or_wait holds the idle wait between them) and blocks on the
command queue only when there is nothing at all to do. It uses the engine only through its loop API:
add_request, abort_request, release_kv, has_unfinished_requests, has_pending_kv_work, step_or_wait, metrics_snapshot,
queue_load, take_kv_connector_stats, take_kv_events, shutdown.

With admission limits (server/admission.py) a request is queued only while the waiting queue has room: the
engine thread decides as it takes the request (`QueueFull` otherwise), and the event loop turns a flood away
before preparing it, from the engine's last reading (`load`) and the requests being prepared (`reserve`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from disagg.worker.server.admission import AdmissionLimits, QueueFull, refusal
from disagg.worker.server.metrics import WorkerMetrics
from disagg.worker.engine.request_output import RequestOutput
from disagg.worker.engine.stats import QueueLoad
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.kv_transfer.handoff import Handoff

logger = logging.getLogger(__name__)

IDLE_BLOCK_S = 0.05  # nothing to do: how long one wait for the next command lasts


@dataclass
class _Add:
    prompt: str | list[int]
    sampling_params: SamplingParams
    request_id: str
    kv_transfer_params: Handoff | None
    sink: asyncio.Queue  # receives RequestOutputs, then None after the final one
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def local_prompt_tokens(self) -> int:
        """The prompt tokens this engine computes (none of those whose KV comes from a remote prefill)."""
        remote = self.kv_transfer_params is not None and self.kv_transfer_params.remote is not None
        return 0 if remote or isinstance(self.prompt, str) else len(self.prompt)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ReleaseKV:
    request_id: str  # the hand-off's remote request id
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], Any], metrics_factory: Callable[[Any], WorkerMetrics],
                 publish_kv_events: Callable[[Any], None] | None = None, limits: AdmissionLimits | None = None):
        self._engine_factory = engine_factory
        self.limits = limits  # None: the waiting queue is not bounded
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
        self.load = QueueLoad(0, 0, 0)  # the waiting queue at the engine thread's last reading
        self._preparing = 0  # requests that passed the event loop's check and are not yet queued (or refused)

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
    def reserve(self) -> None:
        """Room for one more request by the last reading and the requests being prepared, or QueueFull; the
        caller calls `release` once the request was added or given up."""
        if self.limits is not None:
            load = self.load
            load = QueueLoad(load.waiting + self._preparing, load.waiting_prompt_tokens, load.free_slots)
            if (reason := refusal(self.limits, load, 1, 0)) is not None:
                raise QueueFull(reason, load, self.limits)
        self._preparing += 1

    def release(self) -> None:
        self._preparing -= 1

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

    async def release_kv(self, request_id: str) -> bool:
        """Free the KV this (prefill) engine keeps for request_id's reader; False when none waits here."""
        if not self.ready:
            raise RuntimeError(self.dead or "engine is not loaded")
        cmd = _ReleaseKV(request_id)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

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
                    self._handle(engine, self._commands.get(timeout=IDLE_BLOCK_S))
                except queue.Empty:
                    pass
                continue
            for out in engine.step_or_wait():
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    self._loop.call_soon_threadsafe(sink.put_nowait, out)
                    if out.finished:
                        del self._sinks[out.request_id]
            self._update_metrics(engine)

    def _take_commands(self, engine: Any) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(engine, cmd)

    def _handle(self, engine: Any, cmd: _Add | _Abort | _ReleaseKV) -> None:
        if isinstance(cmd, _ReleaseKV):
            try:
                cmd.done.set_result(engine.release_kv(cmd.request_id))
            except Exception as e:  # noqa: BLE001 - the caller answers 500; the engine goes on
                cmd.done.set_exception(e)
            return
        if isinstance(cmd, _Abort):
            if self._sinks.pop(cmd.request_id, None) is not None:  # nobody listens any more
                engine.abort_request(cmd.request_id)
            return
        if self.limits is not None:
            load = engine.queue_load()
            reason = refusal(self.limits, load, cmd.sampling_params.n, cmd.local_prompt_tokens())
            if reason is not None:
                cmd.accepted.set_exception(QueueFull(reason, load, self.limits))
                return
        try:
            engine.add_request(cmd.prompt, cmd.sampling_params, cmd.request_id, cmd.kv_transfer_params)
        except Exception as e:  # noqa: BLE001 - ValueError is bad input; the caller maps the rest to 500
            cmd.accepted.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        if self.limits is not None:
            self.load = engine.queue_load()  # before the caller hears it was queued: it counts from now on
        cmd.accepted.set_result(None)

    def _update_metrics(self, engine: Any) -> None:
        if self.limits is not None:
            self.load = engine.queue_load()
        self.metrics.update_engine(engine.metrics_snapshot())
        for stats in engine.take_kv_connector_stats():
            self.metrics.observe_connector_stats(stats)
        if self._publish_kv_events is not None:
            batch = engine.take_kv_events()
            if batch is not None:
                self._publish_kv_events(batch)
