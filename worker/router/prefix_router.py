"""The prefix-aware policy's adapter: tokenizes a request as the worker will, hashes its blocks as the engine
does (block_pool.hash_request_blocks), reads each endpoint's cached prefix from the KVIndex and load from the
pools, and asks prefix_policy.plan_route. The tokenizer is the served model's: a local directory
(`--tokenizer`) or the files a worker serves at GET /tokenizer."""
from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from disagg.worker.engine.block_pool import hash_request_blocks
from disagg.worker.model.tokenizer import Tokenizer
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.kv_index import KVIndex
from disagg.worker.router.kv_subscriber import KVEventSubscriptions
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.prefix_policy import Candidate, PrefixPolicyConfig, RoutePlan, plan_route
from disagg.worker.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # the workers' default, for endpoints that have not announced a block yet


class PrefixRouter:
    def __init__(self, config: PrefixPolicyConfig, metrics: RouterMetrics, tokenizer: Tokenizer | None = None):
        self.config = config
        self.metrics = metrics
        self.tokenizer = tokenizer  # None until learned from a worker
        self.index = KVIndex()

    def prompt_token_ids(self, body: dict[str, Any], path: str) -> list[int] | None:
        """The prompt's token ids as the worker computes them (app._prompt_token_ids); None when this cannot
        tell (no tokenizer yet, or a request the worker will reject anyway)."""
        tok = self.tokenizer
        if tok is None:
            return None
        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate(body)
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
                return tok.encode(text, add_special_tokens=False)
            prompt = CompletionRequest.model_validate(body).single_prompt()
        except (ValidationError, ValueError, TypeError):
            return None
        except Exception:  # noqa: BLE001 - a chat template error: the worker answers it with a 400
            return None
        return tok.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def plan(self, body: dict[str, Any], path: str, prefill: EndpointPool, decode: EndpointPool) -> RoutePlan | None:
        ids = self.prompt_token_ids(body, path)
        if not ids:
            return None
        hashes: dict[int, list[bytes]] = {}  # block size -> the prompt's chain hashes, as the engine may hit

        def candidates(pool: EndpointPool) -> list[Candidate]:
            out = []
            for ep in pool.available():
                bs = self.index.block_size(ep.url) or DEFAULT_BLOCK_SIZE
                if bs not in hashes:  # the engine keeps one token to compute: at most (n - 1) // bs blocks hit
                    hashes[bs] = hash_request_blocks(ids[: (len(ids) - 1) // bs * bs], bs, [])
                out.append(Candidate(ep.url, self.index.prefix_blocks(ep.url, hashes[bs]), bs, ep.load(),
                                     ep.kv_usage))
            return out

        decode_c, prefill_c = candidates(decode), candidates(prefill)
        plan = plan_route(len(ids), {bs: len(h) for bs, h in hashes.items()}, decode_c, prefill_c, self.config)
        self.metrics.prefix_decision(plan.prompt_tokens, plan.decode_hit_tokens)
        return plan


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json")


async def fetch_tokenizer(client: httpx.AsyncClient, url: str) -> Tokenizer | None:
    """The served model's tokenizer from a worker's GET /tokenizer ({"files": {name: text}}); None when it
    has none to give (an older worker, or vLLM)."""
    try:
        r = await client.get(f"{url}/tokenizer", timeout=30.0)
        files = r.json().get("files") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(files, dict) or "tokenizer.json" not in files:
        return None
    with tempfile.TemporaryDirectory(prefix="disagg-tokenizer-") as d:
        for name in TOKENIZER_FILES:
            if isinstance(files.get(name), str):
                (Path(d) / name).write_text(files[name])
        try:
            tok = Tokenizer(d)
        except Exception as e:  # noqa: BLE001 - a bad file from a worker: keep routing by load
            logger.warning("the tokenizer from %s does not load: %s", url, e)
            return None
    logger.info("prefix-aware routing: tokenizer from %s", url)
    return tok


async def maintain_forever(prefix: PrefixRouter, pools: list[EndpointPool], client: httpx.AsyncClient,
                           interval_s: float) -> None:
    """Learn the tokenizer (once) and keep the event subscriptions in step with the pools' ready endpoints."""
    subscriptions = KVEventSubscriptions(prefix.index, prefix.metrics)
    try:
        while True:
            if prefix.tokenizer is None:
                for ep in [e for pool in pools for e in pool.available()]:
                    if (tok := await fetch_tokenizer(client, ep.url)) is not None:
                        prefix.tokenizer = tok
                        break
            await subscriptions.sync_once(pools, client)
            await asyncio.sleep(interval_s)
    finally:
        subscriptions.close()
