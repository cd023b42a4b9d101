"""Thin kopf handlers: every trigger (create, update, resume, periodic resync) runs the same level-based pass;
a daemon per resource with autoscaling on decides every spec.autoscaling.intervalSeconds (a daemon rather than
a kopf timer: a timer's interval is fixed when it is registered, the spec's may change), writes the Deployments'
replicas itself (unless dry run) and then runs the pass so status reports the scaled Deployments at once.

Handlers are registered into a registry built here (no import-time global registry), so the resync interval is
a parameter and tests can run the operator several times in one process.
"""
from __future__ import annotations

import copy
import logging
import threading
from datetime import datetime, timezone
from typing import Any

import kopf

from disagg.operator import spec as s
from disagg.operator.autoscaling.cluster import AutoscaleResult, OperatorMetrics, autoscale
from disagg.operator.autoscaling.scaling_pass import PassState
from disagg.operator.backoff import MAX_BACKOFF_SECONDS, EndlessBackoffs, backoff_seconds
from disagg.operator.kube import ApiError, KubeClient, TransientApiError, load_connection
from disagg.operator.reconcile import PassResult, ReplicasReverted, reconcile

log = logging.getLogger(__name__)

_RESOURCE = (s.GROUP, s.VERSION, s.PLURAL)
API_REQUEST_TIMEOUT_SECONDS = 60  # one kopf API request (kopf's default: 5 minutes)


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """All operator-wide settings live here."""
    # kopf's bookkeeping in our own annotations, never in status (status is rebuilt from the children)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=s.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=s.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{s.GROUP}/finalizer"
    settings.posting.level = logging.WARNING  # Events for warnings and errors only
    settings.watching.server_timeout = 300
    settings.watching.connect_timeout = 10
    # an unavailable API server (refused, 5xx, dropped watches): retried for as long as it lasts (backoff.py)
    settings.networking.error_backoffs = memo.get("api_backoffs") or EndlessBackoffs()
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = API_REQUEST_TIMEOUT_SECONDS
    # a deleted resource keeps its finalizer until its resync timer (and autoscale daemon) stopped; a timer caught
    # mid-pass is re-checked only every cancellation_polling seconds (kopf's default 60): deletes took a minute
    settings.background.cancellation_polling = 1
    memo.exiting = threading.Event()  # shared by the per-object copies of memo
    if "kube" not in memo:
        memo.kube = KubeClient(load_connection())
    if "clock" not in memo:
        memo.clock = lambda: datetime.now(timezone.utc)
    if "metrics" not in memo:
        memo.metrics = OperatorMetrics()


