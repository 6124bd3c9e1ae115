"""Text <-> token ids for one model: encoding, chat templates, and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (built from tokenizer.json or from GGUF metadata) with
the pieces serving needs around it: special token ids, stop ids, and the Jinja chat template
rendered the way HF templates expect. `IncrementalDetokenizer` turns a stream of generated ids
into text deltas without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# Decoding an incomplete UTF-8 sequence yields this replacement character.
REPLACEMENT_CHAR = "\ufffd"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes its output, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template that came with the model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: list[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Ids that also end a generation (e.g. <|eot_id|> besides <|end_of_text|>); excludes eos.
        self.stop_token_ids = [i for i in dict.fromkeys(stop_token_ids or []) if i != eos_token_id]
        self.chat_template = chat_template

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for the worker's tokenizing processes: the compiled template is rebuilt there.
        state = self.__dict__.copy()
        state.pop("_template", None)
        return state

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str:
        return "" if self.bos_token_id is None else self.hf.id_to_token(self.bos_token_id) or ""

    @property
    def eos_token(self) -> str:
        return "" if self.eos_token_id is None else self.hf.id_to_token(self.eos_token_id) or ""

    @property
    def all_stop_token_ids(self) -> list[int]:
        """eos plus the extra stop ids: what ends a generation unless ignore_eos is set."""
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        return eos + self.stop_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` applies the model's post-processor (e.g. BOS).

        Encode a rendered chat template with add_special_tokens=False: templates spell BOS
        themselves when the model wants it.
        """
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` to prompt text; extra kwargs (tools, ...) reach the template."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with chat template and special tokens from the config files."""
        path = Path(path)
        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def token_id(key: str) -> int | None:
            token = tok_cfg.get(key)
            if isinstance(token, dict):  # AddedToken serialized as {"content": ..., ...}
                token = token.get("content")
            return hf.token_to_id(token) if token else None

        bos_token_id = token_id("bos_token")
        if bos_token_id is None:
            bos_token_id = model_cfg.get("bos_token_id")
        # generation_config's eos is what HF generate stops on; it may list several ids.
        eos_ids = _as_id_list(gen_cfg.get("eos_token_id"))
        eos_token_id = token_id("eos_token")
        if eos_token_id is None:
            eos_token_id = next(iter(eos_ids or _as_id_list(model_cfg.get("eos_token_id"))), None)

        return cls(hf, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   stop_token_ids=eos_ids, chat_template=_read_chat_template(path, tok_cfg))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    # Newer checkpoints ship the template as its own file; older ones inline it, sometimes as a
    # list of named templates of which "default" is the chat one.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class IncrementalDetokenizer:
    """Streams the text of generated ids, one delta per `step`, vLLM-style.

    Decodes a short window `token_ids[prefix_offset:]` rather than the whole output each step,
    and compares it with the window's already-emitted part `[prefix_offset:read_offset]` so that
    tokenizers which render a token differently at the start of a string (SentencePiece spaces)
    still produce the right delta. While the window decodes to text ending in U+FFFD the last
    token(s) may be an unfinished UTF-8 character, so the delta is held back, but for at most
    `MAX_HELD_TOKENS`: a character is at most 4 bytes and a token at least one, so text held over
    4 tokens ends in bytes that are invalid, not unfinished (a model repeating a lone byte token
    would otherwise hold its whole answer until the end, and decode a growing window every step).

        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        for out in outputs:
            text += detok.step(out.new_token_ids)
    """

    # Prompt tokens kept as left context for the first generated tokens.
    PROMPT_CONTEXT = 5
    # Tokens that may be held back as a possibly unfinished character (see above).
    MAX_HELD_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list((prompt_token_ids or [])[-self.PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        # Bound once: called twice per generated token of every stream.
        self._decode_ids = tokenizer.decode

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty).

        The ids are taken one at a time, so what has been emitted after any prefix of the tokens
        is a function of that prefix alone, however the ids came in chunks: a worker that resumes
        a migrated answer from its token ids is at exactly the point the first worker reached.
        """
        if len(new_token_ids) == 1:  # the usual step
            return self._step_one(new_token_ids[0])
        return "".join([self._step_one(token_id) for token_id in new_token_ids])

    def _step_one(self, token_id: int) -> str:
        ids, start, read = self.token_ids, self.prefix_offset, self.read_offset
        ids.append(token_id)
        prefix_text = self._decode_ids(ids[start:read], skip_special_tokens=self.skip_special_tokens)
        new_text = self._decode_ids(ids[start:], skip_special_tokens=self.skip_special_tokens)
        unfinished = len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
        if unfinished and len(ids) - read < self.MAX_HELD_TOKENS:
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = read
        self.read_offset = len(ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At end of stream, return text still held back (it may hold U+FFFD for a cut-off char)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta
