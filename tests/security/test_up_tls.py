"""`disagg up --tls`: the router of a local run serves HTTPS with a self-signed certificate made for the run (its
path printed, the curl example trusting it by name), the workers get the run's hand-off key, and a plaintext
request to the router's port is refused without taking it down."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml

from disagg.worker.local.self_signed import client_context
from security_helpers import MODEL, REPO, disagg_up

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up-tls")
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    doc["spec"]["kvTransfer"]["connector"] = "SharedStorageConnector"  # no NIXL needed to show TLS
    doc["spec"]["decode"]["replicas"] = 1
    with disagg_up(tmp, doc, "--tls") as (port, text):
        yield {"url": f"https://127.0.0.1:{port}", "output": text, "logs": tmp / "logs"}


def test_the_router_serves_https_with_the_runs_certificate(up):
    out = up["output"]()
    cert = re.search(r"TLS: self-signed certificate (\S+)", out).group(1)
    assert f"curl -s --cacert {cert} {up['url']}/v1/completions" in out
    assert re.search(r"-> \{\"choices\"", out), out  # the launcher's own first request went over TLS
    assert "hand-offs: signed with a key made for this run" in out
    trust = client_context(cert)
    r = httpx.post(f"{up['url']}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   verify=trust, timeout=60)
    assert r.status_code == 200, r.text
    assert (Path(cert).parent / "tls-key.pem").stat().st_mode & 0o077 == 0  # the key: its owner's only


def test_a_plaintext_request_to_the_router_fails_and_it_keeps_serving(up):
    with pytest.raises(httpx.TransportError):
        httpx.get(up["url"].replace("https://", "http://") + "/v1/models", timeout=10)
    cert = re.search(r"TLS: self-signed certificate (\S+)", up["output"]()).group(1)
    assert httpx.get(f"{up['url']}/ready", verify=client_context(cert), timeout=10).status_code == 200
