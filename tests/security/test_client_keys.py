"""Client API keys on real processes: workers with --api-key (the resource's shared key), a router and an endpoint
picker (through a real Envoy) with client keys of their own, and pd-proxy passing the client's Authorization to
the engine behind it. No key or a wrong one gets 401 on the OpenAI routes; a valid one gets the answer; the
probes' routes stay open; a client's key never reaches a worker."""
from __future__ import annotations

import httpx
import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from disagg.worker.local.process import ProcessSpec
from disagg.worker.ports import free_port
from security_helpers import complete

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

CLIENT_KEYS = ("sk-client-one", "sk-client-two")
WORKER_KEY = "sk-workers-of-team-a"
BODY = {"prompt": "The harbour at dawn", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory, handoff_env):
    from serving_fleet import CLI, Fleet

    tmp = tmp_path_factory.mktemp("client-keys")
    (tmp / "clients").write_text("# one key a line\n" + "\n".join(CLIENT_KEYS) + "\n")
    (tmp / "workers").write_text(WORKER_KEY + "\n")
    f = Fleet(tmp)
    worker_env = {**handoff_env, "VLLM_API_KEY": WORKER_KEY}  # the worker honours vLLM's variable
    prefill = f.worker("prefill", "prefill", tiny_model_dir, "NixlConnector", env=worker_env)
    decode = f.worker("decode", "decode", tiny_model_dir, "NixlConnector", env=worker_env,
                      extra=("--pd-discovery", "static", "--pd-prefill", prefill, "--pd-probe-interval", "0.5"))
    f.wait_ready()
    keys = ("--api-key-file", str(tmp / "clients"), "--worker-api-key-file", str(tmp / "workers"))
    router = f.router([prefill], [decode], extra=keys)
    picker = f.epp([prefill], [decode], extra=keys)
    gateway = f.envoy(picker, [decode])
    port = free_port()
    proxy = f._start(ProcessSpec("pd-proxy", [*CLI, "pd-proxy", "--role", "decode", "--engine-url", decode, "--host",
                                              "127.0.0.1", "--port", str(port)], f"http://127.0.0.1:{port}",
                                 dict(handoff_env)))
    f.wait_ready()
    yield {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway, "pd-proxy": proxy}
    assert set(f.stop().values()) == {0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("server, key", [("router", CLIENT_KEYS[1]), ("gateway", CLIENT_KEYS[0]),
                                         ("decode", WORKER_KEY), ("prefill", WORKER_KEY), ("pd-proxy", WORKER_KEY)])
def test_no_key_or_a_wrong_one_is_401_and_the_key_is_served(fleet, server, key):
    url = fleet[server]
    for headers, words in (({}, "Authorization: Bearer"), (bearer("sk-wrong"), "invalid API key"),
                           ({"Authorization": f"Basic {key}"}, "Authorization: Bearer")):
        r = complete(url, BODY, headers=headers)
        assert r.status_code == 401, (server, headers, r.text)
        assert words in r.json()["error"]["message"] and r.json()["error"]["code"] == 401
        if server != "pd-proxy":  # pd-proxy passes the engine's answer on as it is
            assert r.headers["www-authenticate"] == "Bearer"
    r = complete(url, BODY, headers=bearer(key))
    assert r.status_code == 200, (server, r.text)
    assert r.json()["usage"]["completion_tokens"] == 3
    assert "authorization" not in {k.lower() for k in r.headers}


def test_a_client_key_is_no_worker_key(fleet):
    """Client keys open the router and the gateway only: a worker takes none of them (the router and the picker
    send the workers' own key, never the client's)."""
    for worker in ("decode", "prefill"):
        assert complete(fleet[worker], BODY, headers=bearer(CLIENT_KEYS[0])).status_code == 401


def test_the_p_d_hops_behind_a_key_move_kv(fleet):
    """The router's hops and the gateway's decode worker (its own prefill hop) reach workers that want a key."""
    from serving_helpers import metric

    before = metric(fleet["decode"], "disagg:kv_bytes_loaded_total")
    for url, key in ((fleet["router"], CLIENT_KEYS[0]), (fleet["gateway"], CLIENT_KEYS[1])):
        body = {**BODY, "prompt": f"{url} long enough to fill one block of sixteen tokens or more, surely"}
        assert complete(url, body, headers=bearer(key)).status_code == 200
        assert metric(fleet["decode"], "disagg:kv_bytes_loaded_total") > before, url
        before = metric(fleet["decode"], "disagg:kv_bytes_loaded_total")


@pytest.mark.parametrize("server", ["router", "decode", "prefill"])
def test_probes_and_metrics_stay_open(fleet, server):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{fleet[server]}{path}", timeout=10).status_code == 200, (server, path)
    for path in ("/v1/models", "/endpoints" if server == "router" else "/tokenizer"):
        assert httpx.get(f"{fleet[server]}{path}", timeout=10).status_code == 401, (server, path)
