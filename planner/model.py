"""Decoder shape for the planner (the shared :class:`stages.layout.ModelShape` plus a report label),
published presets, exact parameter counts and FLOPs per token.

The shape and its HF config.json parsing live in :mod:`stages.layout.shape` (the runtime's
``DecoderConfig`` extends the same class), so planner and runtime read a config.json the same way:
qwen2 always has q/k/v biases, llama when ``attention_bias`` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.constants import BF16_BYTES, CAUSAL_ATTENTION_FLOP_FACTOR
from stages.layout import ModelShape as _SharedShape
from stages.layout import shape_from_hf

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


@dataclass(frozen=True, kw_only=True)
class ModelShape(_SharedShape):
    """The shared decoder shape plus what only the planner needs."""

    name: str = "custom"
    """Label used in reports."""
    gated_mlp: bool = True
    """SwiGLU (gate, up, down). False means a GPT-style 2-matrix MLP, used only to check the paper formula."""


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
    """Build a :class:`ModelShape` from a parsed HF ``config.json`` dict (:func:`stages.layout.shape_from_hf`).

    RoPE scaling changes no size, so it is accepted here; the runtime's decoder rejects it.
    """
    return shape_from_hf(config, ModelShape, name=name)


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
    return embedding + model.num_hidden_layers * estimate_layer_parameter_count(model) + model.hidden_size + lm_head


def estimate_kv_bytes_per_token(model: ModelShape, dtype_bytes: int = BF16_BYTES) -> int:
    """KV-cache bytes one token occupies across all layers: 2 (K and V) * L * n_kv * d * dtype_bytes.

    Llama-3-70B in bf16: 2 * 80 * 8 * 128 * 2 = 327,680 bytes (Kwon et al. 2023, PagedAttention, Sec. 2).
    """
    return 2 * model.num_hidden_layers * model.kv_dim * dtype_bytes


def estimate_forward_flops_per_token(model: ModelShape, context_len: int, *, include_lm_head: bool = True) -> float:
    """Forward FLOPs per token: 2 per matmul weight, plus causal attention over ``context_len`` tokens.

    Matmul part is 2N (Kaplan 2020; 6N for forward+backward, Hoffmann 2022 "Chinchilla"). The attention
    part is PaLM App. B's 12*L*h*s for forward+backward, i.e. 4*L*q_dim*s forward, halved for causal
    masking (FlashAttention-2 skips masked blocks). Embedding lookups cost no FLOPs.
    """
    matmul_params = model.num_hidden_layers * estimate_layer_parameter_count(model)
    if include_lm_head:
        matmul_params += model.vocab_size * model.hidden_size
    attention = 4 * model.num_hidden_layers * model.q_dim * context_len * CAUSAL_ATTENTION_FLOP_FACTOR
    return 2.0 * matmul_params + attention
