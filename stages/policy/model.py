"""A compact decoder of the Llama / Qwen2 / Qwen3 family, built from an HF config.json.

RMSNorm, rotary position embeddings (optionally with Llama 3.1 frequency scaling), grouped-query
attention, SwiGLU MLP, optional q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied or untied
embeddings. Parameter names match the HF checkpoints once
:func:`to_hf_name` is applied, so HF safetensors load directly.

The model is a :class:`DecoderStage` over a contiguous layer range: with the full range it is
the whole model, with part of it a pipeline stage. There is no mesh code here; stages/train
splits and wraps it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from stages.layout import ModelShape, hf_rope_theta, layer_ranges, shape_from_hf
from stages.layout.shape import RopeScaling, check_full_attention, hf_rope_scaling

__all__ = [
    "DecoderConfig",
    "DecoderStage",
    "AttentionCache",
    "build_stage",
    "document_mask",
    "document_positions",
    "layer_ranges",
    "rope_cos_sin",
    "rope_inv_freq",
    "to_hf_name",
    "from_hf_name",
]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(ModelShape):
    """A decoder the runtime builds: the shared :class:`stages.layout.ModelShape` plus the settings
    that change no size (RoPE base and scaling, norm epsilon, special token ids)."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    """Llama 3.1 frequency scaling of RoPE; None: plain RoPE."""
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **extra: Any) -> "DecoderConfig":
        """Shape by the shared parser (one bias rule), RoPE and token ids by the runtime."""
        check_full_attention(hf)
        return shape_from_hf(
            hf, cls, rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=hf_rope_theta(hf),
            rope_scaling=hf_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048), bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"), **extra)

    def to_hf(self) -> dict[str, Any]:
        """config.json of this decoder; transformers (4.43+ and 5) builds the same model from it."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        return out


class AttentionCache(Protocol):
    """Where keys and values go during generation (see stages/rollout/paged_kv.py)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, heads, T, d]; k, v: [B, kv_heads, T, d] (rotated) -> [B, heads, T, d]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Rotary frequencies f_i = theta^(-2i/d), i < d/2, fp32 [d/2]; with ``scaling``, Llama 3.1's
    wavelength-based rescaling (formula in :class:`stages.layout.shape.RopeScaling`; Dubey et al.
    2024, "The Llama 3 Herd of Models", and Meta's llama-models reference ``apply_scaling``)."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if scaling is None:
        return freq
    wavelen = 2 * math.pi / freq
    ctx = scaling.original_max_position_embeddings
    # High frequencies (short wavelengths) resolve positions within the original context: keep them.
    # Low frequencies would see angles never met in pretraining: stretch them by `factor`. The band
    # between interpolates linearly in ctx / wavelen, so the two regimes meet without a jump.
    smooth = (ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freq / scaling.factor + smooth * freq
    out = torch.where(wavelen > ctx / scaling.low_freq_factor, freq / scaling.factor, blended)
    return torch.where(wavelen < ctx / scaling.high_freq_factor, freq, out)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, d] of the rotary angles at ``positions`` [B, T] (inv_freq [d/2] fp32),
    halves repeated (HF convention); computed once per forward and shared by every layer."""
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, d/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate halves (HF convention). x: [B, h, T, d]; rope: :func:`rope_cos_sin`."""
    cos, sin = rope
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # HF Llama and Qwen3 put attention_bias on o_proj too; Qwen2 biases q/k/v only.
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                                bias=bias and cfg.model_type != "qwen2")
        # Qwen3: one RMSNorm over head_dim shared by all heads (under TP its gradient is summed over ranks,
        # stages/train/parallel.py head_local_parameters).
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: Optional[AttentionCache], attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, h, d)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, kvh, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, h, T, d), (B, kvh, T, d)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, rope), _rope(k, rope)
        if cache is not None:
            out = cache.attend(self.layer, q, k, v)
        else:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if attn_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache=None, attn_mask=None):
        """``rope``: the (cos, sin) of :func:`rope_cos_sin` at this row's positions."""
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask of packed rows: token t attends to s iff s <= t and
    doc_ids[s] == doc_ids[t]. doc_ids: [B, T] -> bool [B, 1, T, T] (True = attend).

    Padding carries a doc id of its own, so each of its tokens still attends to itself and the
    softmax of its (discarded) output never runs over an empty set: no NaN.
    """
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]  # (B, 1, T, T)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where a new document begins. doc_ids: [B, T] -> [B, T].

    position_t = t - start(t), start(t) = the last index s <= t with doc_ids[s] != doc_ids[s-1].
    """
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start


class DecoderStage(nn.Module):
    """Layers [first_layer, last_layer) of the decoder; with embeddings on the first stage and the
    final norm and LM head on the last.

    forward(input_ids [B, T] on the first stage, or hidden [B, T, H] elsewhere) returns hidden
    states [B, T, H], or logits [B, T, V] on the last stage (``return_hidden`` keeps the normed
    hidden states instead, for a loss that applies the head itself in chunks).

    Packed rows (several documents per row, stages/train/plan.py) pass ``doc_ids`` [B, T]: attention
    is then causal within each document only (:func:`document_mask`), and ``positions`` default to
    positions restarting at every document (:func:`document_positions`), so a packed document sees
    exactly what it would see alone in a row of its own.
    """

    def __init__(self, cfg: DecoderConfig, first_layer: int, last_layer: int,
                 is_first: bool, is_last: bool, return_hidden: bool = False):
        super().__init__()
        self.cfg = cfg
        self.first_layer, self.last_layer = first_layer, last_layer
        self.is_first, self.is_last = is_first, is_last
        self.return_hidden = return_hidden
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if is_first else None
        # ModuleDict keyed by the global layer index keeps HF parameter names on every stage.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(first_layer, last_layer)})
        if is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        else:
            self.norm, self.lm_head = None, None

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[AttentionCache] = None,
                attn_mask: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed rows) is a training input; generation with a KV "
                                 "cache takes positions and no doc_ids")
            mask = document_mask(doc_ids)  # (B, 1, T, T), built once for every layer
            attn_mask = mask if attn_mask is None else attn_mask & mask
            if positions is None:
                positions = document_positions(doc_ids)
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        if positions is None:
            B, T = x.shape[:2]
            positions = torch.arange(T, device=x.device).expand(B, T)
        rope = rope_cos_sin(positions, rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling,
                                                     x.device), x.dtype)
        for layer in self.layers.values():
            x = layer(x, rope, cache, attn_mask)
        if self.is_last:
            x = self.norm(x)
            if not self.return_hidden:
                x = self.lm_head(x)
        return x

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):  # layer norms, q/k norms, the final norm
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * std)


def build_stage(cfg: DecoderConfig, stage: int = 0, num_stages: int = 1,
                return_hidden: bool = False, layer_split: Optional[Sequence[int]] = None) -> DecoderStage:
    """Stage ``stage`` of a ``num_stages``-stage pipeline: its layers by ``layer_split`` (layers per
    stage; None: the even split, stages/layout ``layer_ranges``), the embedding on the first, the
    final norm and lm_head on the last."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} does not exist in a {num_stages}-stage pipeline")
    first, last = layer_ranges(cfg.num_hidden_layers, num_stages, layer_split)[stage]
    return DecoderStage(cfg, first, last, is_first=stage == 0, is_last=stage == num_stages - 1,
                        return_hidden=return_hidden)


def to_hf_name(local: str) -> str:
    """Stage parameter name -> HF checkpoint name."""
    return local if local.startswith("lm_head.") else f"model.{local}"


def from_hf_name(hf: str) -> str:
    return hf[len("model."):] if hf.startswith("model.") else hf