def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf logs in with the same credentials as our client (see kube.load_connection)."""
    c = load_connection()
    return kopf.ConnectionInfo(server=c.server, token=c.token, scheme="Bearer" if c.token else None,
                               ca_path=c.ca_path, certificate_path=c.cert_path, private_key_path=c.key_path,
                               insecure=c.insecure, default_namespace=c.namespace)


def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.exiting.set()
    kube = memo.get("kube")
    if kube is not None:
        kube.close()


def _lock(memo: kopf.Memo) -> threading.Lock:
    # memo is per object: one pass (reconcile or autoscale) at a time per resource
    return memo.setdefault("lock", threading.Lock())


def _reconcile_locked(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger) -> PassResult | None:
    """The caller holds the lock."""
    if memo.exiting.is_set():  # kopf may still start a timer while it exits; the client is closed
        return None
    try:
        result = reconcile(copy.deepcopy(dict(body)), memo.kube, memo.clock())
    except TransientApiError as e:
        if memo.exiting.is_set():
            return None
        raise kopf.TemporaryError(str(e), delay=backoff_seconds(retry)) from e
    except ApiError as e:  # forbidden, rejected manifest: a person must act; retry slowly
        kopf.warn(body, reason="ApplyFailed", message=str(e))
        raise kopf.TemporaryError(str(e), delay=MAX_BACKOFF_SECONDS) from e
    except RuntimeError:
        if memo.exiting.is_set():  # the exit closed the client under this pass
            return None
        raise
    if result is None:
        return None
    if result.children_written:
        logger.info("wrote %s", ", ".join(result.children_written))
    if result.children_removed:
        logger.info("removed %s (no longer in the spec)", ", ".join(result.children_removed))
    if result.problems and result.status_written:  # first time seen for this generation: one Event
        kopf.warn(body, reason="InvalidSpec", message="; ".join(str(p) for p in result.problems))
    if result.conflicts and result.status_written:  # on the change of status that reports it: not every pass
        for c in result.conflicts:
            kopf.warn(body, reason="ChildOwnedElsewhere",
                      message=f"{c}: not adopted; delete it or rename this resource")
    _report_reverted(body, result.replicas_reverted)
    return result


def _report_reverted(body: kopf.Body, reverted: list[ReplicasReverted]) -> None:
    for rv in reverted:
        kopf.event(body, type="Warning", reason="ManualScaleReverted",
                   message=f"Deployment {rv.deployment} replicas set to {rv.found} outside the operator; "
                           f"restored {rv.restored} from {rv.source}")


def _run_pass(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger) -> PassResult | None:
    with _lock(memo):
        return _reconcile_locked(body, memo, retry, logger)


def on_change(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger, **_: Any) -> None:
    result = _run_pass(body, memo, retry, logger)
    if result is not None and result.problems:  # no retries: only a spec change (a new generation) can fix it
        raise kopf.PermanentError("invalid spec: " + "; ".join(str(p) for p in result.problems))


def on_resync(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger,
              stopped: kopf.DaemonStopped, **_: Any) -> None:
    # An invalid spec is already reported in status; the timer stays quiet instead of failing every interval.
    if not stopped:
        _run_pass(body, memo, retry, logger)


def _autoscale_once(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger) -> AutoscaleResult | None:
    with _lock(memo):
        if memo.exiting.is_set():
            return None
        # in memory: after an operator restart no scale-down until one whole down window has been seen again
        state = memo.get("scaling_state") or PassState()
        now = memo.clock()
        try:
            result = autoscale(copy.deepcopy(dict(body)), memo.kube, state, now,
                               lambda: memo.clock().timestamp())
            if result is None:
                return None
            memo.scaling_state = result.state
            memo.metrics.observe(body["metadata"]["namespace"], body["metadata"]["name"], result.decision)
            if result.scaled:
                _reconcile_locked(body, memo, 0, logger)  # status from the Deployments just scaled
        except (ApiError, kopf.TemporaryError) as e:  # the next interval tries again
            logger.warning("autoscaling pass failed: %s", e)
            return None
    for change in result.changes:
        logger.info("%s", change.message)
        kopf.event(body, type="Normal", reason=change.event_reason, message=change.message)
    _report_reverted(body, result.replicas_reverted)
    if result.cost_failed:
        kopf.warn(body, reason="DeletionCostNotSet", message="; ".join(result.cost_failed))
    return result


def _autoscaling_on(spec: kopf.Spec, **_: Any) -> bool:
    a = spec.get("autoscaling") or {}
    return bool(a.get("enabled")) and a.get("mode", "builtin") == "builtin"  # external: someone else's /scale


def autoscale_daemon(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, stopped: kopf.DaemonStopped,
                     **_: Any) -> None:
    """Runs while spec.autoscaling.enabled (kopf stops it when that turns false or the resource goes)."""
    while not stopped and not memo.exiting.is_set():
        result = _autoscale_once(body, memo, logger)
        interval = result.interval_seconds if result is not None else \
            int((body.get("spec") or {}).get("autoscaling", {}).get("intervalSeconds") or 15)
        stopped.wait(interval)


def build_registry(resync_seconds: float = 10.0) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for trigger in (kopf.on.create, kopf.on.update, kopf.on.resume):
        trigger(*_RESOURCE, registry=registry, id="reconcile", backoff=MAX_BACKOFF_SECONDS)(on_change)
    kopf.timer(*_RESOURCE, registry=registry, id="resync", interval=resync_seconds,
               backoff=MAX_BACKOFF_SECONDS)(on_resync)
    kopf.daemon(*_RESOURCE, registry=registry, id="autoscale", when=_autoscaling_on, backoff=MAX_BACKOFF_SECONDS,
                cancellation_timeout=1.0)(autoscale_daemon)
    return registry
