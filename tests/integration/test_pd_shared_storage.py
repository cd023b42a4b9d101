"""P/D through the reference connector: a producer and a consumer engine in separate processes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
from disagg.worker import LLM, SamplingParams
model, role, store, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.loads(sys.stdin.read())
ktc = None
if role != "none":
    ktc = {"kv_connector": "SharedStorageConnector", "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": store}}
llm = LLM(model, max_model_len=256, num_kv_blocks=64, kv_transfer_config=ktc)
outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
stats = llm.engine.stats.kv_connector_stats
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "free": llm.engine.kv_cache_manager.num_free_blocks,
                  "loaded": sum(s.get("bytes_loaded", 0) for s in stats),
                  "saved": sum(s.get("bytes_saved", 0) for s in stats)}))
"""

PROMPTS = [
    "The history of the city begins with a small harbour and a market",
    "In the morning the engineers measured the latency of every request twice",
    "short one",
]


def run_engine(model: str, role: str, store: str, max_tokens: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, model, role, store, str(max_tokens)],
        input=json.dumps(PROMPTS), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_producer_and_consumer_processes_match_one_engine(tiny_model_dir, tmp_path):
    store = str(tmp_path / "kv")
    reference = run_engine(tiny_model_dir, "none", store, 10)
    producer = run_engine(tiny_model_dir, "kv_producer", store, 1)
    assert producer["saved"] > 0 and producer["free"] == 64
    consumer = run_engine(tiny_model_dir, "kv_consumer", store, 10)
    assert consumer["loaded"] > 0, "the consumer computed everything itself"
    assert consumer["tokens"] == reference["tokens"]
    assert consumer["free"] == 64
