"""The shape of a Llama / Qwen2 / Qwen3-family decoder, and how an HF config.json describes it.

One definition for the runtime (``stages.policy.model.DecoderConfig`` extends it with RoPE, norm and
token-id settings) and the planner (``planner.model.ModelShape`` extends it with a report label).
Parameter layout per decoder layer (HF ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer``)::

    q_proj [h, n_heads*d]   k_proj [h, n_kv*d]   v_proj [h, n_kv*d]   o_proj [n_heads*d, h]
    gate_proj, up_proj [h, F]   down_proj [F, h]   input_layernorm, post_attention_layernorm [h]

plus ``embed_tokens [V, h]``, the final ``norm [h]`` and ``lm_head [h, V]`` (absent when tied). Qwen3
adds ``q_norm, k_norm [d]`` per layer (RMSNorm over each head before RoPE).

RoPE settings change no size; :func:`hf_rope_theta` and :func:`hf_rope_scaling` read them for the
runtime (Llama 3.1 ``llama3`` frequency scaling is the one scaled RoPE it implements).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

__all__ = ["MODEL_TYPES", "ROPE_SCALING_TYPES", "ModelShape", "RopeScaling", "attention_bias_of", "shape_from_hf",
           "hf_rope_theta", "hf_rope_scaling", "check_full_attention"]

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("llama3",)
# Qwen3Config's head_dim default (transformers) when config.json omits it; the others derive h / heads.
_DEFAULT_HEAD_DIM = {"qwen3": 128}
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
    """Architecture family: llama, qwen2 or qwen3."""

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

    @property
    def qk_norm(self) -> bool:
        """Queries and keys pass an RMSNorm over head_dim (weights q_norm, k_norm [d]) before RoPE:
        Qwen3 always, and its config.json has no switch for it."""
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls: type[_Shape], hf: Mapping[str, Any], **extra: Any) -> _Shape:
        """The shape an HF config.json dict describes (``extra``: a subclass's own fields)."""
        return shape_from_hf(hf, cls, **extra)


def attention_bias_of(model_type: str, attention_bias: bool | None) -> bool:
    """Qwen2 always carries q/k/v biases (its config has no switch); Llama and Qwen3 only with attention_bias."""
    return model_type == "qwen2" or bool(attention_bias)


def shape_from_hf(hf: Mapping[str, Any], cls: type[_Shape] = ModelShape, **extra: Any) -> _Shape:  # type: ignore[assignment]
    """Build ``cls`` from a parsed HF config.json: ``head_dim`` defaults to hidden_size //
    num_attention_heads (128 for qwen3) and ``num_key_value_heads`` to num_attention_heads (as
    transformers does)."""
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
            head_dim=int(hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type, int(hf["hidden_size"]) // heads)),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None
    return cls(**fields, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
               attention_bias=attention_bias_of(model_type, hf.get("attention_bias")), model_type=model_type,
               **extra)


def check_full_attention(hf: Mapping[str, Any]) -> None:
    """Qwen2 / Qwen3 configs can switch some layers to sliding-window attention; the runtime attends
    over the whole causal context, so it rejects such a model rather than compute something else (the
    planner need not: the window changes no size)."""
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise ValueError("config.json use_sliding_window / layer_types asks for sliding-window attention, which is "
                         "not supported; use a model with full attention in every layer")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (``rope_type: llama3``), in HF config.json names.

    With wavelength w_i = 2 pi / f_i of each rotary frequency f_i, and L = original_max_position_embeddings:
    w_i < L / high_freq_factor keeps f_i; w_i > L / low_freq_factor gives f_i / factor; in between
    f_i ((1 - s) / factor + s) with s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)
    (Llama 3 Herd of Models, Dubey et al. 2024, and Meta's reference ``apply_scaling``).
    """

    factor: float
    """Divisor of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float
    """L / low_freq_factor is the wavelength above which frequencies are fully scaled (1 in Llama 3.1)."""
    high_freq_factor: float
    """L / high_freq_factor is the wavelength below which frequencies are kept (4 in Llama 3.1)."""
    original_max_position_embeddings: int
    """L: context length of pretraining before the extension (8192 in Llama 3.1)."""

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling.low_freq_factor={self.low_freq_factor} must be > 0 and below "
                             f"rope_scaling.high_freq_factor={self.high_freq_factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} "
                             f"must be >= 1")

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict of a config.json (the key transformers 4 and 5 both read)."""
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def _rope_settings(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers-5 ``rope_parameters``, the scaling dict or {}) of a config.json."""
    # transformers >= 5 nests RoPE settings under rope_parameters; older files use rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    if not scaling and _rope_type(rope) != "default":
        scaling = rope
    return rope, scaling


def _rope_type(d: Mapping[str, Any]) -> str:
    # Files before transformers 4.43 name the type "type".
    return str(d.get("rope_type") or d.get("type") or "default")


def hf_rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base of a config.json (top level, or under transformers-5 ``rope_parameters``)."""
    rope, _ = _rope_settings(hf)
    return float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))


def hf_rope_scaling(hf: Mapping[str, Any]) -> Optional[RopeScaling]:
    """The RoPE scaling of a config.json: None for plain RoPE, :class:`RopeScaling` for ``llama3``;
    any other type (linear, dynamic, yarn, ...) or a partial rotary factor is rejected here, where the
    runtime reads it, rather than computed differently from transformers."""
    rope, scaling = _rope_settings(hf)
    partial = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial} is not supported; use a model that rotates "
                         f"the whole head (1.0)")
    kind = _rope_type(scaling)
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"config.json RoPE scaling type {kind!r} is not supported; supported: "
                         f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
    try:
        return RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position_embeddings=int(scaling.get("original_max_position_embeddings")
                                                                or hf["max_position_embeddings"]))
    except KeyError as exc:
        raise ValueError(f"config.json llama3 RoPE scaling lacks required key {exc.args[0]!r}") from None
