"""Thin kopf handlers: every trigger (create, update, resume, periodic resync) runs the same level-based pass.

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
from disagg.operator.kube import ApiError, KubeClient, TransientApiError, load_connection
from disagg.operator.reconcile import PassResult, reconcile

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 60
_RESOURCE = (s.GROUP, s.VERSION, s.PLURAL)


def backoff_seconds(retry: int) -> float:
    return float(min(MAX_BACKOFF_SECONDS, 2 ** retry))  # 1, 2, 4, ... 60


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
    memo.exiting = threading.Event()  # shared by the per-object copies of memo
    if "kube" not in memo:
        memo.kube = KubeClient(load_connection())
    if "clock" not in memo:
        memo.clock = lambda: datetime.now(timezone.utc)


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


def _run_pass(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger) -> PassResult | None:
    lock = memo.setdefault("lock", threading.Lock())  # memo is per object: one pass at a time per resource
    with lock:
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
    if result.problems and result.status_written:  # first time seen for this generation: one Event
        kopf.warn(body, reason="InvalidSpec", message="; ".join(str(p) for p in result.problems))
    return result


def on_change(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger, **_: Any) -> None:
    result = _run_pass(body, memo, retry, logger)
    if result is not None and result.problems:  # no retries: only a spec change (a new generation) can fix it
        raise kopf.PermanentError("invalid spec: " + "; ".join(str(p) for p in result.problems))


def on_resync(body: kopf.Body, memo: kopf.Memo, retry: int, logger: logging.Logger,
              stopped: kopf.DaemonStopped, **_: Any) -> None:
    # An invalid spec is already reported in status; the timer stays quiet instead of failing every interval.
    if not stopped:
        _run_pass(body, memo, retry, logger)


def build_registry(resync_seconds: float = 10.0) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for trigger in (kopf.on.create, kopf.on.update, kopf.on.resume):
        trigger(*_RESOURCE, registry=registry, id="reconcile", backoff=MAX_BACKOFF_SECONDS)(on_change)
    kopf.timer(*_RESOURCE, registry=registry, id="resync", interval=resync_seconds,
               backoff=MAX_BACKOFF_SECONDS)(on_resync)
    return registry
