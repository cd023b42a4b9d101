"""`disagg up`'s worker processes as a small local Deployment per role (`WorkerSet`), and the operator's autoscaling
policy acting on them (`LocalAutoscaler`): every spec.autoscaling.intervalSeconds, scrape each serving worker's
/metrics, `decide()`, then start or retire processes.

The router follows an endpoints file that only this module writes. A worker leaves without losing work: it is
taken out of the file first, SIGTERM follows once the router no longer lists it, and the worker's drain finishes
its running requests and keeps KV not yet pulled until read or the lease ends. The least-loaded worker of the role
(running + waiting requests + pending KV, by its last sample) is the one that leaves.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from disagg.operator import metrics_source as ms
from disagg.operator.autoscale import Decision, ScalingHistory, decide
from disagg.operator.autoscale_inputs import ROLES, policy_from_spec
from disagg.worker.local.process import LocalProcess, ProcessSpec, is_ready
from disagg.worker.router.discovery import write_endpoints

logger = logging.getLogger("disagg.launcher")

# a worker's life in the set: starting -> serving -> leaving (out of the endpoints file) -> draining (SIGTERM'd)
STARTING, SERVING, LEAVING, DRAINING = "starting", "serving", "leaving", "draining"
ACTIVE = (STARTING, SERVING)  # counted as replicas, listed in the endpoints file
MAX_EVENTS = 20  # scaling events kept for /status


class WorkerSet:
    """The prefill and decode worker processes; `step()` (every supervision tick) moves them along their states,
    restarts an active one that died, and writes the endpoints file when membership changes."""

    def __init__(self, new_worker: Callable[[str, int], ProcessSpec], log_dir: Path, endpoints_file: Path,
                 router_url: str, say: Callable[[str], None], *, leave_timeout_s: float = 5.0,
                 grace_s: Callable[[str], float] = lambda role: 120.0, clock: Callable[[], float] = time.monotonic):
        self.new_worker = new_worker  # (role, index) -> the process to start on fresh ports
        self.log_dir = log_dir
        self.endpoints_file = endpoints_file
        self.router_url = router_url
        self.say = say
        self.leave_timeout_s = leave_timeout_s  # SIGTERM even if the router still lists it after this
        self.grace_s = grace_s  # role -> seconds a draining worker gets before it is killed
        self.clock = clock
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

    def retire(self, role: str, n: int, loads: dict[str, float]) -> list[LocalProcess]:
        """Take the n least-loaded active workers of `role` out of the endpoints file; SIGTERM comes in step()."""
        victims = choose_victims(self.active(role), loads, n)
        for p in victims:
            self._set(p, LEAVING)
            self.say(f"  {p.spec.name:<10} leaving   {p.spec.url} (load {loads.get(p.spec.name, 0):.0f})")
        self.write_endpoints()
        return victims

    def write_endpoints(self) -> None:
        urls = {role: [p.spec.url for p in self.active(role)] for role in ROLES}
        key = (tuple(urls["prefill"]), tuple(urls["decode"]))
        if key != self._written:
            write_endpoints(self.endpoints_file, urls["prefill"], urls["decode"])
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
            body = httpx.get(f"{self.router_url}/endpoints", timeout=1.0).json()
        except (httpx.HTTPError, ValueError):
            return True  # unknown: wait for the timeout
        return any(e.get("url") == url for role in ROLES for e in body.get(role, []))

    def _set(self, p: LocalProcess, state: str) -> None:
        p.state, p.state_since = state, self.clock()

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": p.spec.name, "role": p.spec.role, "url": p.spec.url, "state": p.state,
                 "pid": p.popen.pid if p.popen else None} for p in list(self.workers)]


def choose_victims(candidates: list[LocalProcess], loads: dict[str, float], n: int) -> list[LocalProcess]:
    """Not-yet-serving workers first (no load), then the least loaded; ties: the newest (highest index)."""
    def key(p: LocalProcess) -> tuple:
        index = int(p.spec.name.rsplit("-", 1)[1])
        return (p.state != STARTING, loads.get(p.spec.name, 0.0), -index)
    return sorted(candidates, key=key)[:max(n, 0)]


load_of = ms.pod_load  # work a worker would have to finish while draining (the operator ranks pods the same way)


# ---------------------------------------------------------------- the autoscaling loop
class LocalAutoscaler:
    def __init__(self, autoscaling: Any, workers: WorkerSet, say: Callable[[str], None],
                 clock: Callable[[], float] = time.time,
                 scrape: Callable[[list[LocalProcess]], list[ms.PodSample]] | None = None):
        self.spec = autoscaling  # spec.autoscaling
        self.scrape = scrape or (lambda procs: scrape_all(procs, autoscaling.metrics_source.timeout_seconds, clock))
        self.policy = policy_from_spec(autoscaling)
        self.workers = workers
        self.say = say
        self.clock = clock
        self.history = ScalingHistory()
        self.last_decision: dict[str, Any] | None = None  # for /status
        self.events: list[dict[str, Any]] = []  # decisions that changed (dry run: would change) a role, newest last
        if autoscaling.metrics_source.type != "scrape":
            say("  autoscaling: disagg up scrapes each worker's /metrics; metricsSource.type "
                f"{autoscaling.metrics_source.type!r} is ignored")

    def tick(self) -> Decision:
        samples = self.scrape(self.workers.serving())
        by_role = {role: [s for s in samples if s.role == role] for role in ROLES}
        current = self.workers.counts()
        decision = decide(by_role, current, self.policy, self.history, self.clock())
        self.history = decision.history
        self.last_decision = decision_json(decision, self.spec.dry_run)
        loads = {s.pod: load_of(s) for s in samples if not s.missing}
        for role, d in decision.roles.items():
            if d.desired == d.current:
                continue
            event = {"time": iso(decision.time), "role": role, "from": d.current, "to": d.desired, "reason": d.reason,
                     "dryRun": self.spec.dry_run, "metrics": role_metrics(decision, role)}
            if self.spec.dry_run and self._repeats(event):
                continue  # nothing changes in a dry run: report a would-be change once, not every interval
            self.events = [*self.events, event][-MAX_EVENTS:]
            self.say(scaling_line(event))
            if not self.spec.dry_run:
                self._apply(role, d.current, d.desired, loads)
        logger.debug("autoscale decision: %s", self.last_decision)  # every tick; the console shows changes
        return decision

    def _repeats(self, event: dict[str, Any]) -> bool:
        last = next((e for e in reversed(self.events) if e["role"] == event["role"]), None)
        return last is not None and all(last[k] == event[k] for k in ("from", "to", "reason"))

    def _apply(self, role: str, current: int, desired: int, loads: dict[str, float]) -> None:
        for _ in range(desired - current):
            self.workers.add(role)
        if desired < current:
            self.workers.retire(role, current - desired, loads)

    def status(self) -> dict[str, Any]:
        return {"enabled": True, "dryRun": self.spec.dry_run, "intervalSeconds": self.spec.interval_seconds,
                "lastDecision": self.last_decision, "events": self.events}


def scrape_all(procs: list[LocalProcess], timeout: float, clock: Callable[[], float]) -> list[ms.PodSample]:
    return ms.scrape_pods([(f"{p.spec.url}/metrics", p.spec.name, p.spec.role) for p in procs], timeout, clock)


# ---------------------------------------------------------------- reporting (pure)
def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# not named after the role but signals of it: KV waiting at prefill to be pulled, or left unpulled until its lease
# ran out, means decode is short
CROSS_ROLE_SIGNALS = {"decode": ("prefill_pending_sends_per_pod", "expired_leases")}


def role_metrics(decision: Decision, role: str) -> dict[str, float]:
    """The decision's numbers behind this role's change (its own, transfers and cross-role signals), without the
    ones nobody measured."""
    extra = CROSS_ROLE_SIGNALS.get(role, ())
    return {k: round(v, 4) for k, v in decision.metrics.items()
            if v is not None and (k.startswith(f"{role}_") or k.startswith("xfer_") or k in extra)}


def scaling_line(event: dict[str, Any]) -> str:
    values = " ".join(f"{k}={v:g}" for k, v in event["metrics"].items())
    dry = " (dry run)" if event["dryRun"] else ""
    change = f"{event['role']} {event['from']} -> {event['to']} ({event['reason']})"
    return f"[{event['time']}] autoscale{dry}: {change} {values}"


def decision_json(d: Decision, dry_run: bool) -> dict[str, Any]:
    return {"time": iso(d.time), "reason": d.reason, "bottleneck": d.bottleneck, "dryRun": dry_run,
            "roles": {r: {"current": x.current, "desired": x.desired, "reason": x.reason,
                          "recommendation": x.recommendation, "limitedBy": x.limited_by} for r, x in d.roles.items()},
            "metrics": d.metrics,
            "conditions": [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message}
                           for c in d.conditions]}
