"""A Kubernetes API server emulator for tests: kmock's KubernetesEmulator (pinned kmock 0.8) plus what kopf and
kubectl need from a real API server (see /work/shared/notes/testing-kubernetes-without-a-cluster.md).

kmock serves HTTP, parses requests and answers discovery; this subclass owns the object store:
uid/resourceVersion/generation/creationTimestamp on create, generateName, merge and JSON patches (failed `test`
-> 422, stale resourceVersion -> 409), /status patches touch only status, no-op patches write nothing,
finalizers + deletionTimestamp, list/watch with resourceVersion replay and labelSelector (equality only),
and a log of every request (`emulator.requests`) so tests can count writes and derive RBAC rules.

Not emulated: PUT, /scale, controllers (tests set Deployment status themselves), garbage collection,
admission/schema validation, OpenAPI. Strategic-merge and apply patches are treated as merge patches.

`EmulatorThread` runs it on 127.0.0.1 on a free port in its own thread and event loop.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import httpx
import kmock
import yaml
from k8s_patch import apply_merge_patch

ResKey = tuple[str, str, str]  # (group, version, plural)
ObjKey = tuple[str, str, str, str | None, str]  # (group, version, plural, namespace, name)
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class RecordedRequest:
    method: str  # GET, POST, PATCH, ...
    path: str  # /apis/apps/v1/namespaces/ns/deployments/x
    query: dict[str, str]
    body: Any  # parsed JSON (or YAML) for writes, else None
    verb: str | None  # Kubernetes RBAC verb: get list watch create patch update delete
    group: str | None
    resource: str | None  # plural, with "/status" for the subresource

    @property
    def is_write(self) -> bool:
        return self.method in WRITE_METHODS


@dataclass(frozen=True)
class Kind:
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    short_names: tuple[str, ...] = ()


# what a cluster running the operator serves; tests may add more with `emulator.declare()`
BUILTIN_KINDS: dict[ResKey, Kind] = {
    ("", "v1", "namespaces"): Kind("Namespace", namespaced=False),
    ("", "v1", "events"): Kind("Event"),
    ("", "v1", "pods"): Kind("Pod", status_subresource=True),
    ("", "v1", "services"): Kind("Service", status_subresource=True),
    ("", "v1", "serviceaccounts"): Kind("ServiceAccount"),
    ("", "v1", "secrets"): Kind("Secret"),
    ("networking.k8s.io", "v1", "networkpolicies"): Kind("NetworkPolicy", short_names=("netpol",)),
    ("apps", "v1", "deployments"): Kind("Deployment", status_subresource=True),
    ("rbac.authorization.k8s.io", "v1", "roles"): Kind("Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): Kind("RoleBinding"),
}


class PatchTestFailed(Exception):
    pass


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/remove/replace/test (what kopf and kubectl send)."""
    doc = copy.deepcopy(target)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        key: Any = int(last) if isinstance(node, list) and last not in ("-",) else last
        if op["op"] == "test":
            current = node[key] if (isinstance(node, list) or key in node) else None
            if current != op.get("value"):
                raise PatchTestFailed(f"test failed at {op['path']}: {current!r} != {op.get('value')!r}")
        elif op["op"] == "remove":
            del node[key]
        elif op["op"] in ("add", "replace"):
            if isinstance(node, list):
                node.append(op["value"]) if key == "-" else node.insert(key, op["value"])
                if op["op"] == "replace":
                    del node[key + 1]
            else:
                node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported JSON patch op {op['op']!r}")
    return doc


