"""The decode side's bound on a READ: abandoned after read_timeout_seconds or past the sender's lease."""
import pytest

from disagg.worker.kv_transfer.base import KVTransferConfig
from disagg.worker.kv_transfer.nixl_metadata import NixlSettings, read_expired


@pytest.mark.parametrize("now, lease_end, expect", [
    (100.5, None, None),  # posted at 100, timeout 2: still running
    (102.5, None, "read_timeout_seconds=2"),  # no answer within the timeout
    (100.5, 999.0, "lease"),  # wall clock 1000 is past the lease
    (100.5, 1001.0, None),  # lease still running
])
def test_read_expired(now, lease_end, expect):
    why = read_expired(posted_at=100.0, now=now, timeout=2.0, lease_expires_at=lease_end, wall_now=1000.0)
    assert (why is None) if expect is None else (expect in why)


def test_read_timeout_is_configured_and_checked():
    def settings(extra):
        return NixlSettings.from_config(KVTransferConfig("NixlConnector", kv_connector_extra_config=extra))

    assert settings({"side_channel_port": 1}).read_timeout == 10.0
    assert settings({"side_channel_port": 1, "read_timeout_seconds": 0.5}).read_timeout == 0.5
    with pytest.raises(ValueError, match="read_timeout_seconds=0"):
        settings({"side_channel_port": 1, "read_timeout_seconds": 0})
