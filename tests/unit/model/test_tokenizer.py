import json
from pathlib import Path

import pytest

from disagg.worker.model import IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello, world!", "The robot counted the boats.", "Café naïve 日本語 🙂🚀 done", "  spaces\n\tand tabs  "]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return Path(tiny_model_dir)  # the session's default checkpoint, only read here


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_including_non_ascii(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_matches_full_decode_and_never_emits_half_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Prompt:"))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_multi_byte_character_split_across_tokens_is_held_back(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # four UTF-8 bytes, not a single vocabulary entry
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]
    assert detok.finish() == ""


def test_finish_releases_an_incomplete_character(tok):
    ids = tok.encode("a🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids[:-1]]
    assert "".join(deltas) == "a"
    assert detok.finish() == "\ufffd" and detok.text == "a\ufffd"


def test_special_tokens_are_skipped_in_streams(tok):
    detok = IncrementalDetokenizer(tok)
    eos = tok.token_to_id("</s>")
    assert "".join(detok.add(i) for i in tok.encode("Yes", add_special_tokens=False) + [eos]) == "Yes"


def test_eos_ids_are_the_union_of_tokenizer_and_model_config(tok):
    assert tok.eos_token_ids == {tok.token_to_id("</s>"), tok.token_to_id("<|end|>")}


def test_chat_template_renders_generation_prompt(tok):
    assert tok.chat_template is not None
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == "<s><|user|>\nHi there<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and tok.token_to_id("<|assistant|>") in ids


def test_without_tokenizer_config_there_is_no_template_and_no_extra_bos(tmp_path, tiny_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer(tmp_path)
    assert tok.chat_template is None and tok.eos_token_ids == frozenset()
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins(tmp_path, tiny_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "a!"


def test_added_token_dicts_in_tokenizer_config(tmp_path, tiny_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    assert Tokenizer(tmp_path).eos_token_ids == {Tokenizer(tiny_dir).token_to_id("<|end|>")}


def test_missing_tokenizer_json_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"tokenizer.json.*{tmp_path}"):
        Tokenizer(tmp_path)
