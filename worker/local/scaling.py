"""`disagg up`'s worker processes as a small local Deployment per role (`WorkerSet`), and the operator's autoscaling
pass acting on them (`LocalAutoscaler`): every spec.autoscaling.intervalSeconds, the same pass as the operator's
(disagg.operator.autoscaling.scaling_pass: scrape each serving worker's /metrics, decide, choose who leaves, report);
only applying it differs: start or retire processes.

The router follows an endpoints file that only this module writes. A worker leaves without losing work: it is
taken out of the file first, SIGTERM follows once the router no longer lists it, and the worker's drain finishes
its running requests and keeps KV not yet pulled until read or the lease ends. The pass picks who leaves: a worker
still starting, else the least loaded (running + waiting requests + pending KV, by its last sample), else the newest.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from disagg.operator.autoscaling.scaling_pass import (
    ROLES, Decision, PassState, PodSample, decision_json, iso, policy_from_spec, run_pass, scaling_line,
    scrape_pods,
)
from disagg.worker.local.process import LocalProcess, ProcessSpec, is_ready
from disagg.worker.router.discovery import write_endpoints

logger = logging.getLogger("disagg.launcher")

# a worker's life in the set: starting -> serving -> leaving (out of the endpoints file) -> draining (SIGTERM'd)
STARTING, SERVING, LEAVING, DRAINING = "starting", "serving", "leaving", "draining"
ACTIVE = (STARTING, SERVING)  # counted as replicas, listed in the endpoints file
MAX_EVENTS = 20  # scaling events kept for /status
ZERO_POLL_S = 0.5  # with the pools at zero, how often the router's held count is read (demand brings them back)


class WorkerSet:
    """The prefill and decode worker processes; `step()` (every supervision tick) moves them along their states,
    restarts an active one that died, and writes the endpoints file when membership changes."""

    def __init__(self, new_worker: Callable[[str, int], ProcessSpec], log_dir: Path, endpoints_file: Path,
                 router_url: str, say: Callable[[str], None], *, leave_timeout_s: float = 5.0,
                 grace_s: Callable[[str], float] = lambda role: 120.0, clock: Callable[[], float] = time.monotonic,
                 router_verify: Any = True, on_membership: Callable[[dict[str, list[str]]], None] | None = None):
        self.new_worker = new_worker  # (role, index) -> the process to start on fresh ports
        self.log_dir = log_dir
        self.endpoints_file = endpoints_file
        self.router_url = router_url
        self.router_verify = router_verify  # httpx's verify= for an HTTPS router (disagg up --tls)
        self.say = say
        self.leave_timeout_s = leave_timeout_s  # SIGTERM even if the router still lists it after this
        self.grace_s = grace_s  # role -> seconds a draining worker gets before it is killed
        self.clock = clock
        self.on_membership = on_membership  # also told each new membership (the gateway's fail-open pool)
        self.workers: list[LocalProcess] = []
        self._written: tuple | None = None

    # ---------------------------------------------------------------- membership
    def adopt(self, procs: list[LocalProcess], state: str = SERVING) -> None:
        for p in procs:
            self._set(p, state)
        self.workers += procs
        self.write_endpoints()

    def active(self, role: str) -> list[LocalProcess]:
        return [p for p in self.workers if p.spec.role == role and p.state in ACTIVE]

    def serving(self) -> list[LocalProcess]:
        return [p for p in self.workers if p.state == SERVING]

    def counts(self) -> dict[str, int]:
        return {role: len(self.active(role)) for role in ROLES}

    def add(self, role: str) -> LocalProcess:
        used = {p.spec.name for p in self.workers}
        index = next(i for i in range(len(used) + 1) if f"{role}-{i}" not in used)
        proc = LocalProcess(self.new_worker(role, index), self.log_dir)
        proc.start()
        self.adopt([proc], STARTING)
        self.say(f"  {proc.spec.name:<10} starting  {proc.spec.url}")
        return proc

    def newest_first(self, role: str) -> list[str]:
        """The active workers' names, the newest (highest index) first: who leaves on a tie."""
        return [p.spec.name for p in sorted(self.active(role), key=_index, reverse=True)]

    def retire(self, role: str, names: list[str]) -> list[LocalProcess]:
        """Take these active workers of `role` out of the endpoints file; SIGTERM comes in step()."""
        victims = [p for p in self.active(role) if p.spec.name in names]
        for p in victims:
            self._set(p, LEAVING)
            self.say(f"  {p.spec.name:<10} leaving   {p.spec.url}")
        self.write_endpoints()
        return victims

    def write_endpoints(self) -> None:
        urls = {role: [p.spec.url for p in self.active(role)] for role in ROLES}
        key = (tuple(urls["prefill"]), tuple(urls["decode"]))
        if key != self._written:
            events = {p.spec.url: p.spec.kv_events for role in ROLES for p in self.active(role) if p.spec.kv_events}
            names = {p.spec.url: p.spec.name for role in ROLES for p in self.active(role)}
            write_endpoints(self.endpoints_file, urls["prefill"], urls["decode"], events, names)
            if self.on_membership is not None:
                self.on_membership(urls)
            self._written = key

    # ---------------------------------------------------------------- supervision
    def step(self) -> None:
        for p in list(self.workers):
            rc = p.exited()
            if p.state == DRAINING:
                if rc is not None:
                    self.workers.remove(p)
                    self.say(f"  {p.spec.name:<10} stopped   (drained, exit status {rc})")
                elif self.clock() - p.state_since > self.grace_s(p.spec.role):
                    self.say(f"  {p.spec.name} did not drain within {self.grace_s(p.spec.role):.0f}s; killing it")
                    p.kill()
            elif p.state == LEAVING:
                if rc is not None:
                    self.workers.remove(p)
                elif self.clock() - p.state_since > self.leave_timeout_s or not self._router_lists(p.spec.url):
                    p.terminate()
                    self._set(p, DRAINING)
            elif rc is not None:  # an active worker died: restart it, like a Deployment would
                self.say(f"  {p.spec.name} exited with status {rc}; restarting (log {p.log_path})")
                p.start()
                self._set(p, STARTING)
            elif p.state == STARTING and is_ready(p.spec.url, timeout=0.5):
                self._set(p, SERVING)
                self.say(f"  {p.spec.name:<10} ready     {p.spec.url}  ({time.monotonic() - p.started_at:.1f}s)")

    def _router_lists(self, url: str) -> bool:
        try:
            body = httpx.get(f"{self.router_url}/endpoints", timeout=1.0, verify=self.router_verify).json()
        except (httpx.HTTPError, ValueError):
            return True  # unknown: wait for the timeout
        return any(e.get("url") == url for role in ROLES for e in body.get(role, []))

    def _set(self, p: LocalProcess, state: str) -> None:
        p.state, p.state_since = state, self.clock()

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": p.spec.name, "role": p.spec.role, "url": p.spec.url, "state": p.state,
                 "pid": p.popen.pid if p.popen else None} for p in list(self.workers)]


