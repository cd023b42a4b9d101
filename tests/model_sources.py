"""Test servers for model sources, on 127.0.0.1 with a free port, each stopped by its context manager.

- HubServer: the part of the Hugging Face Hub's HTTP API that `huggingface_hub.snapshot_download` uses
  (revision info, the recursive tree listing, `resolve` downloads with ETag / X-Repo-Commit headers), serving
  checkpoint directories as repos, optionally behind a bearer token. It also serves any file under /files/.
- moto_server(): moto's S3-compatible server, run from its own virtual environment (moto pins a botocore that
  conflicts with the kubernetes client we ship): MOTO_SERVER names its executable; .ci/run installs it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from disagg.worker.ports import free_port


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    root: Path
    token: str | None = None  # required bearer token, None = public

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def commit(self) -> str:
        h = hashlib.sha1()
        for f in self.files():
            h.update(f.encode() + b"\0" + (self.root / f).read_bytes())
        return h.hexdigest()


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=dict)  # "org/name" -> repo
    files_dir: Path | None = None  # served under /files/
    requests: list[str] = field(default_factory=list)  # "METHOD path" of every request

    def add_repo(self, repo_id: str, root: Path, token: str | None = None) -> None:
        self.repos[repo_id] = Repo(Path(root), token)

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                try:
                    status, headers, data = hub._route(self.command, urlparse(self.path).path,
                                                       self.headers.get("Authorization"))
                except Exception as e:  # a bug in the test server should show, not hang the client
                    status, headers, data = 500, {}, str(e).encode()
                self.send_response(status)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()

    def _route(self, method: str, path: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
        path = unquote(path)
        if path.startswith("/files/") and self.files_dir is not None:
            f = self.files_dir / path[len("/files/"):]
            return (200, {}, f.read_bytes()) if f.is_file() else (404, {}, b"not found")
        for repo_id, repo in self.repos.items():
            for prefix in (f"/api/models/{repo_id}/", f"/{repo_id}/resolve/"):
                if path.startswith(prefix):
                    if repo.token and auth != f"Bearer {repo.token}":
                        return 401, {"X-Error-Code": "RepoNotFound"}, json.dumps(
                            {"error": "Repository not found"}).encode()
                    return self._repo(repo_id, repo, path[len(prefix):], prefix.startswith("/api"))
        return 404, {"X-Error-Code": "RepoNotFound"}, json.dumps({"error": "Repository not found"}).encode()

    def _repo(self, repo_id: str, repo: Repo, rest: str, api: bool) -> tuple[int, dict[str, str], bytes]:
        commit = repo.commit()
        revision, _, tail = rest.partition("/")
        if api and revision == "revision":  # /api/models/{id}/revision/{rev}
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": bool(repo.token),
                    "siblings": [{"rfilename": f} for f in repo.files()]}
            return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
        if api and revision == "tree":  # /api/models/{id}/tree/{rev}[/{path}]
            entries = [{"type": "file", "path": f, "size": (repo.root / f).stat().st_size,
                        "oid": git_blob_sha((repo.root / f).read_bytes())} for f in repo.files()]
            return 200, {"Content-Type": "application/json"}, json.dumps(entries).encode()
        if not api:  # /{id}/resolve/{rev}/{file}
            f = repo.root / tail
            if not f.is_file():
                return 404, {"X-Error-Code": "EntryNotFound"}, b"entry not found"
            data = f.read_bytes()
            return 200, {"ETag": f'"{git_blob_sha(data)}"', "X-Repo-Commit": commit}, data
        return 404, {}, b"not found"


def moto_executable() -> str | None:
    exe = os.environ.get("MOTO_SERVER") or shutil.which("moto_server")
    return exe if exe and os.access(exe, os.X_OK) else None


@contextlib.contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """An S3-compatible endpoint URL; the server process is gone afterwards."""
    exe = moto_executable()
    if exe is None:
        raise RuntimeError("moto_server not found: set MOTO_SERVER (`.ci/run` installs it into .venv-moto)")
    port = free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {(log_dir / 'moto.log').read_text()[-2000:]}")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
