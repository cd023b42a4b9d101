"""`disagg fetch-model`: download a checkpoint into a local directory before a worker loads it.

Sources: a Hugging Face Hub repo (huggingface_hub; HF_TOKEN and HF_ENDPOINT from the environment), an http(s)
archive (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz, .zip) or an S3 location (s3://bucket/prefix: every object under
the prefix, or one archive object) on AWS or any S3-compatible store (the `minio` client; credentials and
endpoint from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION).

On Kubernetes an init container runs this into the pod's model cache; `disagg up` calls fetch_model() itself.
A completed download leaves a marker naming its source: the next run with the same source (a restarted pod on
a cache PVC, a second `disagg up`) uses the directory without any network access.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

logger = logging.getLogger("disagg.fetch")

MARKER = ".disagg-fetched.json"
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
# what a checkpoint needs; the Hub download skips the rest (other formats, images, READMEs)
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
HTTP_TIMEOUT_S = 30.0  # connect/read timeout of one HTTP exchange, not of the whole download


class FetchError(Exception):
    """A checkpoint could not be fetched; the message names the source and why."""


@dataclass(frozen=True)
class ModelLocation:
    kind: str  # "huggingFace" | "uri"
    value: str  # the repo id or the URL
    revision: str | None = None  # Hub revision
    endpoint: str | None = None  # Hub endpoint; default HF_ENDPOINT, else the public Hub


def fetch_model(location: ModelLocation, dest: str | Path) -> Path:
    """The checkpoint directory at `dest` (with config.json), downloading it unless already there."""
    dest = Path(dest)
    if _marker(dest) == asdict(location) and (dest / "config.json").is_file():
        logger.info("using %s already in %s", location.value, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if location.kind == "huggingFace":
        _fetch_hub(location, dest)
    elif location.kind == "uri":
        _fetch_uri(location.value, dest)
    else:
        raise FetchError(f"unknown model source kind {location.kind!r}")
    if not (dest / "config.json").is_file():
        raise FetchError(f"{location.value}: no config.json in the downloaded checkpoint ({dest})")
    (dest / MARKER).write_text(json.dumps(asdict(location)))
    logger.info("fetched %s into %s", location.value, dest)
    return dest


def _marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _fetch_hub(location: ModelLocation, dest: Path) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # local_dir: plain files in dest (resumable; huggingface_hub keeps its metadata in dest/.cache)
        snapshot_download(location.value, revision=location.revision, local_dir=dest, allow_patterns=HUB_PATTERNS,
                          endpoint=location.endpoint or os.environ.get("HF_ENDPOINT") or None,
                          token=os.environ.get("HF_TOKEN") or None)
    except RepositoryNotFoundError as e:
        raise FetchError(f"Hugging Face repo {location.value!r}: not found or not authorized (a gated or private "
                         f"repo needs HF_TOKEN): {_first_line(e)}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise FetchError(f"Hugging Face repo {location.value!r}: {_first_line(e)}") from None


def _fetch_uri(url: str, dest: Path) -> None:
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if not _is_archive(parsed.path):
            raise FetchError(f"{url}: an http(s) source must be an archive ({', '.join(ARCHIVE_SUFFIXES)})")
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            archive = Path(tmp) / Path(parsed.path).name
            _download_http(url, archive)
            _install(lambda staging: _extract(archive, staging, url), dest)
    elif parsed.scheme == "s3":
        _fetch_s3(parsed.netloc, parsed.path.lstrip("/"), dest, url)
    else:
        raise FetchError(f"{url}: scheme {parsed.scheme or '(none)'}:// is not supported; use http://, https:// "
                         "or s3://")


def _download_http(url: str, target: Path) -> None:
    import httpx

    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=HTTP_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise FetchError(f"{url}: HTTP {response.status_code}")
            with open(target, "wb") as f:
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
    except httpx.HTTPError as e:
        raise FetchError(f"{url}: {type(e).__name__}: {e}") from None


def _fetch_s3(bucket: str, key: str, dest: Path, url: str) -> None:
    client = _s3_client(url)
    from minio.error import MinioException

    try:
        if _is_archive(key):
            with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
                archive = Path(tmp) / Path(key).name
                client.fget_object(bucket, key, str(archive))
                _install(lambda staging: _extract(archive, staging, url), dest)
            return
        prefix = key.rstrip("/") + "/" if key else ""

        def download(staging: Path) -> None:
            count = 0
            for obj in client.list_objects(bucket, prefix=prefix, recursive=True):
                relative = obj.object_name[len(prefix):]
                if obj.is_dir or not relative:
                    continue
                target = _inside(staging, relative, url)
                client.fget_object(bucket, obj.object_name, str(target))
                count += 1
            if count == 0:
                raise FetchError(f"{url}: no objects under that prefix")
        _install(download, dest)
    except MinioException as e:
        raise FetchError(f"{url}: {_first_line(e)}") from None


def _s3_client(url: str):
    try:
        from minio import Minio
    except ModuleNotFoundError:
        raise FetchError(f"{url}: s3:// sources need the minio client: pip install 'disagg[s3]'") from None
    endpoint = urlparse(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                        or "https://s3.amazonaws.com")
    if not endpoint.hostname:
        raise FetchError(f"AWS_ENDPOINT_URL {endpoint.geturl()!r} is not a URL")
    return Minio(endpoint.netloc, access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
                 secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                 session_token=os.environ.get("AWS_SESSION_TOKEN"),
                 region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
                 secure=endpoint.scheme == "https")


def _install(fill, dest: Path) -> None:
    """Fill a staging directory beside dest, then swap it in: a failed download never leaves a half checkpoint
    where the worker looks."""
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    try:
        fill(staging)
        root = _checkpoint_root(staging)
        if dest.exists():
            shutil.rmtree(dest)
        root.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _checkpoint_root(directory: Path) -> Path:
    """Archives often wrap the checkpoint in one top-level folder: descend into it."""
    entries = [p for p in directory.iterdir() if not p.name.startswith(".")]
    if not (directory / "config.json").exists() and len(entries) == 1 and entries[0].is_dir():
        return _checkpoint_root(entries[0])
    return directory


def _extract(archive: Path, target: Path, url: str) -> None:
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                for name in z.namelist():
                    _inside(target, name, url)  # refuse members that would land outside target
                z.extractall(target)
        else:
            with tarfile.open(archive, "r:*") as t:
                t.extractall(target, filter="data")  # no absolute paths, links out, devices
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"{url}: not a readable archive: {e}") from None


def _inside(root: Path, relative: str, url: str) -> Path:
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise FetchError(f"{url}: entry {relative!r} points outside the checkpoint directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---------------------------------------------------------------- the subcommand
def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-repo", help="Hugging Face repo id (HF_TOKEN, HF_ENDPOINT from the environment)")
    source.add_argument("--uri", help="http(s):// archive or s3://bucket/prefix")
    p.add_argument("--revision", help="Hub branch, tag or commit (with --hf-repo)")
    p.add_argument("--dest", required=True, help="checkpoint directory to fill")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    location = (ModelLocation("huggingFace", args.hf_repo, args.revision) if args.hf_repo
                else ModelLocation("uri", args.uri))
    try:
        fetch_model(location, args.dest)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
