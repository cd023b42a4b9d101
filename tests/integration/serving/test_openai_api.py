"""The OpenAI API fields clients send, with the official `openai` client, against a colocated worker and
against the router in front of P/D workers: n, logprobs (equal to transformers' log-softmax), echo and
prompt_logprobs, penalties and the other sampling fields, tokenize / models / version, structured outputs,
and a 400 naming every field we do not support."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from serving_helpers import metric

pytestmark = pytest.mark.slow

PROMPT = "The history of the city begins with a small harbour"
MODEL = "tiny-llama"


@pytest.fixture(scope="module", params=["worker", "router"])
def target(request, reference, pd):
    """(base url, openai client) of the colocated worker or of the router in front of P/D workers."""
    url = reference[1] if request.param == "worker" else pd["router"]
    yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """(len-1, vocab) log-softmax of transformers' logits predicting tokens 1.."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def tokenize(url: str, **body) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---------------------------------------------------------------- logprobs
@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_equal_transformers(target, hf_model, stream):
    url, client = target
    prompt_ids = tokenize(url, prompt=PROMPT)
    kw = dict(model=MODEL, prompt=prompt_ids, max_tokens=5, temperature=0, echo=True, logprobs=3, seed=1,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if stream:
        tokens, lps, tops, offsets, text = [], [], [], [], ""
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
    else:
        c = client.completions.create(**kw).choices[0]
        text, tokens, lps = c.text, c.logprobs.tokens, c.logprobs.token_logprobs
        tops, offsets = c.logprobs.top_logprobs, c.logprobs.text_offset
    assert len(tokens) == len(prompt_ids) + 5 and lps[0] is None and tops[0] is None
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    all_ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert all_ids[: len(prompt_ids)] == prompt_ids
    r = httpx.post(f"{url}/detokenize", json={"tokens": all_ids}, timeout=30).json()
    assert text.removeprefix("<s>") == r["prompt"]  # echo: the prompt (ids: decoded) + the output
    want = hf_logprobs(hf_model, all_ids)
    got = torch.tensor(lps[1:], dtype=torch.float32)
    expected = want.gather(1, torch.tensor(all_ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    for pos, top in enumerate(tops[len(prompt_ids):], start=len(prompt_ids) - 1):
        best = want[pos].topk(3).values
        assert max(top.values()) == pytest.approx(best[0].item(), abs=1e-4)  # greedy: the top-1 is sampled
        assert len(top) == 3


def test_chat_logprobs_and_top_logprobs_equal_transformers(target, hf_model):
    url, client = target
    messages = [{"role": "user", "content": "Say something about the harbour."}]
    prompt_ids = tokenize(url, messages=messages)
    kw = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    ids = [int(e.token.removeprefix("token_id:")) for e in content]
    plain = client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    for e in plain.logprobs.content:  # a token that is part of a character still has its own bytes
        assert e.bytes and (bytes(e.bytes) == e.token.encode() or "\ufffd" in e.token), e
    want = hf_logprobs(hf_model, prompt_ids + ids)[len(prompt_ids) - 1:]
    streamed = [e for chunk in client.chat.completions.create(
        **kw, stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    for e, row, token_id in zip(content, want, ids):
        assert e.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


def test_vllm_prompt_logprobs_field(target, hf_model):
    url, _ = target
    prompt_ids = tokenize(url, prompt=PROMPT)
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                  "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    want = hf_logprobs(hf_model, prompt_ids)
    assert plp[0] is None and len(plp) == len(prompt_ids)
    for pos, (token_id, entry) in enumerate(zip(prompt_ids[1:], plp[1:])):
        assert entry[str(token_id)]["logprob"] == pytest.approx(want[pos, token_id].item(), abs=1e-4)


# ---------------------------------------------------------------- n
@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_completions_and_chat(target, stream):
    _, client = target
    kw = dict(model=MODEL, n=3, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    for create, args in ((client.completions.create, {"prompt": PROMPT}),
                         (client.chat.completions.create, {"messages": [{"role": "user", "content": PROMPT}]})):
        texts: dict[int, str] = {}
        if stream:
            usage = None
            for chunk in create(stream=True, stream_options={"include_usage": True}, **args, **kw):
                usage = chunk.usage or usage
                for c in chunk.choices:
                    piece = c.text if hasattr(c, "text") else (c.delta.content or "")
                    texts[c.index] = texts.get(c.index, "") + piece
        else:
            r = create(**args, **kw)
            usage = r.usage
            texts = {c.index: (c.text if hasattr(c, "text") else c.message.content) for c in r.choices}
        assert sorted(texts) == [0, 1, 2]
        assert len(set(texts.values())) > 1, texts  # seed + index: the choices differ
        assert usage.completion_tokens == 18


def test_n_choices_share_one_prefill_and_one_kv_transfer(pd):
    client = openai.OpenAI(base_url=f"{pd['router']}/v1", api_key="unused", max_retries=0, timeout=120)

    def loaded() -> float:
        return sum(metric(u, "disagg:kv_bytes_loaded_total") for u in pd["decodes"])

    def prefilled() -> float:
        return metric(pd["prefill"], "vllm:request_success_total")

    deltas = []
    for n, prompt in ((1, f"{PROMPT} one"), (3, f"{PROMPT} two")):  # same length, no prefix-cache hit
        before, before_p = loaded(), prefilled()
        r = client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=4, temperature=1.0, seed=3)
        assert len(r.choices) == n
        deltas.append((loaded() - before, prefilled() - before_p))
    (bytes1, prefills1), (bytes3, prefills3) = deltas
    assert bytes1 > 0 and bytes3 == bytes1, deltas  # the prompt's KV crossed once for three choices
    assert prefills1 == prefills3 == 1


# ---------------------------------------------------------------- sampling fields
def greedy(client, **kw) -> openai.types.Completion:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(**{**args, **kw}, extra_body=extra)


def test_logit_bias_and_penalties(target):
    url, client = target
    token = tokenize(url, prompt=" harbour", add_special_tokens=False)[0]
    assert greedy(client).choices[0].logprobs is None  # logprobs only when asked for

    def ids(**kw) -> list[int]:
        extra = {"return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
        r = greedy(client, logit_bias={str(token): 1.0}, logprobs=0, extra_body=extra, **kw)
        return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]

    assert ids() == [token] * 8
    assert ids(presence_penalty=2.0).count(token) == 1
    assert 1 < ids(frequency_penalty=0.3).count(token) < 8
    # repetition_penalty counts the prompt too, which has " harbour": penalized from the first token on
    assert ids(extra_body={"repetition_penalty": 50.0}).count(token) == 0
    assert ids(extra_body={"repetition_penalty": 1.0 / 50}).count(token) == 8


def test_min_p_seed_stop_fields_and_special_tokens(target):
    url, client = target
    want = greedy(client, logprobs=0).choices[0]
    top_only = greedy(client, temperature=1.0, seed=5, extra_body={"min_p": 1.0}).choices[0]
    assert top_only.text == want.text  # min_p=1 keeps only the most likely token
    a, b, c = (greedy(client, temperature=1.0, seed=s).choices[0].text for s in (11, 11, 12))
    assert a == b != c
    ids = [int(t.removeprefix("token_id:")) for t in
           greedy(client, logprobs=0, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]
    cut = greedy(client, extra_body={"stop_token_ids": [ids[3]]}).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == ids[3]
    stop = want.text[2:5]
    kept = greedy(client, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text.endswith(stop) and kept.finish_reason == "stop"
    assert greedy(client, stop=[stop]).choices[0].text == kept.text[: -len(stop)]
    special = tokenize(url, prompt="<|user|>", add_special_tokens=False)
    assert len(special) == 1
    bias = {str(special[0]): 100.0}
    assert greedy(client, max_tokens=3, logit_bias=bias).choices[0].text == ""
    shown = greedy(client, max_tokens=3, logit_bias=bias, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|user|>" * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, user="someone", extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field, value", [("suffix", "x"), ("best_of", 2), ("use_beam_search", True),
                                          ("response_format", {"type": "xml"}), ("guided_decoding_backend", "x")])
def test_unsupported_fields_get_400_naming_them(target, field, value):
    url, _ = target
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", field: value}, timeout=30)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"], r.text


def test_tokenize_detokenize_models_version(target):
    url, client = target
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}, timeout=30).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "hello world"}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}, timeout=30).status_code == 400
    model = client.models.list().data[0]
    assert model.id == MODEL and model.max_model_len == 512
    assert httpx.get(f"{url}/version", timeout=30).json()["version"]


# ---------------------------------------------------------------- structured outputs
SCHEMA = {"type": "object", "properties": {
    # a pattern, not maxLength: xgrammar 0.2.9's bounded-length strings admit control characters (invalid JSON)
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "pets", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_outputs_parse_and_validate(target, stream):
    _, client = target
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in (1, 2):
        for response_format, check in ((fmt, lambda v: jsonschema.validate(v, SCHEMA)),
                                       ({"type": "json_object"}, lambda v: isinstance(v, dict) or 1 / 0)):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                      response_format=response_format, max_tokens=200, temperature=1.0, seed=seed)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    stream=True, **kw) if c.choices)
            else:
                r = client.chat.completions.create(**kw)
                assert r.choices[0].finish_reason == "stop", r.choices[0]
                text = r.choices[0].message.content
            check(json.loads(text))


def test_vllm_guided_fields(target):
    url, client = target
    for seed in (1, 2, 3):
        base = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=seed)
        r = client.completions.create(**base, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,4}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.choices[0].text), r.choices[0].text
        r = client.completions.create(**base, extra_body={"guided_choice": ["north", "south", "east west"]})
        assert r.choices[0].text in {"north", "south", "east west"}
        r = client.completions.create(**{**base, "max_tokens": 200}, extra_body={"guided_json": SCHEMA})
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
        r = client.completions.create(**base, n=2, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert {c.text for c in r.choices} <= {"yes", "no"} and len(r.choices) == 2
    bad = httpx.post(f"{url}/v1/completions", timeout=30,
                     json={"model": MODEL, "prompt": "x", "guided_json": {"type": "nonsense"}})
    assert bad.status_code == 400 and "structured output" in bad.json()["error"]["message"], bad.text
    both = httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]})
    assert both.status_code == 400 and "guided_choice" in both.json()["error"]["message"]
