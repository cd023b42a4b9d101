"""Per-pod capacity models for bench/autoscale_sim.py: measured from the real engine in the same run, or a fixed,
documented GPU profile (reproducible without measuring).

A prefill pod takes prefill_fixed_s + prefill_per_token_s x prompt tokens per request, one request at a time, and
holds each prompt's KV until decode has pulled it. A decode pod steps its whole batch at once:
step = decode_step_fixed_s + decode_step_per_seq_s x batch, one token per running request per step.
KV moves prefill -> decode over one shared fabric (sized by the simulator against the trace; more pods add no
bandwidth), each transfer also paying xfer_fixed_s.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PodCapacity:
    source: str  # where the numbers come from
    prefill_fixed_s: float  # seconds per prefill request, besides its tokens
    prefill_per_token_s: float  # seconds per prompt token
    decode_step_fixed_s: float  # seconds per decode step with an empty batch
    decode_step_per_seq_s: float  # extra seconds per decode step per running request
    decode_max_seqs: int  # batch cap (max_num_seqs)
    decode_kv_tokens: int  # KV tokens a decode pod holds (prompt + output reserved at admission)
    prefill_kv_tokens: int  # KV tokens a prefill pod holds for requests not yet pulled
    xfer_fixed_s: float  # per-transfer latency (handshake, notification)
    startup_s: float  # pod creation -> ready (image pull cached, weights load, warm-up)

    def prefill_s(self, prompt: int) -> float:
        return self.prefill_fixed_s + self.prefill_per_token_s * prompt

    def step_s(self, batch: int) -> float:
        return self.decode_step_fixed_s + self.decode_step_per_seq_s * batch


# Llama-3-8B, bf16, one H100-80GB per pod, TP=1 (rounded from public vLLM benchmarks; KV = 128 KiB per token):
# ~10k prompt tokens/s per prefill pod; decode step ~10 ms + 0.4 ms per running request (attention reads grow with
# the batch's context); max_num_seqs 96; decode KV budget 160k tokens (20 GiB of the 80 GiB), prefill keeps 200k
# for unsent KV; 45 s from pod creation to ready.
GPU_H100_LLAMA8B = PodCapacity(
    source="fixed profile: Llama-3-8B bf16 on H100 (documented in bench/autoscale_sim_capacity.py)",
    prefill_fixed_s=0.015, prefill_per_token_s=0.0001, decode_step_fixed_s=0.010, decode_step_per_seq_s=0.0004,
    decode_max_seqs=96, decode_kv_tokens=160_000, prefill_kv_tokens=200_000,
    xfer_fixed_s=0.005, startup_s=45.0,
)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; b clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    return my - b * mx, b


def measure_capacity(layers: int = 4, hidden: int = 256, repeats: int = 3) -> tuple[PodCapacity, dict]:
    """Time the real engine on this machine (a few seconds): prefill vs prompt length, decode step vs batch.
    Returns the CPU capacity rescaled so one decode step at batch 1 takes the GPU profile's time (the trace and
    SLOs are then meaningful in seconds), keeping the measured shapes: prefill cost per token relative to a decode
    step, and how the step grows with the batch. KV sizes, transfer latency and start-up come from the GPU profile."""
    import torch

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.model import write_tiny_checkpoint

    torch.manual_seed(0)
    tmp = tempfile.mkdtemp()
    try:
        heads = hidden // 64
        write_tiny_checkpoint(tmp, hidden_size=hidden, num_layers=layers, num_heads=heads,
                              num_kv_heads=max(1, heads // 2), intermediate_size=hidden * 3)
        llm = LLM(tmp, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
                  enable_prefix_caching=False)
        vocab = llm.engine.model_config.vocab_size

        def run(batch: int, prompt: int, new: int) -> float:
            prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(prompt)] for i in range(batch)]
            sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                llm.generate(prompts, sp)
                best = min(best, time.perf_counter() - t)
            return best

        for n in (64, 256, 512):  # warm-up every shape (allocator, thread pool)
            run(1, n, 2)
        lengths = [64, 256, 512]
        prefill = [run(1, n, 1) for n in lengths]
        batches = [1, 8, 32]
        new = 17  # 16 decode steps after the first token
        steps = [(run(b, 16, new) - run(b, 16, 1)) / (new - 1) for b in batches]
        llm.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pa, pb = _fit_line(lengths, prefill)
    da, db = _fit_line(batches, steps)
    g = GPU_H100_LLAMA8B
    scale = g.step_s(1) / (da + db)  # CPU seconds -> simulated seconds
    cap = replace(g, source=f"measured on this CPU ({layers} layers, hidden {hidden}), time x{scale:.2f}",
                  prefill_fixed_s=max(pa, 0.0) * scale, prefill_per_token_s=pb * scale,
                  decode_step_fixed_s=max(da, 0.0) * scale, decode_step_per_seq_s=db * scale)
    raw = {"prefill_s_by_prompt": dict(zip(lengths, prefill)), "step_s_by_batch": dict(zip(batches, steps)),
           "time_scale": scale}
    return cap, raw
