"""Client authentication by API key, as OpenAI's API and vLLM do it: `Authorization: Bearer <key>`.

    client --(a client key)--> router | gateway (disagg epp) --(the workers' key)--> worker --(its key)--> worker
                                                                                      (the decode side's prefill hop)

- `disagg router` and `disagg epp` take client keys from --api-key-file (one key a line) and $DISAGG_API_KEY, and
  answer 401 to a request on any route but the probes' (/health, /ready, /metrics) without one of them. They
  never pass a client's key on: to workers that want a key they send the workers' own (--worker-api-key-file or
  $DISAGG_WORKER_API_KEY; the epp sets it on the request the gateway forwards). So client keys can be many and
  rotated without touching the workers.
- `disagg worker --api-key` (or $VLLM_API_KEY, as vLLM) does the same for a worker; the pods of a resource share
  one key, which its decode side's prefill hop also sends.
- `disagg pd-proxy` checks nothing itself: the client's Authorization goes to vLLM (its --api-key) and on the
  prefill hop.
Keys are compared in constant time (their SHA-256 digests, so not even a key's length shows).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: no key
CLIENT_KEY_ENV = "DISAGG_API_KEY"  # a client key for the router and the endpoint picker
WORKER_KEY_ENV = "DISAGG_WORKER_API_KEY"  # what the router and the picker send to the workers
VLLM_KEY_ENV = "VLLM_API_KEY"  # a worker's key (vLLM's variable)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts (their digests only)."""
    digests: tuple[bytes, ...] = field(repr=False)

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        keys = [k for k in keys if k]
        if not keys:
            raise ValueError("no API key given (an empty key would accept anyone)")
        return cls(tuple(_digest(k) for k in keys))

    def problem(self, authorization: str | None) -> str | None:
        """Why a request with this Authorization header is refused, or None when it carries one of the keys."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "this server needs an API key: send the header `Authorization: Bearer <key>`"
        given = _digest(token.strip())
        matched = False
        for digest in self.digests:  # every key compared, whichever matches
            matched |= hmac.compare_digest(digest, given)
        return None if matched else "invalid API key"


def read_key_file(path: str) -> list[str]:
    """One key a line; blank lines and lines starting with # are skipped. ValueError when it holds none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"API key file {path}: {e.strerror or e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"API key file {path} holds no key (one a line)")
    return keys


def client_keys(key_file: str | None, environ: Mapping[str, str] | None = None) -> ApiKeys | None:
    """The router's or the picker's client keys: the file's and $DISAGG_API_KEY; None when neither is set."""
    env = os.environ if environ is None else environ
    keys = (read_key_file(key_file) if key_file else []) + ([env[CLIENT_KEY_ENV]] if env.get(CLIENT_KEY_ENV) else [])
    return ApiKeys.of(keys) if keys else None


def worker_key(key_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key the router or the picker sends to the workers: the file's first, else $DISAGG_WORKER_API_KEY."""
    env = os.environ if environ is None else environ
    if key_file:
        return read_key_file(key_file)[0]
    return env.get(WORKER_KEY_ENV) or None


def worker_own_keys(flag_keys: list[str] | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """A worker's keys: --api-key's, else $VLLM_API_KEY (as vLLM)."""
    env = os.environ if environ is None else environ
    return list(flag_keys or ([env[VLLM_KEY_ENV]] if env.get(VLLM_KEY_ENV) else []))


def add_client_key_arguments(p: Any) -> None:
    p.add_argument("--api-key-file", metavar="PATH", help="client API keys, one a line (and $DISAGG_API_KEY): "
                   "requests without `Authorization: Bearer <one of them>` get 401; /health, /ready and "
                   "/metrics stay open")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def unauthorized_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": 401}}).encode()


class RequireApiKey:
    """ASGI middleware: 401 (OpenAI's error body, WWW-Authenticate: Bearer) for a request on any path but
    `open_paths` without one of `keys`. Plain ASGI, so streamed answers pass through untouched."""

    def __init__(self, app: Any, keys: ApiKeys, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        problem = self.keys.problem(header)
        if problem is None:
            return await self.app(scope, receive, send)
        body = unauthorized_body(problem)
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
