"""The API server behaviour a cluster's controllers rely on, on top of the operator tests' KubeEmulator:

- graceful pod deletion: DELETE of a pod bound to a node (spec.nodeName) only marks it (metadata.deletionTimestamp
  = now + grace, deletionGracePeriodSeconds = grace, from the request's gracePeriodSeconds or the pod's
  terminationGracePeriodSeconds, default 30); the pod goes away when the kubelet deletes it again with
  gracePeriodSeconds=0 after its containers stopped. An unbound pod is removed at once, as a real API server does.
  DeleteOptions.preconditions.uid is honoured (409 when the object by that name is another one).
- CustomResourceDefinitions: creating one serves its kind (discovery, list/watch/patch, /status when declared,
  and /scale when declared: GET and PATCH of an autoscaling/v1 Scale read and write the CRD's replica paths, as an
  HPA or KEDA does).
- garbage collection (background propagation): an object all of whose ownerReferences name owners (by uid) that
  no longer exist is deleted - by the same rules, so a Deployment's pods terminate gracefully.

Real clusters do GC asynchronously in the controller manager; here it runs right after the removal that orphaned
the dependents (same observable result: dependents get deletion events shortly after their owner's).
"""
from __future__ import annotations

import copy
import datetime
from typing import Any

import aiohttp.web
import attrs
import kmock

from emulator import ApiStatus, Kind, KubeEmulator, ObjKey, ResKey

DEFAULT_GRACE_SECONDS = 30
POD: ResKey = ("", "v1", "pods")
CRD: ResKey = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


def _stamp(seconds_from_now: float = 0.0) -> str:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds_from_now)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _at(obj: dict[str, Any], path: str) -> Any:
    """The value at a CRD's JSON path (".spec.decode.replicas"); None where it is not set."""
    for part in path.strip(".").split(".") if path else ():
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def requested_grace(query: dict[str, str], body: Any) -> int | None:
    """gracePeriodSeconds from DeleteOptions (body) or the query string; None when not given."""
    if isinstance(body, dict) and body.get("gracePeriodSeconds") is not None:
        return int(body["gracePeriodSeconds"])
    if query.get("gracePeriodSeconds") not in (None, ""):
        return int(query["gracePeriodSeconds"])
    return None


