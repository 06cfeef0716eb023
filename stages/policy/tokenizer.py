"""Tokenizer access over HF ``tokenizers`` (tokenizer.json), with the special ids and the chat
template an HF tokenizer folder declares.

Two ways in:

* :meth:`TextCodec.from_json` for the built-in tiny tokenizers, whose specials are literal tokens
  (``<bos>``, ``<eos>``, ``<pad>``) and which have no post-processor, so a prompt gets BOS
  prepended here.
* :meth:`TextCodec.from_folder` for a real model folder (Llama, Qwen, ...): bos / eos / pad come from
  ``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json`` (eos may be
  several ids; pad falls back to the first eos), the chat template from ``tokenizer_config.json``
  (or ``chat_template.jinja``). Prompt encoding then matches ``transformers``: with a template,
  ``apply_chat_template(messages, add_generation_prompt=True)`` (rendered text encoded without
  special tokens: the template writes BOS itself); without, ``tokenizer(text)`` (the
  tokenizer.json post-processor adds what the model expects).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from tokenizers import Tokenizer

from storage.files import file_stamp
from storage.model_folder import TOKENIZER_FILES, read_tokenizer_files

__all__ = ["Prompt", "TextCodec", "TokenizerFolderError", "codec_files_digest", "codec_files_stamp",
           "render_chat_template"]

Prompt = Union[str, Sequence[Mapping[str, str]]]
"""A user prompt's text, or chat messages ({"role", "content"}) ending in a user turn."""


def codec_files_stamp(path: str | Path) -> tuple:
    """:func:`~storage.files.file_stamp` of each of :data:`~storage.model_folder.TOKENIZER_FILES` in
    ``path``: equal stamps mean files not rewritten since, for a cache in front of
    :func:`codec_files_digest`."""
    return tuple(file_stamp(Path(path) / name) for name in TOKENIZER_FILES)


def codec_files_digest(path: str | Path) -> str:
    """A digest of the bytes of :data:`~storage.model_folder.TOKENIZER_FILES` in ``path`` (an absent
    file counts as absent): two folders with equal digests give the same :class:`TextCodec`."""
    h = hashlib.blake2b(digest_size=16)
    files = read_tokenizer_files(path)
    for name in TOKENIZER_FILES:
        data = files.get(name)
        h.update(name.encode() + (b"\0absent" if data is None else b"\0%d\0" % len(data) + data))
    return h.hexdigest()


class TokenizerFolderError(ValueError):
    """A tokenizer folder is missing a file or declares a token the vocabulary lacks."""