def _index(p: LocalProcess) -> int:
    return int(p.spec.name.rsplit("-", 1)[1])


# ---------------------------------------------------------------- the autoscaling loop
class LocalAutoscaler:
    def __init__(self, autoscaling: Any, workers: WorkerSet, say: Callable[[str], None],
                 clock: Callable[[], float] = time.time,
                 scrape: Callable[[list[LocalProcess]], list[PodSample]] | None = None):
        self.spec = autoscaling  # spec.autoscaling
        self.scrape = scrape or (lambda procs: scrape_all(procs, autoscaling.metrics_source.timeout_seconds, clock,
                                                          workers.router_url))
        self.policy = policy_from_spec(autoscaling)
        self.workers = workers
        self.say = say
        self.clock = clock
        self.state = PassState()  # what one pass hands the next
        self.last_decision: dict[str, Any] | None = None  # for /status
        self.events: list[dict[str, Any]] = []  # decisions that changed (dry run: would change) a role, newest last
        self.at_zero = False  # scale to zero: the pools are at zero (the next tick comes soon: ZERO_POLL_S)
        if autoscaling.metrics_source.type != "scrape":
            say("  autoscaling: disagg up scrapes each worker's /metrics; metricsSource.type "
                f"{autoscaling.metrics_source.type!r} is ignored")

    def tick(self) -> Decision:
        outcome = run_pass(lambda: self.scrape(self.workers.serving()),
                           {role: self.workers.newest_first(role) for role in ROLES}, self.workers.counts(),
                           self.policy, self.state, self.clock(), self.spec.dry_run)
        self.state = outcome.state
        self.at_zero = outcome.at_zero and not self.spec.dry_run
        self.last_decision = decision_json(outcome.decision, self.spec.dry_run)
        for change in outcome.changes:
            self.events = [*self.events, change.as_json()][-MAX_EVENTS:]
            self.say(scaling_line(change))
            if self.spec.dry_run:
                continue
            for _ in range(change.to_replicas - change.from_replicas):
                self.workers.add(change.role)
            if change.role in outcome.removals:
                self.workers.retire(change.role, outcome.removals[change.role])
        logger.debug("autoscale decision: %s", self.last_decision)  # every tick; the console shows changes
        return outcome.decision

    def next_tick_in(self) -> float:
        """Seconds to the next tick: the interval, or ZERO_POLL_S at zero (a held request must not wait for it)."""
        return min(ZERO_POLL_S, self.spec.interval_seconds) if self.at_zero else self.spec.interval_seconds

    def status(self) -> dict[str, Any]:
        zero = self.state.zero
        return {"enabled": True, "dryRun": self.spec.dry_run, "intervalSeconds": self.spec.interval_seconds,
                "lastDecision": self.last_decision, "events": self.events,
                "scaleToZero": {"enabled": self.spec.scale_to_zero.enabled, "atZero": self.at_zero,
                                "reason": zero.reason if self.at_zero else None,
                                "since": iso(zero.zero_since) if self.at_zero and zero.zero_since else None,
                                "leftZeroAt": iso(zero.left_zero_at) if zero.left_zero_at else None}}


def scrape_all(procs: list[LocalProcess], timeout: float, clock: Callable[[], float],
               router_url: str | None = None) -> list[PodSample]:
    """The workers' pages, and the router's (its per-endpoint view of pending KV hand-offs, read for any engine)."""
    targets = [(f"{p.spec.url}/metrics", p.spec.name, p.spec.role) for p in procs]
    if router_url:
        targets.append((f"{router_url}/metrics", "router", "router"))
    return scrape_pods(targets, timeout, clock)
