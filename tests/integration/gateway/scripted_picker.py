"""An endpoint picker with a script instead of a policy, in its own process (as the real one runs: grpcio's
asyncio server on the main thread), for the protocol tests against a real Envoy.

    python scripted_picker.py PORT DECODE PREFILL     prints "ready"; SIGTERM stops it

Decode DECODE and prefill PREFILL for any path but /none (503), /shed (429) and /shed-early (429 at the
headers, before the body is read); a subset hint wins. It tells the model server what it saw in headers:
x-picker-saw-body (bytes:sha256 of the body it read), x-picker-saw-prefill-header (whether a client's
x-prefiller-host-port reached it) and x-picker-heard (the status of the last response the gateway passed it
for a request it routed, "none" before any)."""
import asyncio
import hashlib
import signal
import sys

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from disagg.worker.gateway.envoy_config import PREFILL_HEADER
from disagg.worker.gateway.ext_proc import EndpointPickerService, Pick, PickRequest


class ScriptedPicker:
    def __init__(self, decode: str, prefill: str):
        self.decode, self.prefill = decode, prefill
        self.heard = "none"

    async def admit(self, request: PickRequest) -> Pick | None:
        if request.path == "/shed-early":
            return Pick(status=429, message="refused at the headers", retry_after_s=1)
        return None

    def answered(self, pick: Pick, status: int, retry_after: str | None) -> None:
        self.heard = str(status)

    async def pick(self, request: PickRequest) -> Pick:
        if request.path == "/none":
            return Pick(status=503, message="no decode endpoint is ready", retry_after_s=2)
        if request.path == "/shed":
            return Pick(status=429, message="every decode endpoint is saturated", retry_after_s=1)
        saw = {"x-picker-saw-body": f"{len(request.body)}:{hashlib.sha256(request.body).hexdigest()}",
               "x-picker-saw-prefill-header": "yes" if PREFILL_HEADER in request.headers else "no",
               "x-picker-heard": self.heard}
        if request.subset is not None:
            return Pick(decode=self.decode, headers=saw) if self.decode in request.subset \
                else Pick(status=503, message="no endpoint of the subset is ready")
        return Pick(decode=self.decode, prefill=self.prefill, headers=saw)


async def main(port: int, decode: str, prefill: str) -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(EndpointPickerService(ScriptedPicker(decode, prefill)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
