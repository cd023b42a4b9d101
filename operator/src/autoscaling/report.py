"""How an autoscaling decision is told, the same by the operator (status, Events, logs) and by `disagg up` (console,
/status): a pool change (`ScalingChange`), the decision's numbers behind it, timestamps. Pure: no I/O."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic.alias_generators import to_camel

from disagg.operator.autoscaling.policy import Decision

# not named after the role but signals of it: KV waiting at prefill to be pulled, or left unpulled until its lease
# ran out, means decode is short
CROSS_ROLE_SIGNALS = {"decode": ("prefill_pending_sends_per_pod", "expired_leases")}


def iso(t: float) -> str:
    """Seconds since the epoch -> RFC 3339 in UTC, whole seconds (as the Kubernetes API writes times)."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def role_metrics(decision: Decision, role: str) -> dict[str, float]:
    """The decision's numbers behind this role's change (its own, transfers and cross-role signals), without the
    ones nobody measured."""
    extra = CROSS_ROLE_SIGNALS.get(role, ())
    return {k: round(v, 4) for k, v in decision.metrics.items()
            if v is not None and (k.startswith(f"{role}_") or k.startswith("xfer_") or k in extra)}


def status_metrics(metrics: dict[str, float | None]) -> dict[str, str]:
    """The policy's numbers as decimal strings (the API has no floats), camelCase, units in the names."""
    out = {}
    for name, value in metrics.items():
        if value is None or not math.isfinite(value):
            continue
        if name == "decode_kv_cache_usage":  # a fraction in the metric, a percent in the spec's target
            name, value = "decode_kv_cache_usage_percent", value * 100
        out[to_camel(name)] = f"{value:.4g}"
    return out


@dataclass(frozen=True)
class ScalingChange:
    """A pool change one decision makes (or, in dry run, would make)."""

    role: str  # prefill | decode
    from_replicas: int
    to_replicas: int
    reason: str  # the role's reason, e.g. DecodeBound, Underutilized
    dry_run: bool
    time: float  # seconds since the epoch: the decision's
    metrics: dict[str, float] = field(default_factory=dict)  # role_metrics() of the decision
    decided_by: list[str] = field(default_factory=list)  # the signals behind it (Decision.decided_by)

    @property
    def event_reason(self) -> str:
        if self.reason in ("ScaledToZero", "ScaledFromZero"):  # scale to zero's transitions (zero.py)
            verb = self.reason
        else:
            verb = "ScaledUp" if self.to_replicas > self.from_replicas else "ScaledDown"
        return f"DryRun{verb}" if self.dry_run else verb

    @property
    def message(self) -> str:
        what = "would scale" if self.dry_run else "scaled"
        return f"{what} {self.role} from {self.from_replicas} to {self.to_replicas}: {self.reason}"

    def as_json(self) -> dict[str, Any]:
        return {"time": iso(self.time), "role": self.role, "from": self.from_replicas, "to": self.to_replicas,
                "reason": self.reason, "decidedBy": self.decided_by, "dryRun": self.dry_run, "metrics": self.metrics}


def scaling_line(change: ScalingChange) -> str:
    """One console line: `[time] autoscale (dry run): decode 1 -> 2 (DecodeBound) by kvCacheUsage name=value ...`."""
    values = " ".join(f"{k}={v:g}" for k, v in change.metrics.items())
    dry = " (dry run)" if change.dry_run else ""
    by = f" by {','.join(change.decided_by)}" if change.decided_by else ""
    what = f"{change.role} {change.from_replicas} -> {change.to_replicas} ({change.reason}){by}"
    return f"[{iso(change.time)}] autoscale{dry}: {what} {values}"


def decision_json(d: Decision, dry_run: bool) -> dict[str, Any]:
    """The whole decision, JSON-ready (disagg up's /status)."""
    return {"time": iso(d.time), "reason": d.reason, "bottleneck": d.bottleneck, "dryRun": dry_run,
            "roles": {r: {"current": x.current, "desired": x.desired, "reason": x.reason,
                          "recommendation": x.recommendation, "limitedBy": x.limited_by,
                          "decidedBy": d.decided_by.get(r, []),
                          "signalsUsed": d.signals.get(r, {}).get("used", []),
                          "signalsUnavailable": d.signals.get(r, {}).get("unavailable", [])}
                      for r, x in d.roles.items()},
            "metrics": d.metrics,
            "conditions": [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message}
                           for c in d.conditions]}
