"""A prefill engine in its own process, driven by JSON lines on stdin (for the NIXL tests).

  {"prompts": [...], "max_tokens": 1}  -> prints {"params": [kv_transfer_params, ...], "tokens": [...]}
  {"cmd": "wait"}                       -> steps until no KV is held, prints {"free": n, "num_blocks": n,
                                           "expired": n, "pending_sends": n}
The engine keeps stepping between commands (notifications and leases need it). EOF -> exit 0.
"""
import json
import queue
import sys
import threading
import time

from disagg.worker import LLM, SamplingParams


def idle_step(engine) -> int:
    """One engine step, then a short sleep; returns the KV leases that expired in it (its stats are cleared)."""
    engine.step()
    expired = sum(s.get("num_kv_expired_reqs", 0) for s in engine.stats.kv_connector_stats)
    engine.stats.kv_connector_stats.clear()
    time.sleep(0.001)
    return expired


def main() -> None:
    model, lease, port = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    ktc = {"kv_connector": "NixlConnector",
           "kv_connector_extra_config": {"lease_seconds": lease, "side_channel_port": port}}
    llm = LLM(model, max_model_len=512, num_kv_blocks=96, kv_transfer_config=ktc)
    engine = llm.engine
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [commands.put(line) for line in sys.stdin] + [commands.put(None)],
                     daemon=True).start()
    print(json.dumps({"ready": True, "port": engine.worker_connector.port}), flush=True)
    expired = 0
    while True:
        try:
            line = commands.get_nowait()
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.strip():
            cmd = json.loads(line)
            if "prompts" in cmd:
                sp = SamplingParams(max_tokens=cmd.get("max_tokens", 1), temperature=0)
                ids = [engine.add_request(p, sp, kv_transfer_params={"do_remote_decode": True})
                       for p in cmd["prompts"]]
                done = {}
                while len(done) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out
                print(json.dumps({"params": [done[i].kv_transfer_params for i in ids],
                                  "tokens": [done[i].outputs[0].token_ids for i in ids]}), flush=True)
            elif cmd.get("cmd") == "wait":
                while engine.has_pending_kv_work():
                    expired += idle_step(engine)
                print(json.dumps({"free": engine.kv_cache_manager.num_free_blocks, "num_blocks": engine.kv_cache_manager.pool.num_blocks,
                                  "expired": expired,
                                  "pending_sends": engine.scheduler_connector.get_pending_counts()["pending_sends"]}),
                      flush=True)
        expired += idle_step(engine)
    llm.shutdown()


if __name__ == "__main__":
    main()
