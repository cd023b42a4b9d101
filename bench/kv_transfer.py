"""Benchmark: the KV of one 2048-token prompt moved between two processes with NixlTransport.

Layout of a Llama-3-8B-like model: 32 layers x (K, V), block 16, 8 KV heads, head_dim 128, bfloat16
-> 2 MiB per block, 128 blocks, 256 MiB per prompt. Reads it from a child process (the owner,
as a prefill engine would be) once into consecutive blocks and once with both sides fragmented
(every other block), and compares with an in-process copy of the same blocks measured in the
same run:
  - "run copy": one tensor.copy_ per coalesced run (a memcpy per run; the best one process can do),
    on 1 torch thread by default: a READ is a single-threaded kernel copy, and 2 OpenMP threads on a
    shared 2-core box collapse under contention
  - "index_copy": dst.index_copy_(0, local_ids, src.index_select(0, remote_ids)) (gather + scatter)

    python bench/kv_transfer.py [--runs 10] [--prompt-tokens 2048]
Not a test: it prints numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from disagg.worker.runner.kv_cache_memory import allocate_kv_cache
from disagg.worker.kv_transfer.base import KVCacheSpec
from disagg.worker.kv_transfer.nixl_transport import NixlTransport, TransferState, coalesce
from disagg.worker.kv_transfer.side_channel import SideChannelServer, fetch_engine_metadata

HOST = "127.0.0.1"


def make_spec(num_blocks: int) -> KVCacheSpec:
    return KVCacheSpec(model_name="bench-llama-8b-like", num_layers=32, num_kv_heads=8, head_dim=128,
                       block_size=16, num_blocks=num_blocks, dtype="bfloat16")


def make_kv(spec: KVCacheSpec, seed: int, hugepages: bool = False) -> torch.Tensor:
    """Random bits: every page touched before timing, and no two pages alike (a host that merges
    identical pages, e.g. KSM, makes copies of constant-filled buffers look twice as fast)."""
    shape = (spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    kv = allocate_kv_cache(shape, torch.bfloat16, "cpu", hugepages=hugepages)  # as the engine allocates it
    g = torch.Generator().manual_seed(seed)
    kv.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g))
    return kv


def serve(num_blocks: int, hugepages: bool) -> None:
    """The owner (prefill) side: register, serve metadata, poll notifications until stdin closes."""
    import select

    spec = make_spec(num_blocks)
    kv = make_kv(spec, seed=0, hugepages=hugepages)
    kv.view(num_blocks, -1)[:, 0] = torch.arange(num_blocks, dtype=torch.bfloat16)  # block id in each block
    with NixlTransport("bench-owner", spec, kv) as transport:
        transport.register()
        with SideChannelServer(transport.local_metadata(), HOST, 0) as server:
            print("READY", json.dumps({"port": server.port}), flush=True)
            while True:
                transport.get_new_notifs()
                if select.select([sys.stdin], [], [], 0.001)[0] and not sys.stdin.readline():
                    return


def read_once(reader: NixlTransport, local: list[int], remote: list[int]) -> float:
    t0 = time.perf_counter()
    handle = reader.start_read("bench-owner", local, remote, b"bench")
    while reader.poll(handle) is not TransferState.DONE:
        pass
    return time.perf_counter() - t0


def run_copy_once(dst: torch.Tensor, src: torch.Tensor, spans: list[tuple[int, int, int]]) -> float:
    t0 = time.perf_counter()
    for lo, ro, n in spans:
        dst[lo:lo + n].copy_(src[ro:ro + n])
    return time.perf_counter() - t0


def index_copy_once(dst: torch.Tensor, src: torch.Tensor, local: torch.Tensor, remote: torch.Tensor) -> float:
    # on (num_blocks, bytes_per_block / 8) int64 views: same bytes, no per-dtype slow path (bf16 index_copy is)
    t0 = time.perf_counter()
    dst.index_copy_(0, local, src.index_select(0, remote))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="for the in-process copies (a READ is a single-threaded kernel copy); 0 = torch default")
    parser.add_argument("--nixl-threads", type=int, default=0, help="UCX backend worker threads (reader side)")
    parser.add_argument("--no-hugepages", dest="hugepages", action="store_false",
                        help="KV tensors on 4 KiB pages (the engine puts its CPU KV cache on huge pages)")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # owner child: num_blocks
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.hugepages)
        return

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    nblocks = args.prompt_tokens // 16
    pool = 2 * nblocks  # room for a fragmented (every other block) allocation on both sides
    spec = make_spec(pool)
    owner_cmd = [sys.executable, __file__, "--serve", str(pool)] + ([] if args.hugepages else ["--no-hugepages"])
    owner = subprocess.Popen(owner_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("READY"):
            line = owner.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("owner process exited before READY")
        port = json.loads(line.split(" ", 1)[1])["port"]
        reader_kv = make_kv(spec, seed=1, hugepages=args.hugepages)
        # the in-process baseline's buffers
        src, dst = (make_kv(spec, seed=s, hugepages=args.hugepages) for s in (2, 3))
        with NixlTransport("bench-reader", spec, reader_kv, num_threads=args.nixl_threads) as reader:
            reader.register()
            reader.add_peer(fetch_engine_metadata(HOST, port, timeout=10.0))
            report(reader, reader_kv, src, dst, nblocks, args.runs)
    finally:
        owner.stdin.close()  # type: ignore[union-attr]
        try:
            owner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait(timeout=10)


def report(reader: NixlTransport, reader_kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
           nblocks: int, runs: int) -> None:
    bpb = reader.spec.bytes_per_block
    nbytes = nblocks * bpb
    print(f"KV of one prompt: {nblocks} blocks x {bpb / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB "
          f"(32 layers x K,V, block 16, 8 KV heads, head_dim 128, bfloat16); median of {runs} runs; "
          f"torch threads {torch.get_num_threads()}")
    allocations = {
        "contiguous": (list(range(nblocks)), list(range(nblocks))),
        "fragmented": (list(range(0, 2 * nblocks, 2)), list(range(1, 2 * nblocks, 2))),  # every other block
    }
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    src64, dst64 = (t.view(t.shape[0], -1).view(torch.int64) for t in (src, dst))
    for name, (local, remote) in allocations.items():
        spans = coalesce(local, remote)
        local_idx, remote_idx = torch.tensor(local), torch.tensor(remote)
        read_once(reader, local, remote)  # warm-up: connection, first touch
        run_copy_once(dst, src, spans)
        reader_kv.view(reader.spec.num_blocks, -1)[:, 0] = -1.0
        reader.drain_stats()
        times: dict[str, list[float]] = {"nixl": [], "run_copy": [], "index_copy": []}
        for _ in range(runs):  # interleaved, so drift on a shared VM hits all three alike
            times["nixl"].append(read_once(reader, local, remote))
            times["run_copy"].append(run_copy_once(dst, src, spans))
            times["index_copy"].append(index_copy_once(dst64, src64, local_idx, remote_idx))
        stats = reader.drain_stats()
        got = reader_kv.view(reader.spec.num_blocks, -1)[local, 0].float()
        assert torch.equal(got, torch.tensor(remote, dtype=torch.float32)), "NIXL read returned wrong blocks"
        nixl_s, run_copy_s, index_copy_s = (statistics.median(times[k]) for k in ("nixl", "run_copy", "index_copy"))
        post_ms = 1e3 * statistics.median(stats["post_time_s"])
        print(f"{name:>10}: NIXL READ {gbps(nixl_s):5.2f} GB/s ({1e3 * nixl_s:5.1f} ms, post {post_ms:5.2f} ms, "
              f"{stats['num_descriptors'][-1]:3d} descriptors) | run copy {gbps(run_copy_s):5.2f} GB/s, "
              f"ratio {run_copy_s / nixl_s:.2f} | index_copy {gbps(index_copy_s):5.2f} GB/s, "
              f"ratio {index_copy_s / nixl_s:.2f}")


if __name__ == "__main__":
    main()
