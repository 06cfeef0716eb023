"""The shape of a Llama / Qwen2-family decoder, and how an HF config.json describes it.

One definition for the runtime (``stages.policy.model.DecoderConfig`` extends it with RoPE, norm and
token-id settings) and the planner (``planner.model.ModelShape`` extends it with a report label).
Parameter layout per decoder layer (HF ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer``)::

    q_proj [h, n_heads*d]   k_proj [h, n_kv*d]   v_proj [h, n_kv*d]   o_proj [n_heads*d, h]
    gate_proj, up_proj [h, F]   down_proj [F, h]   input_layernorm, post_attention_layernorm [h]

plus ``embed_tokens [V, h]``, the final ``norm [h]`` and ``lm_head [h, V]`` (absent when tied).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MODEL_TYPES", "ModelShape", "attention_bias_of", "shape_from_hf", "hf_rope_theta"]

MODEL_TYPES = ("llama", "qwen2")
_Shape = TypeVar("_Shape", bound="ModelShape")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes that fix a decoder's parameters, in HF config.json names."""

    vocab_size: int
    """V: rows of the embedding and of lm_head."""
    hidden_size: int
    """h: residual stream width."""
    intermediate_size: int
    """F: SwiGLU inner width."""
    num_hidden_layers: int
    """L: decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (GQA); equal to num_attention_heads for plain multi-head attention."""
    head_dim: int
    """d: per-head width; HF default hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry biases (always for qwen2; see :func:`attention_bias_of`)."""
    model_type: str = "llama"
    """Architecture family: llama or qwen2."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model.model_type={self.model_type!r} is not supported: use one of "
                             f"{', '.join(MODEL_TYPES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"model.num_key_value_heads={self.num_key_value_heads}")

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, n_heads * d."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the key / value projection outputs, n_kv * d."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls: type[_Shape], hf: Mapping[str, Any], **extra: Any) -> _Shape:
        """The shape an HF config.json dict describes (``extra``: a subclass's own fields)."""
        return shape_from_hf(hf, cls, **extra)


def attention_bias_of(model_type: str, attention_bias: bool | None) -> bool:
    """Qwen2 always carries q/k/v biases (its config has no switch); Llama only with attention_bias."""
    return model_type == "qwen2" or bool(attention_bias)


def shape_from_hf(hf: Mapping[str, Any], cls: type[_Shape] = ModelShape, **extra: Any) -> _Shape:  # type: ignore[assignment]
    """Build ``cls`` from a parsed HF config.json: ``head_dim`` defaults to hidden_size //
    num_attention_heads and ``num_key_value_heads`` to num_attention_heads (as transformers does)."""
    model_type = str(hf.get("model_type") or "llama")
    try:
        heads = int(hf["num_attention_heads"])
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None
    return cls(**fields, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
               attention_bias=attention_bias_of(model_type, hf.get("attention_bias")), model_type=model_type,
               **extra)


def hf_rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base of a config.json. Scaled RoPE (llama3, yarn, linear, ...) changes no size but is not
    implemented by the runtime's decoder, so it is rejected here, where the runtime reads it."""
    # transformers >= 5 nests RoPE settings under rope_parameters; older files use the top level.
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"config.json RoPE scaling {scaling!r} is not supported; use a model without it")
    return float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
