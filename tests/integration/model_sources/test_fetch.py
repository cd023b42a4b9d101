"""Model sources a pod downloads before its worker starts (`disagg fetch-model`, worker/model/fetch.py), against
real servers on loopback: a Hub-compatible server, a plain HTTP file server, moto's S3 server."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from disagg.operator import spec as s
from disagg.worker.model.fetch import FetchError, ModelLocation, fetch_model
from model_sources import HubServer, moto_executable, moto_server

CLI = [sys.executable, "-m", "disagg.worker.cli"]


def same_files(a: Path, b: Path) -> bool:
    names = lambda d: {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and ".cache" not in p.parts
                       and p.name != ".disagg-fetched.json"}
    return names(a) == names(b) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names(a))


@pytest.fixture
def checkpoint(tiny_model_dir) -> Path:
    return Path(tiny_model_dir)


# ---------------------------------------------------------------- Hugging Face Hub
def test_hub_download_with_token_then_reuse_without_network(checkpoint, tmp_path, monkeypatch):
    hub = HubServer()
    hub.add_repo("org/tiny", checkpoint, token="hf_secret")
    with hub.running() as url:
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        out = fetch_model(ModelLocation("huggingFace", "org/tiny", endpoint=url), tmp_path / "m")
        assert same_files(checkpoint, out)
        assert any("/resolve/" in r for r in hub.requests)
        seen = len(hub.requests)
        # a restarted pod on the same cache: nothing is asked of the Hub
        assert fetch_model(ModelLocation("huggingFace", "org/tiny", endpoint=url), tmp_path / "m") == out
        assert len(hub.requests) == seen
        monkeypatch.setenv("HF_TOKEN", "wrong")
        with pytest.raises(FetchError, match="org/tiny.*HF_TOKEN"):
            fetch_model(ModelLocation("huggingFace", "org/tiny", endpoint=url), tmp_path / "other")
        with pytest.raises(FetchError, match="org/missing"):
            fetch_model(ModelLocation("huggingFace", "org/missing", endpoint=url), tmp_path / "missing")
    assert not (tmp_path / "other" / "config.json").exists()


def test_fetch_model_command_as_the_init_container_runs_it(checkpoint, tmp_path):
    """HF_ENDPOINT and HF_TOKEN from the environment, as the pod's init container gets them."""
    hub = HubServer()
    hub.add_repo("org/tiny", checkpoint, token="t0k")
    with hub.running() as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_TOKEN": "t0k", "HF_HOME": str(tmp_path / "hf")}
        ok = subprocess.run([*CLI, "fetch-model", "--hf-repo", "org/tiny", "--dest", str(tmp_path / "m")], env=env,
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert same_files(checkpoint, tmp_path / "m")
        bad = subprocess.run([*CLI, "fetch-model", "--hf-repo", "org/nope", "--dest", str(tmp_path / "n")],
                             env=env, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and "org/nope" in bad.stderr


# ---------------------------------------------------------------- http(s) archives
def _tar(checkpoint: Path, target: Path, top: str | None) -> None:
    with tarfile.open(target, "w:gz") as t:
        for f in checkpoint.iterdir():
            t.add(f, arcname=f"{top}/{f.name}" if top else f.name)


def test_http_archives_tar_and_zip(checkpoint, tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    _tar(checkpoint, files / "wrapped.tar.gz", "tiny-llama")  # one top-level folder: descended into
    _tar(checkpoint, files / "flat.tgz", None)
    with zipfile.ZipFile(files / "ck.zip", "w") as z:
        for f in checkpoint.iterdir():
            z.write(f, f.name)
    with zipfile.ZipFile(files / "evil.zip", "w") as z:
        z.writestr("../escape.json", "{}")
    (files / "not-an-archive.tar").write_bytes(b"plain bytes")
    hub = HubServer(files_dir=files)
    with hub.running() as url:
        for name in ("wrapped.tar.gz", "flat.tgz", "ck.zip"):
            out = fetch_model(ModelLocation("uri", f"{url}/files/{name}"), tmp_path / "dl" / name)
            assert same_files(checkpoint, out), name
        for name, why in [("missing.tar.gz", "HTTP 404"), ("evil.zip", "outside"),
                          ("not-an-archive.tar", "not a readable archive")]:
            with pytest.raises(FetchError, match=why):
                fetch_model(ModelLocation("uri", f"{url}/files/{name}"), tmp_path / "bad" / name)
            assert not (tmp_path / "bad" / name).exists(), "a failed download leaves nothing where the worker looks"
        with pytest.raises(FetchError, match="must be an archive"):
            fetch_model(ModelLocation("uri", f"{url}/files/model.bin"), tmp_path / "bad" / "bin")
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "bad" / "escape.json").exists()


# ---------------------------------------------------------------- S3-compatible store
@pytest.mark.skipif(moto_executable() is None, reason="moto_server not installed (MOTO_SERVER); .ci/run installs it")
def test_s3_prefix_and_archive_object(checkpoint, tmp_path, monkeypatch):
    from minio import Minio

    with moto_server(tmp_path) as endpoint:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        client = Minio(endpoint.removeprefix("http://"), "testing", "testing", secure=False, region="us-east-1")
        client.make_bucket("models")
        for f in checkpoint.iterdir():
            client.fput_object("models", f"llama/v1/{f.name}", str(f))
        archive = tmp_path / "ck.tar.gz"
        _tar(checkpoint, archive, "ck")
        client.fput_object("models", "archives/ck.tar.gz", str(archive))

        assert same_files(checkpoint, fetch_model(ModelLocation("uri", "s3://models/llama/v1"), tmp_path / "a"))
        assert same_files(checkpoint, fetch_model(ModelLocation("uri", "s3://models/archives/ck.tar.gz"),
                                                  tmp_path / "b"))
        with pytest.raises(FetchError, match="no objects"):
            fetch_model(ModelLocation("uri", "s3://models/nothing/here"), tmp_path / "c")
        with pytest.raises(FetchError, match="s3://nobucket/x"):
            fetch_model(ModelLocation("uri", "s3://nobucket/x"), tmp_path / "d")


# ---------------------------------------------------------------- disagg up
def test_disagg_up_downloads_a_hub_source_once(checkpoint, tmp_path):
    from disagg.worker.local.launcher import resolve_model_dir

    hub = HubServer()
    hub.add_repo("org/tiny", checkpoint)
    with hub.running() as url:
        doc = yaml.safe_load(f"""
model:
  servedName: tiny
  source: {{huggingFace: {{repo: org/tiny, endpoint: "{url}"}}}}
""")
        spec = s.parse_spec(doc)
        first = resolve_model_dir(spec, tmp_path / "cache")
        assert same_files(checkpoint, Path(first))
        seen = len(hub.requests)
        assert resolve_model_dir(spec, tmp_path / "cache") == first and len(hub.requests) == seen
        missing = s.parse_spec({**doc, "model": {**doc["model"], "source": {"huggingFace": {
            "repo": "org/absent", "endpoint": url}}}})
        with pytest.raises(ValueError, match="spec.model.source.*org/absent"):
            resolve_model_dir(missing, tmp_path / "cache")
