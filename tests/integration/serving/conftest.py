"""Worker and router processes on loopback for the serving tests (free ports, readiness polled with a
deadline, SIGTERM at the end with the exit status checked)."""
from __future__ import annotations


import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from serving_fleet import CLI, WORKER_FLAGS, Fleet, connector_flags  # noqa: F401 (the tests import them here)

CONNECTORS = [
    pytest.param("SharedStorageConnector", id="shared-storage"),
    pytest.param("NixlConnector", id="nixl", marks=pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)),
]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("reference"))
    url = fleet.worker("both", "both", tiny_model_dir, None)
    yield fleet, url
    assert fleet.stop() == {"both": 0}


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(request, tiny_model_dir, tmp_path_factory, reference):
    from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, RESOURCE_ENV, new_key

    fleet = Fleet(tmp_path_factory.mktemp(request.param))
    key = {KEY_ENV: new_key(), RESOURCE_ENV: "serving/pd"}  # as the operator and `disagg up` run them: signed
    prefill = fleet.worker("prefill", "prefill", tiny_model_dir, request.param, lease_s=3, env=key)
    decodes = [fleet.worker(f"decode-{i}", "decode", tiny_model_dir, request.param, env=key) for i in range(2)]
    reference[0].wait_ready()
    fleet.wait_ready()
    router = fleet.router([prefill], decodes)
    fleet.wait_ready()
    yield {"fleet": fleet, "router": router, "prefill": prefill, "decodes": decodes, "reference": reference[1],
           "connector": request.param}
    codes = fleet.stop()
    killed = fleet.killed
    assert {n: c for n, c in codes.items() if n not in killed} == {n: 0 for n in codes if n not in killed}
