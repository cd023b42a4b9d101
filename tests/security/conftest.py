"""The hostile-input tier: real `disagg worker`, `router`, `epp` (through a real Envoy) and `pd-proxy` processes on
loopback, each module one fleet. What a hostile input must not reach is a listening socket on an address of its
own (127.0.0.x) that counts every connection made to it."""
from __future__ import annotations

import pytest

from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, RESOURCE_ENV, HandoffSigner, decode_key, new_key
from hostile import Bystander
from serving_fleet import Fleet  # noqa: F401 (the tests import it here)

pytestmark = pytest.mark.slow
RESOURCE = "team-a/llama"


@pytest.fixture(scope="session")
def handoff_key() -> str:
    return new_key()


@pytest.fixture(scope="session")
def handoff_env(handoff_key) -> dict[str, str]:
    """What the operator's Secret gives every worker of one resource."""
    return {KEY_ENV: handoff_key, RESOURCE_ENV: RESOURCE}


@pytest.fixture(scope="session")
def signer(handoff_key) -> HandoffSigner:
    """The resource's key in the test's hands: to make hand-offs the workers must take (and tokens)."""
    return HandoffSigner(decode_key(handoff_key, "test"), RESOURCE)


@pytest.fixture
def bystander_factory():
    made: list[Bystander] = []

    def make(last: int) -> Bystander:
        made.append(Bystander(last))
        return made[-1]

    yield make
    for b in made:
        b.close()
