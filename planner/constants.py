"""Units and numeric constants shared by the planner, each named once with its unit and reason."""

from __future__ import annotations

__all__ = [
    "GIB",
    "GB",
    "BF16_BYTES",
    "FP32_BYTES",
    "INT64_BYTES",
    "MASK_BYTES",
    "ADAM_STATE_BYTES_PER_PARAM",
    "CAUSAL_ATTENTION_FLOP_FACTOR",
]

GIB = 1024**3  # bytes in a GiB (what nvidia-smi reports as "80 GB" on an 80 GiB part)
GB = 1000**3  # bytes in a decimal GB (what link and HBM bandwidths are quoted in)

BF16_BYTES = 2  # bf16 / fp16 element
FP32_BYTES = 4  # fp32 element (master weights, Adam moments, fp32 main grads, log-softmax)
INT64_BYTES = 8  # token ids / gather indices saved for backward
MASK_BYTES = 1  # a dropout mask element (Korthikanti et al. 2022, Sec. 4.1)

# Mixed-precision Adam keeps an fp32 master copy plus the first and second moments in fp32:
# 4 + 4 + 4 = 12 bytes per parameter (Megatron-LM distributed-optimizer docs, Rajbhandari 2020 ZeRO Sec. 3).
ADAM_STATE_BYTES_PER_PARAM = 12

# Causal attention computes (on average) half of the s x s score matrix: FlashAttention-2 (Dao 2023)
# skips the masked blocks, so the score and value matmuls cost half of the dense 4*s*d per token.
CAUSAL_ATTENTION_FLOP_FACTOR = 0.5
