"""Tokenizer access over HF ``tokenizers`` (tokenizer.json)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

__all__ = ["TextCodec"]


@dataclass(frozen=True)
class TextCodec:
    """Encode / decode text with an HF tokenizer and the special ids the runtime needs."""

    tokenizer: Tokenizer
    bos_id: int
    eos_id: int
    pad_id: int

    @classmethod
    def from_json(cls, text: str, bos: str = "<bos>", eos: str = "<eos>", pad: str = "<pad>") -> "TextCodec":
        tok = Tokenizer.from_str(text)
        ids = [tok.token_to_id(t) for t in (bos, eos, pad)]
        if None in ids:
            raise ValueError(f"tokenizer lacks one of the special tokens {bos}, {eos}, {pad}")
        return cls(tok, *ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in (self.pad_id, self.eos_id, self.bos_id)],
                                     skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