@dataclass(frozen=True)
class TextCodec:
    """Encode / decode text with an HF tokenizer and the special ids the runtime needs."""

    tokenizer: Tokenizer
    bos_id: Optional[int]
    """None for tokenizers without BOS (Qwen2)."""
    eos_ids: tuple[int, ...]
    """Every id that ends a completion; the first is the canonical EOS."""
    pad_id: int
    chat_template: Optional[str] = None
    """Jinja chat template applied by :meth:`encode_prompt` (unset: the prompt text is used as is)."""
    prepend_bos: bool = False
    """True for tokenizers without a post-processor: :meth:`encode_prompt` prepends ``bos_id``."""
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    system_prompt: Optional[str] = None
    """A system message put before every prompt (dataset.system_prompt): with a chat template, as
    its first message (unless a messages-list prompt brings its own); without, as text and a blank
    line before the prompt."""

    def __post_init__(self) -> None:
        if not self.eos_ids:
            raise TokenizerFolderError("a TextCodec needs at least one eos id")

    @classmethod
    def from_json(cls, text: str, bos: str = "<bos>", eos: str = "<eos>", pad: str = "<pad>") -> "TextCodec":
        """A built-in tokenizer whose specials are literal tokens; prompts get BOS prepended."""
        tok = Tokenizer.from_str(text)
        ids = [tok.token_to_id(t) for t in (bos, eos, pad)]
        if None in ids:
            raise ValueError(f"tokenizer lacks one of the special tokens {bos}, {eos}, {pad}")
        return cls(tok, ids[0], (ids[1],), ids[2], prepend_bos=True, bos_token=bos, eos_token=eos)

    @classmethod
    def from_policy_folder(cls, path: str | Path, use_chat_template: bool = True,
                           system_prompt: Optional[str] = None) -> "TextCodec":
        """A policy version's tokenizer: an HF folder (:meth:`from_folder`) when it carries
        tokenizer_config.json or generation_config.json, else the built-in tiny tokenizer's lone
        tokenizer.json with its literal special tokens (:meth:`from_json`); with ``system_prompt``."""
        folder = Path(path)
        files = read_tokenizer_files(folder)
        if "tokenizer_config.json" in files or "generation_config.json" in files:
            return dataclasses.replace(cls._from_hf_files(folder, files, use_chat_template), system_prompt=system_prompt)
        if "tokenizer.json" not in files:
            raise TokenizerFolderError(f"{folder / 'tokenizer.json'}: not found; a policy folder needs its tokenizer.json")
        return dataclasses.replace(cls.from_json(files["tokenizer.json"].decode()), system_prompt=system_prompt)

    @classmethod
    def from_folder(cls, path: str | Path, use_chat_template: bool = True) -> "TextCodec":
        """An HF tokenizer folder: tokenizer.json plus the optional config files named above."""
        return cls._from_hf_files(Path(path), read_tokenizer_files(path), use_chat_template)

    @classmethod
    def _from_hf_files(cls, folder: Path, files: Mapping[str, bytes], use_chat_template: bool) -> "TextCodec":
        """The tokenizer of an HF folder from its files' bytes (storage/model_folder.py
        ``read_tokenizer_files``); ``folder`` names it in errors."""
        if "tokenizer.json" not in files:
            raise TokenizerFolderError(f"{folder / 'tokenizer.json'}: not found; a tokenizer folder needs tokenizer.json "
                                       "(the fast-tokenizer file)")
        tok = Tokenizer.from_str(files["tokenizer.json"].decode())
        config = {**_parse_json(folder, files, "special_tokens_map.json"),
                  **_parse_json(folder, files, "tokenizer_config.json")}
        generation = _parse_json(folder, files, "generation_config.json")

        def token_id(key: str) -> tuple[Optional[str], Optional[int]]:
            name = _token_name(config.get(key))
            if name is None:
                return None, None
            tid = tok.token_to_id(name)
            if tid is None:
                raise TokenizerFolderError(f"{folder}: {key}={name!r} is not in tokenizer.json's vocabulary")
            return name, tid

        bos_token, bos_id = token_id("bos_token")
        eos_token, eos_id = token_id("eos_token")
        _, pad_id = token_id("pad_token")
        eos_ids = [] if eos_id is None else [eos_id]
        extra = generation.get("eos_token_id")
        for tid in extra if isinstance(extra, list) else [] if extra is None else [extra]:
            if int(tid) not in eos_ids:
                eos_ids.append(int(tid))
        if bos_id is None and generation.get("bos_token_id") is not None:
            bos_id = int(generation["bos_token_id"])
        if not eos_ids:
            raise TokenizerFolderError(f"{folder}: no eos token: set eos_token in tokenizer_config.json or "
                                       "eos_token_id in generation_config.json")
        template = config.get("chat_template")
        if template is None and "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tok, bos_id, tuple(eos_ids), eos_ids[0] if pad_id is None else pad_id,
                   chat_template=template if use_chat_template else None, prepend_bos=False,
                   bos_token=bos_token, eos_token=eos_token)

    @property
    def eos_id(self) -> int:
        """The canonical EOS (the first of ``eos_ids``)."""
        return self.eos_ids[0]

    def encode(self, text: str) -> list[int]:
        """Ids of plain text, no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages of a prompt (a user text, or a messages list ending in a user turn),
        the system prompt first unless the list has a system message of its own."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render_prompt(self, prompt: Prompt) -> str:
        """The text the model sees for a prompt: the chat template rendered, or (no template) the
        text itself after the system prompt; a messages list needs a template."""
        if self.chat_template is None:
            if not isinstance(prompt, str):
                raise ValueError("a messages-list prompt needs a chat template: the tokenizer has none, or "
                                 "dataset.chat_template is false")
            return prompt if self.system_prompt is None else f"{self.system_prompt}\n\n{prompt}"
        return render_chat_template(self.chat_template, self.messages(prompt),
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Ids of a prompt (user text or messages list) as the policy receives it (template and BOS included)."""
        text = self.render_prompt(prompt)
        if self.chat_template is not None:
            return self.encode(text)
        if self.prepend_bos:
            return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode_prompt(self, ids: list[int]) -> str:
        """The user text of prompt ids :meth:`encode_prompt` made: the chat template's text around it
        (a system prompt, role markers) cut off when the ids render it; else :meth:`decode`."""
        marker = "\x00"
        if self.chat_template is not None or self.system_prompt is not None:
            head, _, tail = self.render_prompt(marker).partition(marker)
            text = (self.tokenizer.decode(list(ids), skip_special_tokens=False) if self.chat_template
                    else self.decode(ids))
            if text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
                return text[len(head):len(text) - len(tail)]
        return self.decode(ids)

    def decode(self, ids: list[int]) -> str:
        specials = {self.pad_id, self.bos_id, *self.eos_ids}
        return self.tokenizer.decode([i for i in ids if i not in specials], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def render_chat_template(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    """Render a chat template the way ``transformers`` does: a sandboxed jinja2 environment with
    ``trim_blocks`` / ``lstrip_blocks``, ``add_generation_prompt=True``, ``raise_exception`` and
    ``tojson`` available. ``strftime_now`` is left out on purpose: a template that dates its system
    prompt would make a step's prompts depend on the wall clock (Llama-3.1's then uses its fixed
    default date)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **variables)


def _parse_json(folder: Path, files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        return json.loads(files[name])
    except json.JSONDecodeError as exc:
        raise TokenizerFolderError(f"{folder / name}: not valid JSON ({exc})") from exc


def _token_name(value: Any) -> Optional[str]:
    """A special token as the config files write it: a string or an AddedToken dict ("content")."""
    if isinstance(value, dict):
        return value.get("content")
    return value
