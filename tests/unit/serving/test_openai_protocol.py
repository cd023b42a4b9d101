"""Request-field mapping of the OpenAI API (pure): unsupported fields are a 400 naming them, the structured-
output fields map to one constraint, logprobs / echo / n reach SamplingParams, and the router's prefill hop
asks for one choice without logprobs."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from disagg.worker.engine.parent_request import ParentRequests
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.router.hop_bodies import needs_prompt_logits, prefill_body
from disagg.worker.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_message

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field, value", [("suffix", "x"), ("best_of", 2), ("functions", []),
                                          ("guided_decoding_backend", "outlines")])
def test_unknown_fields_are_rejected_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    message, param = validation_message(e.value)
    assert param == field and "not supported" in message


def test_fields_reach_sampling_params():
    req = CompletionRequest.model_validate({
        "prompt": "x", "n": 3, "logprobs": 2, "echo": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "logit_bias": {"7": 3}, "min_p": 0.1, "seed": 4, "stop_token_ids": [2],
        "include_stop_str_in_output": True, "skip_special_tokens": False, "user": "u", "min_tokens": 1})
    sp = req.sampling_params(5, 100)
    assert (sp.n, sp.logprobs, sp.prompt_logprobs, sp.logit_bias, sp.min_p) == (3, 2, 2, {7: 3.0}, 0.1)
    assert sp.include_stop_str_in_output and not sp.skip_special_tokens and sp.has_penalties
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 4,
                                                 "max_completion_tokens": 7})
    sp = chat.sampling_params(5, 100)
    assert (sp.logprobs, sp.max_tokens, sp.prompt_logprobs) == (4, 7, None)
    assert ChatCompletionRequest.model_validate(CHAT).sampling_params(5, 100).logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
def test_bad_values_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        ChatCompletionRequest.model_validate({**CHAT, **body}).sampling_params(5, 100)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("body, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "object"}}, "json"),
    ({"guided_regex": "[a-z]+"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json"),
])
def test_structured_output_fields_map_to_one_constraint(body, kind):
    spec = ChatCompletionRequest.model_validate({**CHAT, **body}).sampling_params(5, 100).structured_output
    assert (spec.kind() if spec else None) == kind


def test_prefill_hop_asks_one_choice_without_logprobs_and_prompt_logprobs_skip_it():
    body = {"prompt": "x", "n": 4, "logprobs": 2, "echo": True, "stream": True, "min_tokens": 3,
            "guided_regex": "a+"}
    p = prefill_body(body)
    assert p["n"] == 1 and p["max_tokens"] == 1 and "logprobs" not in p
    assert p["min_tokens"] == 1  # its token may be the client's first: no EOS there when min_tokens forbids it
    assert "min_tokens" not in prefill_body({"prompt": "x", "min_tokens": 0})
    assert p["guided_regex"] == "a+"  # the prefill samples its token under the grammar too
    assert needs_prompt_logits(body) and needs_prompt_logits({"prompt_logprobs": 0})
    assert not needs_prompt_logits({"logprobs": 2}) and not needs_prompt_logits({"echo": True})


def test_parent_request_fans_out_and_in():
    parents = ParentRequests()
    parent = parents.add("r", 2)
    sp = SamplingParams(seed=10, n=2, prompt_logprobs=1)
    assert [parent.child_params(sp, i).seed for i in range(2)] == [10, 11]
    assert parent.child_params(sp, 1).prompt_logprobs is None and parent.child_params(sp, 0).n == 1
    assert parents.children_of("r") == ["r#c0", "r#c1"]
    assert parents.resolve("r#c1", finished=True) == ("r", 1, False)
    assert parents.resolve("r#c0", finished=False) == ("r", 0, False)
    assert parents.resolve("r#c0", finished=True) == ("r", 0, True)
    assert parents.resolve("other", finished=True) == ("other", 0, True)


def test_chat_messages_echoed_back_from_a_response_are_accepted_but_real_tool_calls_are_not():
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": [], "annotations": []}
    req = ChatCompletionRequest.model_validate({"messages": [echoed, {"role": "user", "content": "more"}]})
    assert req.messages[0].text() == "hi"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{**echoed, "tool_calls": [{"id": "x"}]}]})
    assert "tool_calls" in validation_message(e.value)[0]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert "messages.0.content" in validation_message(e.value)[0]
