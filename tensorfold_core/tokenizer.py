"""A checkpoint's tokenizer: tokenizers.Tokenizer, its chat template (jinja2), bos/eos, incremental detokenizing."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from .errors import CheckpointError
from .files import read_json_if_present

# a normalizer may shrink text before it is split (stripping accents turns the 2 bytes of "é" into 1): a margin
NORMALIZED_SLACK = 4


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """Encode, decode and chat-format text the way the checkpoint's own files say."""

    def __init__(self, backend: HFTokenizer, *, bos_id: int | None, eos_ids: set[int],
                 add_bos: bool, chat_template: str | None, special_texts: dict[str, str]):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_texts = special_texts
        self._template = None

    @classmethod
    def from_dir(cls, path: Path | str) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise CheckpointError(f"{tok_file}: missing (tensorfold reads tokenizer.json through `tokenizers`)")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exception on malformed files
            raise CheckpointError(f"{tok_file}: cannot be read ({exc})") from exc
        tok_config = read_json_if_present(path / "tokenizer_config.json")
        config = read_json_if_present(path / "config.json")
        gen_config = read_json_if_present(path / "generation_config.json")
        texts = {key: _token_text(tok_config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}
        texts = {k: v for k, v in texts.items() if v}

        def token_id(text):
            return backend.token_to_id(text) if text else None

        bos_id = token_id(texts.get("bos_token"))
        if bos_id is None:
            bos_id = next(iter(_ids(gen_config.get("bos_token_id")) or _ids(config.get("bos_token_id"))), None)
        eos_ids = set(_ids(gen_config.get("eos_token_id"))) | set(_ids(config.get("eos_token_id")))
        if token_id(texts.get("eos_token")) is not None:
            eos_ids.add(token_id(texts["eos_token"]))
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=bool(tok_config.get("add_bos_token", False)),
                   chat_template=template, special_texts=texts)

    def _encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it): a long text must not stall other threads
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def _entry_bytes(self) -> int:
        """Most UTF-8 bytes one vocabulary entry spells: no token stands for more bytes of text than its entry."""
        longest = max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return longest * (NORMALIZED_SLACK if self.backend.normalizer is not None else 1)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, known without encoding it."""
        return -(-len(text.encode("utf-8")) // self._entry_bytes)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode(text)
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise CheckpointError("this checkpoint has no chat template (tokenizer_config.json chat_template); "
                                  "use /v1/completions")
        if self._template is None:
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                                     extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = _tojson  # tool schemas render as transformers renders them, not HTML-escaped
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.special_texts.get("bos_token", ""),
                                     eos_token=self.special_texts.get("eos_token", ""), **extra)

    def encode_chat(self, messages: list[dict], **extra) -> list[int]:
        return self._encode(self.apply_chat_template(messages, **extra))

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)

    def fingerprint(self) -> dict:
        """What must match between a target and its drafter: vocab, merges, added tokens, bos, eos."""
        model = json.loads(self.backend.to_str())
        return {"model": model.get("model"), "added_tokens": model.get("added_tokens"),
                "bos": self.bos_id, "eos": sorted(self.eos_ids)}


# ---- drafter admission: the first difference between two tokenizers, in words ----

def _entry(value) -> str:
    return "no token" if value is None else repr(value)


def _vocab_difference(target, drafter) -> str | None:
    def by_id(vocab):  # BPE/WordPiece: {token: id}; Unigram: [[piece, score], ...]
        if isinstance(vocab, dict):
            return {i: t for t, i in vocab.items()}
        return dict(enumerate(vocab or []))

    a, b = by_id(target), by_id(drafter)
    for i in sorted(set(a) | set(b)):
        if a.get(i) != b.get(i):
            return f"token id {i}: target {_entry(a.get(i))} vs drafter {_entry(b.get(i))}"
    return None


def _merge_difference(target, drafter) -> str | None:
    show = lambda m: repr(" ".join(m) if isinstance(m, list) else m)
    a, b = target or [], drafter or []
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            left = show(a[i]) if i < len(a) else f"none ({len(a)} merges)"
            right = show(b[i]) if i < len(b) else f"none ({len(b)} merges)"
            return f"merges differ at merge {i}: target {left} vs drafter {right}"
    return None


def _added_difference(target, drafter) -> str | None:
    a, b = ({t.get("id"): t for t in tokens or []} for tokens in (target, drafter))
    for i in sorted(set(a) | set(b), key=lambda i: (i is None, i)):
        left, right = a.get(i), b.get(i)
        if left == right:
            continue
        if left is None or right is None or left.get("content") != right.get("content"):
            text = lambda t: _entry(t and t.get("content"))
            return f"added token id {i}: target {text(left)} vs drafter {text(right)}"
        key = next(k for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k))
        return f"added token id {i} ({left.get('content')!r}): {key} {left.get(key)!r} vs {right.get(key)!r}"
    return None


def tokenizer_difference(target: dict, drafter: dict) -> str | None:
    """The first difference of two `Tokenizer.fingerprint()`s, in words; None when they match."""
    tm, dm = target.get("model") or {}, drafter.get("model") or {}
    if tm.get("type") != dm.get("type"):
        return f"tokenizer models differ: target {tm.get('type')} vs drafter {dm.get('type')}"
    why = _vocab_difference(tm.get("vocab"), dm.get("vocab")) or _merge_difference(tm.get("merges"), dm.get("merges"))
    if why:
        return why
    for key in sorted((set(tm) | set(dm)) - {"vocab", "merges"}):
        if tm.get(key) != dm.get(key):
            return f"tokenizer model field {key!r} differs: target {tm.get(key)!r} vs drafter {dm.get(key)!r}"
    why = _added_difference(target.get("added_tokens"), drafter.get("added_tokens"))
    if why:
        return why
    if target.get("bos") != drafter.get("bos"):
        return f"bos ids differ: {target.get('bos')} vs {drafter.get('bos')}"
    if target.get("eos") != drafter.get("eos"):
        return f"eos ids differ: {target.get('eos')} vs {drafter.get('eos')}"
    return None


def _raise_template_error(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` for chat templates: plain json.dumps with its options (jinja's escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are settled text
        self.read_offset = 0  # text of ids[prefix_offset:read_offset] has been emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self.tokenizer.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
