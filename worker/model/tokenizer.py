"""Tokenizer: tokenizer.json (Hugging Face `tokenizers`) plus tokenizer_config.json's special tokens
and chat template, and an incremental detokenizer for streaming."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(model_dir)!r}")
        self._tok = HFTokenizer.from_file(str(path))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_content(tok_config.get("bos_token"))
        self.eos_token = _token_content(tok_config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.add_bos_token = bool(tok_config.get("add_bos_token", False))
        self.chat_template = _chat_template(model_dir, tok_config)
        self.eos_token_ids = _eos_token_ids(self, model_dir)
        self._template: Any = None  # the chat template, compiled at first use

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers` object (for libraries that read the vocabulary, e.g. grammars)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer.json's post-processor usually adds BOS itself; add it only where it did not
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) to the prompt text; encode it with add_special_tokens=False."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if self._template is None:  # compiled once (a render may run on any of the server's threads)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to, without encoding it (0 where this tokenizer's
        normalizer, pre-tokenizer or model may drop or fuse an unbounded run of characters)."""
        bound = self._length_bound
        if bound is None:
            return 0
        data = "".join(text.split()) if bound.whitespace_may_vanish else text
        return -(-len(data.encode("utf-8", "surrogatepass")) // (bound.max_token_bytes * bound.shrink))

    @functools.cached_property
    def _length_bound(self) -> LengthBound | None:
        return length_bound(json.loads(self._tok.to_str()),
                            (self._tok.id_to_token(i) or "" for i in range(self._tok.get_vocab_size())))


@dataclass(frozen=True)
class LengthBound:
    """How few tokens a text can encode to: at least (its UTF-8 bytes / shrink) / max_token_bytes."""
    max_token_bytes: int  # the longest token's string, in UTF-8 bytes (byte-level and SentencePiece token strings
    # spell a byte or a space with a 2- or 3-byte character: an overestimate, which keeps the bound a lower one)
    shrink: int = 1  # a Unicode normalizer may shorten text this many times (NFKC: a 4-byte letter to 1 byte)
    whitespace_may_vanish: bool = False  # an added token strips the whitespace around it: count none


SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Prepend"}
SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def length_bound(doc: dict[str, Any], tokens: Any) -> LengthBound | None:
    """The bound for tokenizer.json `doc` and its vocabulary's token strings; None where no safe one is known:
    a normalizer or pre-tokenizer that may drop characters (Strip, BertNormalizer, Whitespace, a regex Replace,
    a Split that removes its matches), or a model that fuses unknown characters into one token."""
    def parts(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
        if node is None:
            return []
        return [p for n in node[key] for p in parts(n, key)] if node.get("type") == "Sequence" else [node]

    shrink = 1
    for n in parts(doc.get("normalizer"), "normalizers"):
        kind = n.get("type")
        if kind == "Replace" and "String" in (n.get("pattern") or {}) and \
                len(n.get("content", "").encode()) >= len(n["pattern"]["String"].encode()):
            continue  # e.g. SentencePiece's " " -> "\u2581": never shorter
        if kind not in SAFE_NORMALIZERS:
            return None
        if kind.startswith("NF"):
            shrink = 4
    for n in parts(doc.get("pre_tokenizer"), "pretokenizers"):
        if n.get("type") not in SAFE_PRE_TOKENIZERS or n.get("behavior") == "Removed":
            return None
    model = doc.get("model") or {}
    if model.get("type") == "BPE":
        if model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
    elif not (model.get("type") == "Unigram" and model.get("byte_fallback")):
        return None  # WordPiece, WordLevel: a whole unknown word is one token
    added = doc.get("added_tokens") or []
    longest = max([len(t.encode()) for t in tokens] + [len(t["content"].encode()) for t in added] + [1])
    return LengthBound(longest, shrink, any(t.get("lstrip") or t.get("rstrip") for t in added))


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # transformers >= 4.50 may write it separately
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _eos_token_ids(tok: Tokenizer, model_dir: Path) -> frozenset[int]:
    ids: set[int] = set()
    eos_id = tok.token_to_id(tok.eos_token)
    if eos_id is not None:
        ids.add(eos_id)
    for name in ("config.json", "generation_config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a short window of recent tokens, twice: up to the last emitted token and up to the
    new one; the difference is the delta. A delta that ends in U+FFFD is an incomplete UTF-8
    sequence (a multi-byte character split across tokens) and is held back until it completes.
    The window (the last emitted token, or the prompt's tail) also keeps the leading-space handling
    of SentencePiece-style decoders right.
    """

    _CONTEXT_TOKENS = 5  # prompt tokens kept as the initial context window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT_TOKENS :]) if prompt_ids else []
        self._prefix_offset = 0  # start of the context window in _ids
        self._read_offset = len(self._ids)  # _ids[:_read_offset] are already emitted
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes (maybe "")."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip_special)
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
