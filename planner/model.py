"""Decoder shape (Llama / Qwen2 family) from an HF config.json, exact parameter counts, FLOPs per token.

Parameter layout per decoder layer (HF ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer``)::

    q_proj [h, n_heads*d]   k_proj [h, n_kv*d]   v_proj [h, n_kv*d]   o_proj [n_heads*d, h]
    gate_proj, up_proj [h, F]   down_proj [F, h]   input_layernorm, post_attention_layernorm [h]

plus ``embed_tokens [V, h]``, the final ``norm [h]`` and ``lm_head [h, V]`` (absent when tied).
Qwen2 adds biases to q/k/v (``attention_bias``); Llama has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.constants import BF16_BYTES, CAUSAL_ATTENTION_FLOP_FACTOR

__all__ = [
    "ModelShape",
    "MODEL_PRESETS",
    "model_from_hf_config",
    "model_from_preset",
    "estimate_parameter_count",
    "estimate_layer_parameter_count",
    "estimate_kv_bytes_per_token",
    "estimate_forward_flops_per_token",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Shape of a Llama/Qwen2-family decoder; every size the planner needs and nothing else."""

    name: str = "custom"
    """Label used in reports."""
    hidden_size: int
    """h: residual stream width."""
    num_layers: int
    """L: decoder layers (HF ``num_hidden_layers``)."""
    num_attention_heads: int
    """a: query heads."""
    num_key_value_heads: int
    """KV heads (GQA); equals ``num_attention_heads`` for plain multi-head attention."""
    intermediate_size: int
    """F: MLP inner width."""
    vocab_size: int
    """V: vocabulary (rows of the embedding and of lm_head)."""
    head_dim: int
    """d: per-head width; HF default hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (no separate parameters)."""
    attention_bias: bool = False
    """q/k/v projections carry biases (Qwen2)."""
    gated_mlp: bool = True
    """SwiGLU (gate, up, down). False means a GPT-style 2-matrix MLP, used only to check the paper formula."""

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "head_dim"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, n_heads * d."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the key/value projection outputs, n_kv * d."""
        return self.num_key_value_heads * self.head_dim


# HF config.json values of the published checkpoints (hidden, layers, heads, kv heads, FFN, vocab, tied, bias).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064,
                        tie_word_embeddings=False),
}


def model_from_hf_config(config: Mapping[str, Any], name: str = "custom") -> ModelShape:
    """Build a :class:`ModelShape` from a parsed HF ``config.json`` dict.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads`` to
    ``num_attention_heads`` (as in ``transformers.LlamaConfig``). Qwen2 configs have no ``attention_bias``
    key; their q/k/v projections always carry a bias, so ``model_type == "qwen2"`` implies it.
    """
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        shape = dict(
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
        )
    except KeyError as exc:
        raise ValueError(f"HF config for {name!r} lacks required key {exc.args[0]!r}") from exc
    is_qwen2 = str(config.get("model_type", "")).startswith("qwen2")
    bias = config.get("attention_bias")
    return ModelShape(
        name=name,
        head_dim=int(config.get("head_dim") or hidden // heads),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=is_qwen2 if bias is None else bool(bias),
        **shape,
    )


def model_from_preset(preset: str) -> ModelShape:
    """Shape of a named checkpoint in :data:`MODEL_PRESETS` (e.g. ``"llama3-70b"``)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(sorted(MODEL_PRESETS))}")
    return model_from_hf_config(MODEL_PRESETS[preset], name=preset)


def estimate_layer_parameter_count(model: ModelShape) -> int:
    """Parameters of one decoder layer: q/k/v/o (+ q/k/v biases), MLP matrices, two RMSNorm weights."""
    h = model.hidden_size
    attention = h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h
    if model.attention_bias:
        attention += model.q_dim + 2 * model.kv_dim
    mlp_matrices = 3 if model.gated_mlp else 2
    mlp = mlp_matrices * h * model.intermediate_size
    return attention + mlp + 2 * h


def estimate_parameter_count(model: ModelShape) -> int:
    """Exact parameter count: embedding + L layers + final norm + lm_head (unless tied).

    Llama-3-70B: 128256*8192 + 80*855,654,400 + 8192 + 128256*8192 = 70,553,706,496.
    """
    embedding = model.vocab_size * model.hidden_size
    lm_head = 0 if model.tie_word_embeddings else embedding
    return embedding + model.num_layers * estimate_layer_parameter_count(model) + model.hidden_size + lm_head


def estimate_kv_bytes_per_token(model: ModelShape, dtype_bytes: int = BF16_BYTES) -> int:
    """KV-cache bytes one token occupies across all layers: 2 (K and V) * L * n_kv * d * dtype_bytes.

    Llama-3-70B in bf16: 2 * 80 * 8 * 128 * 2 = 327,680 bytes (Kwon et al. 2023, PagedAttention, Sec. 2).
    """
    return 2 * model.num_layers * model.kv_dim * dtype_bytes


def estimate_forward_flops_per_token(model: ModelShape, context_len: int, *, include_lm_head: bool = True) -> float:
    """Forward FLOPs per token: 2 per matmul weight, plus causal attention over ``context_len`` tokens.

    Matmul part is 2N (Kaplan 2020; 6N for forward+backward, Hoffmann 2022 "Chinchilla"). The attention
    part is PaLM App. B's 12*L*h*s for forward+backward, i.e. 4*L*q_dim*s forward, halved for causal
    masking (FlashAttention-2 skips masked blocks). Embedding lookups cost no FLOPs.
    """
    matmul_params = model.num_layers * estimate_layer_parameter_count(model)
    if include_lm_head:
        matmul_params += model.vocab_size * model.hidden_size
    attention = 4 * model.num_layers * model.q_dim * context_len * CAUSAL_ATTENTION_FLOP_FACTOR
    return 2.0 * matmul_params + attention
