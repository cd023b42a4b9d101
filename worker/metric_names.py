"""The names of the worker's Prometheus metrics, in one place: what the worker exports (server/metrics.py and the
connectors' declarations), what the router scrapes (router/endpoints.py) and what the autoscaler reads
(operator/autoscaling/samples.py) are these constants.

Where vLLM has the metric, the name, type and meaning are vLLM's (dashboards, KEDA triggers and routers written
for vLLM work unchanged); the rest carries the `disagg:` prefix. Counters are named without the `_total` that
the exposition adds. Standard library only: the operator imports it."""
from __future__ import annotations

# ---------------------------------------------------------------- vLLM's
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge: requests in model execution batches
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge: waiting requests, those waiting for remote KV too
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge: fraction 0..1 of KV blocks in use
NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter: prompt tokens a worker has prefilled
GENERATION_TOKENS = "vllm:generation_tokens"  # counter
REQUEST_SUCCESS = "vllm:request_success"  # counter: finished requests
TTFT = "vllm:time_to_first_token_seconds"  # histogram
ITL = "vllm:inter_token_latency_seconds"  # histogram
E2E_LATENCY = "vllm:e2e_request_latency_seconds"  # histogram
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter, tokens
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter, tokens
# NIXL connector (declared by kv_transfer/nixl.py)
NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram, per transfer
NIXL_POST_TIME = "vllm:nixl_post_time_seconds"  # histogram, per transfer
NIXL_BYTES = "vllm:nixl_bytes_transferred"  # histogram, per transfer
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors"  # histogram, per transfer
NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"  # counter
NIXL_EXPIRED_REQS = "vllm:nixl_num_kv_expired_reqs"  # counter: requests whose KV expired unread (lease)
KV_NOTIFICATIONS_REJECTED = "disagg:kv_notifications_rejected"  # counter, prefill: not from the KV's reader
KV_RELEASED_UNREAD = "disagg:kv_released_unread"  # counter, prefill: sends freed by a release call (none will pull)
# exported by vLLM's decode workers only (engine vllm): requests by async KV load stage
VLLM_KV_FETCH_BY_STAGE = "vllm:num_requests_kv_fetch_by_stage"  # gauge, label `stage`

# ---------------------------------------------------------------- disagg's
NUM_WAITING_PROMPT_TOKENS = "disagg:num_waiting_prompt_tokens"  # gauge: prompt tokens of the waiting requests
KV_PENDING_SENDS = "disagg:kv_pending_sends"  # gauge, prefill: requests whose KV waits to be pulled
KV_PENDING_LOADS = "disagg:kv_pending_loads"  # gauge, decode: requests waiting for remote KV
KV_BYTES_LOADED = "disagg:kv_bytes_loaded"  # counter: KV bytes received from another worker (any connector)
KV_BYTES_SAVED = "disagg:kv_bytes_saved"  # counter: KV bytes written for another worker (pushing connectors)
# counter, label `reason`: requests refused before the engine - waiting_requests, waiting_prompt_tokens (429),
# body_too_large (413), body_timeout (408), prompt_too_long (400, told before tokenizing)
REQUESTS_REJECTED = "disagg:requests_rejected"