def _matches_selector(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.strip() and term.strip() not in labels:
            return False
    return True


class ApiStatus(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    kinds: dict[ResKey, Kind] = attrs.field(factory=lambda: dict(BUILTIN_KINDS))
    requests: list[RecordedRequest] = attrs.field(factory=list)  # every request, in arrival order
    # (method, path substring, HTTP code, times left): answer matching requests with that error first
    failures: list[list[Any]] = attrs.field(factory=list)
    _store: dict[ObjKey, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _events: list[tuple[int, ResKey, dict[str, Any]]] = attrs.field(factory=list, init=False)  # (rv, res, event)
    _rv: int = attrs.field(default=1000, init=False)
    _guard: threading.Lock = attrs.field(factory=threading.Lock, init=False)  # store + events, across threads
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind in self.kinds.items():
            self._declare_discovery(key, kind)

    def declare(self, group: str, version: str, plural: str, kind: Kind) -> None:
        self.kinds[(group, version, plural)] = kind
        self._declare_discovery((group, version, plural), kind)

    def _declare_discovery(self, key: ResKey, kind: Kind) -> None:
        group, version, plural = key
        self.resources[kmock.resource(group, version, plural)] = kmock.ResourceInfo(
            kind=kind.kind, namespaced=kind.namespaced, singular=kind.kind.lower(),
            verbs={"get", "list", "watch", "create", "patch", "delete"}, shortnames=set(kind.short_names),
            subresources={"status"} if kind.status_subresource else set())

    # ------------------------------------------------------------ thread-safe reads for tests
    def get_object(self, group: str, version: str, plural: str, namespace: str | None, name: str) -> dict | None:
        with self._guard:
            obj = self._store.get((group, version, plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, group: str, version: str, plural: str, namespace: str | None = None) -> list[dict]:
        with self._guard:
            return [copy.deepcopy(o) for (g, v, p, ns, _), o in self._store.items()
                    if (g, v, p) == (group, version, plural) and (namespace is None or ns == namespace)]

    def writes(self, since: int = 0) -> list[RecordedRequest]:
        return [r for r in self.requests[since:] if r.is_write]

    def api_verbs(self) -> set[tuple[str, str, str]]:
        """{(verb, api group, resource)} of everything requested: the RBAC rules a client needs."""
        return {(r.verb, r.group or "", r.resource) for r in self.requests if r.verb and r.resource}

    # ------------------------------------------------------------ request entry
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8's path parser fails on /api/v1/namespaces[/NAME] (it reads "namespaces" as a prefix)
        parts = raw_request.path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            await raw_request.read()
            try:
                data = await raw_request.json()
            except ValueError:
                data = None
            request = kmock.Request(
                method=raw_request.method, url=raw_request.url, params=dict(raw_request.query),
                headers=dict(raw_request.headers), data=data, body=await raw_request.read(),
                text=await raw_request.text(), resource=kmock.resource("", "v1", "namespaces"),
                namespace=None, name=parts[3] if len(parts) == 4 else None, raw_request=raw_request)
            self._requests.append(request)
            return await self._handle(request)
        return await super().__call__(raw_request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        self.requests.append(self._record(request))
        if res is None or res.plural is None:  # discovery and other non-object paths: kmock answers
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        key: ResKey = (res.group, res.version, res.plural)
        try:
            self._maybe_fail(request)
            if key not in self.kinds:
                raise ApiStatus(404, "NotFound", f"the server could not find the requested resource {key}")
            return await self._dispatch(request, key)
        except ApiStatus as e:
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                              "status": "Failure", "code": e.code, "reason": e.reason,
                                              "message": e.message}, status=e.code)

    def inject_failure(self, method: str, path_contains: str, code: int = 500, times: int = 1) -> None:
        self.failures.append([method.upper(), path_contains, code, times])

    def _maybe_fail(self, request: kmock.Request) -> None:
        for f in self.failures:
            method, fragment, code, left = f
            if left > 0 and request.method.value.upper() == method and fragment in request.url.path:
                f[3] -= 1
                raise ApiStatus(code, "InternalError" if code >= 500 else "Injected", "injected failure")

    def _record(self, request: kmock.Request) -> RecordedRequest:
        method = request.method.value.upper()
        res = request.resource
        verb = group = resource = None
        if res is not None and res.plural is not None:
            group, resource = res.group, res.plural + (f"/{request.subresource}" if request.subresource else "")
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
            if method == "GET":
                verb = "watch" if request.params.get("watch") in ("true", "1") else \
                    "get" if request.name else "list"
        body = self._body(request) if method in WRITE_METHODS else None
        return RecordedRequest(method, request.url.path, dict(request.params), body, verb, group, resource)

    @staticmethod
    def _body(request: kmock.Request) -> Any:
        if request.data is not None and not isinstance(request.data, (str, bytes)):
            return request.data if isinstance(request.data, (dict, list)) else dict(request.data)
        try:
            return yaml.safe_load(request.text) if request.text else None
        except yaml.YAMLError:
            return request.text

    async def _dispatch(self, request: kmock.Request, key: ResKey) -> aiohttp.web.StreamResponse:
        method = request.method.value.upper()
        ns, name, sub = request.namespace, request.name, request.subresource
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, key, ns)
        if method == "GET" and name is None:
            return aiohttp.web.json_response(self._list(key, ns, request.params.get("labelSelector")))
        if method == "GET":
            return aiohttp.web.json_response(self._fetch(key, ns, name))
        if method == "POST" and name is None:
            return aiohttp.web.json_response(await self._create(key, ns, self._body(request)), status=201)
        if method == "PATCH" and name is not None:
            ctype = request.headers.get("Content-Type", "").split(";")[0]
            return aiohttp.web.json_response(await self._patch(key, ns, name, sub, ctype, self._body(request)))
        if method == "DELETE" and name is not None:
            return aiohttp.web.json_response(await self._delete(key, ns, name))
        raise ApiStatus(405, "MethodNotAllowed", f"{method} is not emulated here")

    # ------------------------------------------------------------ storage
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _emit(self) -> None:
        # called after the caller's _guard block (which recorded the event) has ended; wake the watchers on the loop
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self._changed.notify_all()

    def _record_event(self, key: ResKey, etype: str, obj: dict[str, Any]) -> None:
        self._events.append((int(obj["metadata"]["resourceVersion"]), key, {"type": etype,
                                                                             "object": copy.deepcopy(obj)}))

    def _fetch(self, key: ResKey, ns: str | None, name: str) -> dict[str, Any]:
        with self._guard:
            obj = self._store.get((*key, ns, name))
            if obj is None:
                raise ApiStatus(404, "NotFound", f'{key[2]} "{name}" not found')
            return copy.deepcopy(obj)

    def _list(self, key: ResKey, ns: str | None, selector: str | None) -> dict[str, Any]:
        with self._guard:
            items = [copy.deepcopy(o) for (g, v, p, ons, _), o in self._store.items()
                     if (g, v, p) == key and (ns is None or ons == ns) and _matches_selector(o, selector)]
            rv = str(self._rv)
        kind = self.kinds[key].kind
        return {"apiVersion": f"{key[0]}/{key[1]}" if key[0] else key[1], "kind": f"{kind}List",
                "metadata": {"resourceVersion": rv}, "items": items}

    async def _create(self, key: ResKey, ns: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiStatus(400, "BadRequest", "body must be an object")
        kind = self.kinds[key]
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise ApiStatus(422, "Invalid", "metadata.name: Required value")
        if kind.namespaced:
            meta["namespace"] = ns or meta.get("namespace") or "default"
        if kind.status_subresource:
            obj.pop("status", None)
        with self._guard:
            okey = (*key, meta.get("namespace"), meta["name"])
            if okey in self._store:
                raise ApiStatus(409, "AlreadyExists", f'{key[2]} "{meta["name"]}" already exists')
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            obj["apiVersion"] = f"{key[0]}/{key[1]}" if key[0] else key[1]
            obj["kind"] = kind.kind
            self._store[okey] = obj
            self._record_event(key, "ADDED", obj)
            out = copy.deepcopy(obj)
        await self._emit()
        return out

    async def _patch(self, key: ResKey, ns: str | None, name: str, sub: str | None, ctype: str,
                     body: Any) -> dict[str, Any]:
        kind = self.kinds[key]
        with self._guard:
            okey = (*key, ns, name)
            old = self._store.get(okey)
            if old is None:
                raise ApiStatus(404, "NotFound", f'{key[2]} "{name}" not found')
            try:
                if ctype == "application/json-patch+json":
                    new = json_patch(old, body)
                else:  # merge; strategic-merge and apply patches approximated as merge patches
                    want_rv = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
                    if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                        raise ApiStatus(409, "Conflict", "the object has been modified; please apply your "
                                                         "changes to the latest version and try again")
                    new = apply_merge_patch(old, body)
            except PatchTestFailed as e:
                raise ApiStatus(422, "Invalid", str(e)) from e
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise ApiStatus(422, "Invalid", f"cannot apply patch: {e!r}") from e
            if sub == "status":  # only status changes through /status
                new = {**copy.deepcopy(old), "status": new.get("status")} if new.get("status") is not None \
                    else {k: copy.deepcopy(v) for k, v in old.items() if k != "status"}
            elif kind.status_subresource:  # and never through the main resource
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
            for immutable in ("uid", "creationTimestamp", "namespace", "name", "generation", "resourceVersion"):
                if immutable in old["metadata"]:
                    new["metadata"][immutable] = old["metadata"][immutable]
            if new == old:  # a no-op patch writes nothing and notifies no one
                return copy.deepcopy(old)
            if _essence(new) != _essence(old):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._store[okey] = new
            etype = "MODIFIED"
            # the last finalizer went: gone. (A pod under graceful deletion has a deletionTimestamp and no
            # finalizers all along: a status patch from its kubelet does not remove it.)
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers") \
                    and old["metadata"].get("finalizers"):
                del self._store[okey]
                etype = "DELETED"
            self._record_event(key, etype, new)
            out = copy.deepcopy(new)
        await self._emit()
        return out

    async def _delete(self, key: ResKey, ns: str | None, name: str) -> dict[str, Any]:
        with self._guard:
            okey = (*key, ns, name)
            obj = self._store.get(okey)
            if obj is None:
                raise ApiStatus(404, "NotFound", f'{key[2]} "{name}" not found')
            if obj["metadata"].get("finalizers"):
                if obj["metadata"].get("deletionTimestamp"):
                    return copy.deepcopy(obj)
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = \
                    datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self._store[okey] = obj
                etype = "MODIFIED"
            else:
                del self._store[okey]
                obj = copy.deepcopy(obj)
                obj["metadata"]["resourceVersion"] = self._next_rv()
                etype = "DELETED"
            self._record_event(key, etype, obj)
            out = copy.deepcopy(obj)
        await self._emit()
        return out

    # ------------------------------------------------------------ watch
    async def _watch(self, request: kmock.Request, key: ResKey, ns: str | None) -> aiohttp.web.StreamResponse:
        selector = request.params.get("labelSelector")
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        if self._changed is None:
            self._changed = asyncio.Condition()
        with self._guard:  # snapshot and position together: nothing falls between them
            position = len(self._events)
            if since and since != "0":
                pending = [e for rv, k, e in self._events if k == key and rv > int(since)]
            else:
                pending = [{"type": "ADDED", "object": copy.deepcopy(o)}
                           for (g, v, p, _, _), o in self._store.items() if (g, v, p) == key]
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        try:
            while True:
                for event in pending:
                    obj = event["object"]
                    if (ns is None or obj["metadata"].get("namespace") == ns) and _matches_selector(obj, selector):
                        await response.write(json.dumps(event).encode() + b"\n")
                async with self._changed:
                    with self._guard:
                        fresh = len(self._events) > position
                    if not fresh:
                        remaining = None if deadline is None else deadline - loop.time()
                        if remaining is not None and remaining <= 0:
                            break
                        try:
                            await asyncio.wait_for(self._changed.wait(), remaining)
                        except TimeoutError:
                            break
                with self._guard:
                    pending = [e for _, k, e in self._events[position:] if k == key]
                    position = len(self._events)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    # ------------------------------------------------------------ discovery fixes
    async def _serve_version(self, request: kmock.Request) -> Any:
        out = await super()._serve_version(request)
        if isinstance(out, dict) and out.get("groupVersion", "").startswith("/"):
            out["groupVersion"] = out["groupVersion"][1:]  # core is "v1", not "/v1"
        for entry in out.get("resources", []) if isinstance(out, dict) else []:
            if "/" in entry["name"]:  # subresources carry no short names (kubectl warns otherwise)
                entry["shortNames"] = []
        return out


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    """What bumps metadata.generation: everything except metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@dataclass
class EmulatorThread:
    """Runs a KubeEmulator on 127.0.0.1:<free port> in a daemon thread with its own event loop."""
    emulator: KubeEmulator = field(default_factory=KubeEmulator)
    url: str = ""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None

    def start(self, timeout: float = 10.0) -> EmulatorThread:
        started = threading.Event()

        async def serve() -> None:
            self._stop = asyncio.Event()
            async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1") as server:
                self.url = f"http://127.0.0.1:{server.port}"
                started.set()
                await self._stop.wait()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="kube-emulator", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise RuntimeError("emulator did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ test conveniences over real HTTP
    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10)

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {}}],
                "contexts": [{"name": "emulator",
                              "context": {"cluster": "emulator", "user": "tester", "namespace": namespace}}]}