@attrs.define(kw_only=True)
class ClusterApiServer(KubeEmulator):
    """KubeEmulator + CRDs + graceful pod deletion + garbage collection of orphaned dependents."""

    scales: dict[ResKey, dict[str, str]] = attrs.field(factory=dict, init=False)  # a CRD's /scale paths

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.declare(*CRD, Kind("CustomResourceDefinition", namespaced=False, short_names=("crd",)))

    async def _create(self, key: ResKey, ns: str | None, body: Any) -> dict[str, Any]:
        out = await super()._create(key, ns, body)
        if key == CRD:
            self.serve_crd(out)
        return out

    def serve_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if version.get("served", True):
                self.declare(spec["group"], version["name"], names["plural"], Kind(
                    names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    status_subresource="status" in (version.get("subresources") or {}),
                    short_names=tuple(names.get("shortNames") or ())))
                if "scale" in (version.get("subresources") or {}):
                    self.scales[(spec["group"], version["name"], names["plural"])] = version["subresources"]["scale"]

    async def _scale(self, request: kmock.Request, key: ResKey) -> dict[str, Any]:
        """GET or PATCH (merge: {"spec": {"replicas": n}}) the object's Scale."""
        paths, ns, name = self.scales[key], request.namespace, request.name
        if request.method.value.upper() == "PATCH":
            body = self._body(request)
            replicas = ((body or {}).get("spec") or {}).get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, int) or replicas < 0:
                raise ApiStatus(422, "Invalid", f"spec.replicas must be an integer >= 0, got {replicas!r}")
            patch: dict[str, Any] = replicas
            for part in reversed(paths["specReplicasPath"].strip(".").split(".")):
                patch = {part: patch}
            await self._patch(key, ns, name, None, "application/merge-patch+json", patch)
        elif request.method.value.upper() != "GET":
            raise ApiStatus(405, "MethodNotAllowed", "/scale: GET and PATCH are emulated")
        obj = self._fetch(key, ns, name)
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")},
                "spec": {"replicas": _at(obj, paths["specReplicasPath"]) or 0},
                "status": {"replicas": _at(obj, paths["statusReplicasPath"]) or 0,
                           "selector": _at(obj, paths.get("labelSelectorPath", "")) or ""}}

    async def _dispatch(self, request: kmock.Request, key: ResKey) -> Any:
        if request.subresource == "scale" and key in self.scales and request.name is not None:
            return aiohttp.web.json_response(await self._scale(request, key))
        if request.method.value.upper() == "DELETE" and request.name is not None:
            body = self._body(request)
            grace = requested_grace(dict(request.params), body)
            uid = ((body.get("preconditions") or {}) if isinstance(body, dict) else {}).get("uid")
            out = await self._delete_with_grace(key, request.namespace, request.name, grace, uid)
            return aiohttp.web.json_response(out)
        return await super()._dispatch(request, key)

    async def _delete_with_grace(self, key: ResKey, ns: str | None, name: str, grace: int | None,
                                 uid: str | None = None) -> dict:
        with self._guard:
            obj = self._store.get((*key, ns, name))
            if obj is None:
                raise ApiStatus(404, "NotFound", f'{key[2]} "{name}" not found')
            if uid is not None and obj["metadata"].get("uid") != uid:  # DeleteOptions.preconditions.uid
                raise ApiStatus(409, "Conflict", f'Precondition failed: UID in precondition: {uid}, '
                                f'UID in object meta: {obj["metadata"].get("uid")}')
            out = self._mark_or_remove(key, (*key, ns, name), obj, grace)
            self._collect_garbage()
        await self._emit()
        return out

    def _mark_or_remove(self, key: ResKey, okey: ObjKey, obj: dict[str, Any], grace: int | None) -> dict:
        """Caller holds _guard. Records the event; returns the object as the response shows it."""
        meta = obj["metadata"]
        graceful = key == POD and (obj.get("spec") or {}).get("nodeName") and grace != 0
        if graceful or meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                if not graceful or grace is None or grace >= int(meta.get("deletionGracePeriodSeconds", 0)):
                    return copy.deepcopy(obj)  # already terminating; only a shorter grace period changes it
            obj = copy.deepcopy(obj)
            if graceful:
                seconds = grace if grace is not None else \
                    int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
                obj["metadata"].update(deletionTimestamp=_stamp(seconds), deletionGracePeriodSeconds=seconds)
            else:
                obj["metadata"]["deletionTimestamp"] = _stamp()
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._store[okey] = obj
            self._record_event(key, "MODIFIED", obj)
            return copy.deepcopy(obj)
        del self._store[okey]
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._record_event(key, "DELETED", obj)
        return obj

    async def _patch(self, key: ResKey, ns: str | None, name: str, sub: str | None, ctype: str,
                     body: Any) -> dict[str, Any]:
        out = await super()._patch(key, ns, name, sub, ctype, body)
        if out["metadata"].get("deletionTimestamp") and not out["metadata"].get("finalizers"):
            with self._guard:  # the last finalizer went: the object is gone, and maybe its dependents' owner
                self._collect_garbage()
            await self._emit()
        return out

    def _collect_garbage(self) -> None:
        """Caller holds _guard. Delete (once) every object whose owners are all gone, until nothing changes."""
        while True:
            uids = {o["metadata"].get("uid") for o in self._store.values()}
            orphans = [(okey, o) for okey, o in self._store.items()
                       if (refs := o["metadata"].get("ownerReferences"))
                       and not any(r.get("uid") in uids for r in refs)
                       and not o["metadata"].get("deletionTimestamp")]
            if not orphans:
                return
            for okey, obj in orphans:
                self._mark_or_remove(okey[:3], okey, obj, None)

