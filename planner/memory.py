"""Device memory: parameters per pipeline stage, activation stash, logits buffers, KV cache.

Activation bytes follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (Sec. 4.1): a GPT layer keeps 34*s*b*h + 5*a*s^2*b bytes for backward in 16-bit precision.
Here the same accounting is itemised tensor by tensor so it also covers GQA, SwiGLU, FlashAttention,
no dropout and sequence parallelism; with a GPT shape (MHA, 4h GeLU MLP, dropout, eager attention,
TP = 1) it reduces exactly to the paper's formula. Terms, per token of one layer:

    replicated unless sequence-parallel: 2 norm inputs, QKV input, MLP input (dtype*h each),
                                          2 dropout masks (h bytes each, only with dropout)
    sharded over TP:  Q, K, V, attention output (dtype * q/kv dims), MLP: GeLU 2*dtype*F; SwiGLU eager
                      4*dtype*F (gate and up outputs, silu(gate), their product: what autograd saves for
                      this runtime's decoder), fused 3*dtype*F (Megatron's fused SwiGLU / TE keep the
                      2F-wide fc1 output and the F-wide down_proj input)
    core attention:   eager softmax output dtype*a*s (+ dropout mask a*s and output dtype*a*s);
                      flash keeps only the fp32 log-sum-exp 4*a

Recompute: ``selective`` drops the core-attention terms (recomputed in backward), ``full`` keeps only
each layer's input (dtype*h, sharded with sequence parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from planner.constants import ADAM_STATE_BYTES_PER_PARAM, BF16_BYTES, FP32_BYTES, INT64_BYTES, MASK_BYTES
from planner.model import ModelShape, estimate_kv_bytes_per_token, estimate_layer_parameter_count
from stages.layout import RUNTIME_TP, TensorParallelRules, kv_heads_per_rank

__all__ = [
    "ActivationImpl",
    "ActivationImplName",
    "TORCH_EAGER_IMPL",
    "MEGATRON_TE_IMPL",
    "ACTIVATION_IMPLS",
    "ActivationBreakdown",
    "estimate_activation_breakdown",
    "estimate_activation_bytes_per_microbatch",
    "estimate_logits_buffer_bytes",
    "estimate_stage_parameters",
    "estimate_kv_cache_bytes",
    "estimate_kv_cache_bytes_per_gpu",
    "estimate_weight_bytes",
    "estimate_optimizer_bytes",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationImpl:
    """How the layer implementation saves tensors; the defaults describe Megatron-LM with Transformer
    Engine and FlashAttention (fused norms, rotary and SwiGLU, sequence parallelism)."""

    attention: Literal["flash", "flash-masked", "eager"] = "flash"
    """flash keeps O and the log-sum-exp only; flash-masked (a fused kernel given an explicit mask, e.g. torch
    SDPA with packed documents) also keeps the additive mask, (b, 1, s, s) in the compute dtype; eager keeps
    the softmax output (s x s per head)."""
    dropout: bool = False
    """Dropout after attention and MLP (GPT); Llama/Qwen2 train without it."""
    sequence_parallel: bool = True
    """Norm and dropout activations sharded over TP along the sequence (Korthikanti 2022, Sec. 4.2.2)."""
    rmsnorm: Literal["fused", "eager"] = "fused"
    """fused keeps the input; eager (HF ``LlamaRMSNorm``) also keeps an fp32 copy and the normalised x."""
    expand_kv: bool = False
    """K/V repeated to all query heads before attention (HF ``repeat_kv``): saved K, V are q_dim wide."""
    rope: Literal["fused", "eager"] = "fused"
    """eager rotary embedding keeps its cos and sin tables, computed once per stage forward and shared
    by its layers and by q and k: 2 * head_dim * dtype per token per stage."""
    swiglu: Literal["fused", "eager"] = "fused"
    """fused keeps 3 F-wide tensors per layer (fc1 output 2F, down_proj input F); eager autograd keeps 4
    (gate and up outputs, silu(gate), their product)."""


# A plain-PyTorch Llama/Qwen2 (HF-style modules, F.scaled_dot_product_attention, repeat of K/V, eager RMSNorm
# and rotary): what grpoflow's own decoder saves. Packed rows pass a mask: use attention="flash-masked".
# Checked to the byte against saved_tensors_hooks on that decoder (fp32 and bf16, Llama and Qwen2 shapes).
TORCH_EAGER_IMPL = ActivationImpl(attention="flash", rmsnorm="eager", expand_kv=True, rope="eager",
                                  swiglu="eager", sequence_parallel=False)
# Megatron-LM + Transformer Engine: fused RMSNorm, rotary and SwiGLU, FlashAttention, sequence parallel.
MEGATRON_TE_IMPL = ActivationImpl()
ActivationImplName = Literal["torch-eager", "megatron-te"]
ACTIVATION_IMPLS: dict[str, ActivationImpl] = {"torch-eager": TORCH_EAGER_IMPL, "megatron-te": MEGATRON_TE_IMPL}

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True, slots=True)
class ActivationBreakdown:
    """Bytes one microbatch keeps for backward on one stage, by origin."""

    per_layer_bytes: int
    layers_bytes: int
    embedding_bytes: int
    """token ids saved by the embedding backward (first stage)"""
    head_bytes: int
    """final norm, lm_head input, fp32 log-softmax kept for the loss (last stage)"""

    @property
    def total_bytes(self) -> int:
        return self.layers_bytes + self.embedding_bytes + self.head_bytes


def _norm_bytes_per_token(h: int, dtype_bytes: int, impl: ActivationImpl) -> float:
    """One RMSNorm: fused keeps its input; eager keeps an fp32 copy of it, the fp32 rstd per token and the
    normalised x in the compute dtype (what HF ``LlamaRMSNorm``'s pow / mul / weight-mul save)."""
    if impl.rmsnorm == "fused":
        return dtype_bytes * h
    return (FP32_BYTES + dtype_bytes) * h + FP32_BYTES


def _layer_bytes_per_token(model: ModelShape, seq_len: int, dtype_bytes: int, recompute: str,
                           tp: int, impl: ActivationImpl) -> float:
    h, f, heads = model.hidden_size, model.intermediate_size, model.num_attention_heads
    replicated_div = tp if impl.sequence_parallel else 1
    if recompute == "full":
        return dtype_bytes * h / replicated_div
    norm = _norm_bytes_per_token(h, dtype_bytes, impl)
    replicated = 2 * norm + 2 * dtype_bytes * h + (2 * MASK_BYTES * h if impl.dropout else 0)
    kv_width = model.q_dim if impl.expand_kv else model.kv_dim
    attention = dtype_bytes * (model.q_dim + 2 * kv_width + model.q_dim)
    mlp = ((4 if impl.swiglu == "eager" else 3) if model.gated_mlp else 2) * dtype_bytes * f
    core = 0.0
    if recompute == "none":
        if impl.attention == "eager":
            per_score = dtype_bytes + (MASK_BYTES + dtype_bytes if impl.dropout else 0)
            core = per_score * heads * seq_len
        else:
            core = FP32_BYTES * heads
    mask = dtype_bytes * seq_len if impl.attention == "flash-masked" and recompute == "none" else 0
    return replicated / replicated_div + mask + (attention + mlp + core) / tp


def estimate_activation_breakdown(model: ModelShape, micro_batch_size: int, seq_len: int, layers_in_stage: int,
                                  dtype_bytes: int = BF16_BYTES, recompute: Recompute = "none", *,
                                  is_first_stage: bool = False, is_last_stage: bool = False,
                                  tensor_parallel_size: int = 1, impl: ActivationImpl | None = None,
                                  logits_dtype_bytes: int = FP32_BYTES, vocab_parallel: bool = True
                                  ) -> ActivationBreakdown:
    """Itemised activation stash of one microbatch on one stage (see module docstring for terms).

    ``vocab_parallel``: lm_head sharded over TP (Megatron), so each rank keeps V/TP log-probs; False
    (the runtime's replicated lm_head) keeps all V on every TP rank."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    impl = impl or ActivationImpl()
    tp, tokens = tensor_parallel_size, micro_batch_size * seq_len
    per_layer = math.ceil(tokens * _layer_bytes_per_token(model, seq_len, dtype_bytes, recompute, tp, impl))
    # Eager rotary: one cos and one sin table [b, 1, s, d] per stage, not TP-sharded (what the
    # runtime's decoder computes once per forward, stages/policy/model.py rope_cos_sin).
    shared_rope = layers_in_stage and impl.rope == "eager" and recompute != "full"
    rope_tables = tokens * 2 * model.head_dim * dtype_bytes if shared_rope else 0
    embedding = tokens * INT64_BYTES if is_first_stage else 0
    head = 0
    if is_last_stage:
        seq_div = tp if impl.sequence_parallel else 1
        h = model.hidden_size
        # final norm + lm_head input, then the log-softmax the token log-prob gather keeps (and its index)
        vocab_div = tp if vocab_parallel else 1
        loss = logits_dtype_bytes * model.vocab_size / vocab_div + (INT64_BYTES if logits_dtype_bytes else 0)
        head = math.ceil(tokens * ((_norm_bytes_per_token(h, dtype_bytes, impl) + dtype_bytes * h) / seq_div + loss))
    return ActivationBreakdown(per_layer, per_layer * layers_in_stage + rope_tables, embedding, head)


def estimate_activation_bytes_per_microbatch(model: ModelShape, micro_batch_size: int, seq_len: int,
                                             layers_in_stage: int, dtype_bytes: int = BF16_BYTES,
                                             recompute: Recompute = "none", *, is_first_stage: bool = False,
                                             is_last_stage: bool = False, tensor_parallel_size: int = 1,
                                             impl: ActivationImpl | None = None,
                                             logits_dtype_bytes: int = FP32_BYTES, vocab_parallel: bool = True) -> int:
    """Bytes one microbatch keeps for backward on a stage of ``layers_in_stage`` layers (per TP rank).

    GPT shape, eager attention with dropout, TP = 1: ``layers * (34*s*b*h + 5*a*s^2*b)`` exactly
    (Korthikanti et al. 2022, Eq. 1). The first stage adds the token ids the embedding backward keeps.
    The last stage adds the final norm, the lm_head input and the log-softmax over the (TP-sharded)
    vocabulary that the GRPO token log-probs are gathered from, in ``logits_dtype_bytes`` (0 when the
    loss runs outside the measured stage forward, as with torch.distributed.pipelining's loss_fn).
    """
    return estimate_activation_breakdown(
        model, micro_batch_size, seq_len, layers_in_stage, dtype_bytes, recompute,
        is_first_stage=is_first_stage, is_last_stage=is_last_stage, tensor_parallel_size=tensor_parallel_size,
        impl=impl, logits_dtype_bytes=logits_dtype_bytes, vocab_parallel=vocab_parallel,
    ).total_bytes


def estimate_logits_buffer_bytes(model: ModelShape, tokens: int, tensor_parallel_size: int = 1,
                                 dtype_bytes: int = BF16_BYTES) -> int:
    """Transient last-stage buffers of one microbatch: bf16 logits plus their fp32 gradient in backward."""
    return tokens * model.vocab_size // tensor_parallel_size * (dtype_bytes + FP32_BYTES)


def estimate_stage_parameters(model: ModelShape, layers: int, *, has_embedding: bool, has_head: bool,
                              tensor_parallel_size: int = 1, single_stage: bool = False,
                              tp_rules: TensorParallelRules = RUNTIME_TP) -> int:
    """Parameters one TP rank of a stage holds: TP-sharded matmuls, replicated norms.

    Embedding and lm_head are replicated over TP (the runtime) or vocab-parallel (Megatron,
    ``tp_rules.vocab_parallel_embedding``). With tied embeddings and several stages, the last stage
    keeps its own copy of the matrix (both sum the two gradients).
    """
    tp, h = tensor_parallel_size, model.hidden_size
    norms = 2 * h
    per_layer = (estimate_layer_parameter_count(model) - norms) // tp + norms
    params = layers * per_layer
    vocab_matrix = model.vocab_size * h // (tp if tp_rules.vocab_parallel_embedding else 1)
    if has_embedding:
        params += vocab_matrix
    if has_head:
        params += h  # final norm
        if not (model.tie_word_embeddings and single_stage):
            params += vocab_matrix
    return params


def estimate_weight_bytes(params: int, dtype_bytes: int = BF16_BYTES) -> int:
    """Model weights in the compute dtype."""
    return params * dtype_bytes


def estimate_optimizer_bytes(params: int, data_parallel_size: int, distributed_optimizer: bool) -> float:
    """fp32 master + Adam m and v: 12 bytes/param, divided by DP with the distributed optimiser (ZeRO-1)."""
    shards = data_parallel_size if distributed_optimizer else 1
    return params * ADAM_STATE_BYTES_PER_PARAM / shards


def estimate_kv_cache_bytes(model: ModelShape, num_prompts: int, group_size: int, prompt_len: int, gen_len: int,
                            dtype_bytes: int = BF16_BYTES, share_prefix: bool = True,
                            page_size: int | None = None) -> int:
    """KV-cache bytes for ``num_prompts`` groups of G samples, whole model (all layers, all KV heads).

    Shared prefix (the runtime engine's allocation: one prefix KV per prompt, one decode KV per sample):
    ``2*L*n_kv*d*dtype * (num_prompts*prompt_len + num_prompts*G*gen_len)``. Unshared: every sample holds
    prompt_len + gen_len tokens. With ``page_size`` (PagedAttention, Kwon et al. 2023) the full prefix pages
    are shared and each sample rounds its own tokens, including the copied-on-write partial prefix page,
    up to whole pages.
    """
    per_token = estimate_kv_bytes_per_token(model, dtype_bytes)
    samples = num_prompts * group_size
    if page_size is None:
        if share_prefix:
            return per_token * (num_prompts * prompt_len + samples * gen_len)
        return per_token * samples * (prompt_len + gen_len)

    def pages(tokens: int) -> int:
        return -(-tokens // page_size) * page_size

    if share_prefix:
        shared, partial = divmod(prompt_len, page_size)
        return per_token * (num_prompts * shared * page_size + samples * pages(partial + gen_len))
    return per_token * samples * pages(prompt_len + gen_len)


def estimate_kv_cache_bytes_per_gpu(total_kv_bytes: float, model: ModelShape, tensor_parallel_size: int) -> float:
    """Share of a whole-model KV cache one GPU of a TP engine holds."""
    return total_kv_bytes * kv_heads_per_rank(model, tensor_parallel_size) / model.num_key_value_heads
