"""The adapter of a policy that reads prefixes (prefix-aware): tokenizes a request as the worker will, hashes its
blocks as the engine does (block_pool.hash_request_blocks), reads each endpoint's cached prefix from the KVIndex
and load from the pools, and asks the policy's plan (prefix_policy.py). The tokenizer is the served model's: a
local directory (`--tokenizer`) or the files a worker serves at GET /tokenizer. vLLM workers serve neither: there
the prompt's token ids come from a worker's POST /tokenize for each request (vLLM's own chat template and special
tokens, so the ids are exactly the ones it will cache; one loopback round trip, bounded, and on any failure the
request is routed by load alone)."""
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
from disagg.worker.kv_events.subscriber import EventsDirectory, KVEventSubscriptions
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.policy import DEFAULT_BLOCK_SIZE, Candidate, Prompt, RoutePlan, RoutingPolicy
from disagg.worker.router.prefix_policy import PrefixAware, PrefixPolicyConfig
from disagg.worker.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0  # a worker's POST /tokenize; past it the request goes by load alone
# the chat request's fields vLLM's chat template rendering reads (its TokenizeChatRequest takes the same)
CHAT_TOKENIZE_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")


def tokenize_body(body: dict[str, Any], path: str) -> dict[str, Any] | list[int] | None:
    """vLLM's POST /tokenize body that yields the prompt's token ids as its /v1 endpoint computes them; a
    prompt already given as token ids is returned as they are; None for what cannot be told (a batch)."""
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        return {k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str):
        return None
    out = {"prompt": prompt, **{k: body[k] for k in ("model", "add_special_tokens") if k in body}}
    return out


class PrefixRouter:
    def __init__(self, policy: RoutingPolicy | PrefixPolicyConfig, metrics: RouterMetrics,
                 tokenizer: Tokenizer | None = None):
        # a policy that reads prefixes; a PrefixPolicyConfig stands for the prefix-aware policy with it
        self.policy = PrefixAware(policy) if isinstance(policy, PrefixPolicyConfig) else policy
        self.metrics = metrics
        self.tokenizer = tokenizer  # None until learned from a worker
        self.tokenize_remotely = False  # the workers are vLLM: ask one's POST /tokenize per request
        self.index = KVIndex()

    def prompt_token_ids(self, body: dict[str, Any], path: str) -> list[int] | None:
        """The prompt's token ids as the worker computes them (server/admission.prompt_token_ids); None when this cannot
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

    async def plan_request(self, body: dict[str, Any], path: str, prefill: EndpointPool, decode: EndpointPool,
                           client: httpx.AsyncClient) -> RoutePlan | None:
        """The plan for one request, tokenized locally or by a worker (vLLM); None: route by load."""
        if self.tokenizer is None and self.tokenize_remotely:
            workers = sorted([*decode.available(), *prefill.available()], key=lambda e: e.load())
            return self.plan_ids(await remote_token_ids(client, [e.url for e in workers], body, path),
                                 prefill, decode)
        return self.plan(body, path, prefill, decode)

    def plan(self, body: dict[str, Any], path: str, prefill: EndpointPool, decode: EndpointPool) -> RoutePlan | None:
        return self.plan_ids(self.prompt_token_ids(body, path), prefill, decode)

    def plan_ids(self, ids: list[int] | None, prefill: EndpointPool, decode: EndpointPool) -> RoutePlan | None:
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
                                     ep.kv_usage, ep.revision))
            return out

        decode_c, prefill_c = candidates(decode), candidates(prefill)
        prompt = Prompt(len(ids), {bs: len(h) for bs, h in hashes.items()})
        plan = self.policy.plan(prompt, decode_c, prefill_c)
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


async def remote_token_ids(client: httpx.AsyncClient, urls: list[str], body: dict[str, Any],
                           path: str, tries: int = 2) -> list[int] | None:
    """The prompt's token ids from the first of `urls` whose POST /tokenize answers (vLLM's shape:
    {"tokens": [...]}); None when none does or the request is not one to tell (the worker answers it)."""
    req = tokenize_body(body, path)
    if req is None or isinstance(req, list):
        return req
    for url in urls[:tries]:
        try:
            r = await client.post(f"{url}/tokenize", json=req, timeout=TOKENIZE_TIMEOUT_S)
        except httpx.HTTPError as e:
            logger.debug("tokenize at %s failed: %s", url, e)
            continue
        if r.status_code >= 500:
            continue
        if r.status_code != 200:
            return None  # the request itself is bad: the worker will say so
        try:
            tokens = r.json().get("tokens")
        except (ValueError, AttributeError):
            continue
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
    return None


async def serves_tokenize(client: httpx.AsyncClient, url: str) -> bool:
    """Whether the worker tokenizes at POST /tokenize (vLLM does; ours serves GET /tokenizer instead)."""
    try:
        r = await client.post(f"{url}/tokenize", json={"prompt": "a"}, timeout=10.0)
        return r.status_code == 200 and isinstance(r.json().get("tokens"), list)
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


async def maintain_forever(prefix: PrefixRouter, pools: list[EndpointPool], client: httpx.AsyncClient,
                           interval_s: float, directory: EventsDirectory | None = None) -> None:
    """Learn the tokenizer (once: its files, else a worker that tokenizes per request) and keep the event
    subscriptions in step with the pools' ready endpoints."""
    subscriptions = KVEventSubscriptions(prefix.index, prefix.metrics, directory=directory)
    try:
        while True:
            if prefix.tokenizer is None and not prefix.tokenize_remotely:
                for ep in [e for pool in pools for e in pool.available()]:
                    if (tok := await fetch_tokenizer(client, ep.url)) is not None:
                        prefix.tokenizer = tok
                        break
                    if await serves_tokenize(client, ep.url):
                        logger.info("prefix-aware routing: prompts tokenized by the workers' POST /tokenize "
                                    "(first: %s)", ep.url)
                        prefix.tokenize_remotely = True
                        break
            await subscriptions.sync_once(pools, client)
            await asyncio.sleep(interval_s)
    finally:
        subscriptions.close()
