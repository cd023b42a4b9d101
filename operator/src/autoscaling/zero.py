"""Scale to zero and back (spec.autoscaling.scaleToZero): a pure step after the policy's decision, for the
operator and `disagg up` alike.

- Idle: no request running, waiting or with KV pending at any worker, and none held at any router, for
  idle_seconds (every replica read), and none served in between: a worker whose count of first tokens (the TTFT
  histogram's) moved since the last pass served one, though every read fell between requests - light traffic
  of short requests is not idleness -> both pools to 0 together. The members to go are drained as any
  scale-down; the apply steps write prefill first, so decode goes last.
- At zero: no worker exists to export load, so the policy's min bounds would bring the pools straight back; they
  stay at 0 while no router holds a request.
- Demand at zero: a router holds a request (disagg:router_held_requests > 0; it holds while no decode is ready)
  -> prefill and decode come back together, each to max(1, minReplicas), at once.
A pool whose minReplicas is 0 while the other's is not is left to the policy (prefill at 0: decode serves alone).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.operator.autoscaling.samples import (
    HANDOFF_SIGNALS, HELD_REQUESTS, TTFT, PodSample, pod_load,
)

ROLES = ("prefill", "decode")
IDLE, HELD, AT_ZERO = "ScaledToZero", "ScaledFromZero", "AtZero"  # the roles' reasons while this step decides


@dataclass(frozen=True)
class ZeroState:
    """What one pass leaves the next (in memory, as the policy's history)."""

    idle_since: float | None = None  # seconds: nothing in flight anywhere since then (None: busy or unknown)
    zero_since: float | None = None  # when the pools were taken to zero (None: not at zero)
    left_zero_at: float | None = None  # when demand last brought them back
    reason: str | None = None  # why the pools are at zero, in words (for status and the console)
    served: dict[str, float] | None = None  # pod -> its first tokens counted at the last pass (see served_since)


@dataclass(frozen=True)
class ZeroStep:
    desired: dict[str, int] | None  # role -> replicas overriding the policy's; None: the policy decides
    reason: str | None  # ScaledToZero | ScaledFromZero | AtZero
    state: ZeroState
    held: int  # requests the routers hold now


def held_requests(samples: list[PodSample]) -> int:
    return int(sum(s.values.get(HELD_REQUESTS, 0.0) for s in samples if s.role == "router" and not s.missing))


def busy(samples: list[PodSample], current: dict[str, int]) -> bool | None:
    """Whether anything is in flight in the resource; None when not every replica could be read."""
    workers = [s for s in samples if s.role in ROLES]
    if any(s.missing for s in samples) or len(workers) < sum(current.get(r, 0) for r in ROLES):
        return None
    load = sum(pod_load(s) + sum(s.values.get(n, 0.0) for n in HANDOFF_SIGNALS) for s in workers)
    return load > 0 or held_requests(samples) > 0


def first_tokens(samples: list[PodSample]) -> dict[str, float]:
    """Each worker's count of requests that got a first token (cumulative), where its page has the histogram."""
    return {s.pod: s.histograms[TTFT].count for s in samples
            if s.role in ROLES and not s.missing and TTFT in s.histograms}


def served_since(before: dict[str, float] | None, now: dict[str, float]) -> bool:
    """Whether a pod read at both passes counted a first token in between (a restarted pod starts over: not
    compared)."""
    return any(pod in (before or {}) and count != before[pod] for pod, count in now.items())


def zero_step(idle_seconds: float | None, min_replicas: dict[str, int], samples: list[PodSample],
              current: dict[str, int], state: ZeroState, now: float) -> ZeroStep:
    """`idle_seconds` None: scale to zero is off (no override). `current`: the replicas the pools are meant to run;
    `samples`: this pass's reads, routers' included."""
    held = held_requests(samples)
    if idle_seconds is None:
        return ZeroStep(None, None, ZeroState(), held)
    at_zero = current.get("decode", 0) == 0 and current.get("prefill", 0) == 0
    if at_zero and held > 0:
        back = {r: max(1, min_replicas.get(r, 1)) for r in ROLES}
        return ZeroStep(back, HELD, ZeroState(left_zero_at=now), held)
    if at_zero:
        if state.zero_since is None:  # at zero from the start (a fresh operator): say so from now
            state = replace(state, zero_since=now, reason=state.reason or "no replicas and no request held")
        return ZeroStep({r: 0 for r in ROLES}, AT_ZERO, replace(state, idle_since=None), held)
    served = first_tokens(samples)
    is_busy = busy(samples, current)
    if is_busy is not False or served_since(state.served, served):
        return ZeroStep(None, None, replace(state, idle_since=None, zero_since=None, served=served), held)
    state = replace(state, served=served)
    idle_since = state.idle_since if state.idle_since is not None else now
    if now - idle_since < idle_seconds:
        return ZeroStep(None, None, replace(state, idle_since=idle_since, zero_since=None), held)
    why = f"idle for {now - idle_since:.0f} s (no request in flight, waiting, held or served; idleSeconds {idle_seconds:g})"
    return ZeroStep({r: 0 for r in ROLES}, IDLE, replace(state, idle_since=None, zero_since=now, reason=why), held)
