"""The router's in-flight bound, answered at the HTTP parser: under a flood nearly every generation request
finds the router serving its bound (RouterState.in_flight_bound) and gets a 429. Answered by the ASGI door
(app.RefuseAtTheDoor), each refusal cost uvicorn's ASGI request, a task, the middleware stack and a Response -
at 10x capacity (bench/overload.py, 2 cores) about a fifth of the router's CPU, on the cores the workers need.
Here uvicorn's httptools protocol answers it from its headers-complete callback instead: the same 429 (status,
Retry-After, X-Request-Id, the JSON error body), written straight to the connection, the request's body left
unread and dropped by the parser, and the connection kept for the client's next request.

Only that one check moves here (a plain comparison, no await): the rest of the door - room at saturated
endpoints, the waiting room - and every other request take the ASGI path as before. With API keys, a request
without a valid key is left to the ASGI stack, which answers it 401 as it would at any load."""
from __future__ import annotations

import uuid
from typing import Any

from disagg.worker.router.capacity import DEFAULT_RETRY_AFTER_S, Shed
from disagg.worker.router.hop_bodies import GENERATION_PATHS
from disagg.worker.router.replies import shed_reply
from disagg.worker.router.state import RouterState

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # httptools missing: uvicorn serves with h11, and the ASGI door answers every refusal
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def over_bound(state: RouterState, scope: dict[str, Any]) -> Shed | None:
    """A generation request that finds the router serving its bound of requests: why it is refused."""
    if scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS or state.drain.draining:
        return None
    bound = state.in_flight_bound()
    if bound is None or state.in_flight < bound or not state.decode.available():
        return None
    return Shed(DEFAULT_RETRY_AFTER_S, f"the router serves {state.in_flight} requests, its bound ({bound}); "
                                       f"retry in {DEFAULT_RETRY_AFTER_S} s")


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


def request_id(scope: dict[str, Any]) -> str:
    """The client's X-Request-Id, or a new one: what a refusal echoes."""
    return _header(scope, b"x-request-id") or uuid.uuid4().hex


def refusal(state: RouterState, scope: dict[str, Any], keys: Any = None) -> tuple[bytes, bytes] | None:
    """The 429 refusing this request at the bound (counted shed) - its status line and headers, and its body -
    or None to serve it as usual. `keys`: the router's API keys (api_keys.ApiKeys); a request without a valid
    one is not answered here."""
    shed = over_bound(state, scope)
    if shed is None or (keys is not None and keys.problem(_header(scope, b"authorization")) is not None):
        return None
    state.metrics.request("shed")
    reply = shed_reply(shed, {"X-Request-Id": request_id(scope)})
    head = [STATUS_LINE[reply.status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(reply.content)]
    head += [f"{k.lower()}: {v}\r\n".encode("latin-1") for k, v in reply.headers.items()]
    return b"".join(head), reply.content


def refusing_protocol(state: RouterState, keys: Any = None) -> type | None:
    """uvicorn's httptools protocol that answers refusals at the bound itself (Config(http=...)); None where this
    uvicorn has no such protocol (no httptools) or a different one inside (then the ASGI door does it all)."""
    if HttpToolsProtocol is None or not hasattr(HttpToolsProtocol, "_start_asgi_task"):
        return None

    class RefusingProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            refused = refusal(state, cycle.scope, keys) if app is self.app else None
            if refused is None:
                return super()._start_asgi_task(cycle, app)
            head, content = refused
            extra = [b"%s: %s\r\n" % (k, v) for k, v in self.server_state.default_headers]
            if not cycle.keep_alive:
                extra.append(b"connection: close\r\n")
            self.transport.write(b"".join([head, *extra, b"\r\n", content]))
            # the cycle is over: the parser drops its body (on_body sees response_complete), the next request
            # on the connection starts as after any answer
            cycle.response_started = cycle.response_complete = True
            if not cycle.keep_alive:
                self.transport.close()
            cycle.on_response()

    return RefusingProtocol
