"""Tensor-parallel rules, and the one check of a whole parallel layout against a model shape.

The runtime (stages/train/parallel.py, Megatron column/row parallel, Shoeybi et al. 2019) gives each TP
rank heads/T query heads, kv_heads/T KV heads and F/T MLP columns, and keeps the embedding, norms and
lm_head replicated. Megatron-LM also runs T > kv_heads (each KV head replicated on T / kv_heads ranks)
and shards the embedding and lm_head over the vocabulary. :data:`RUNTIME_TP` is the default everywhere;
the planner can price :data:`MEGATRON_TP` instead (``plan.tp_rules``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stages.layout.pipeline import schedule_error
from stages.layout.shape import ModelShape

__all__ = ["TensorParallelRules", "RUNTIME_TP", "MEGATRON_TP", "TP_RULES", "tensor_parallel_error",
           "kv_heads_per_rank", "parallel_layout_error"]


@dataclass(frozen=True)
class TensorParallelRules:
    """How a layer is split over T tensor-parallel ranks."""

    replicate_kv_heads: bool = False
    """T may exceed the KV heads (each then replicated on T / kv_heads ranks); False: T divides them."""
    vocab_parallel_embedding: bool = False
    """Embedding and lm_head sharded over the vocabulary; False: replicated on every TP rank."""


RUNTIME_TP = TensorParallelRules()
MEGATRON_TP = TensorParallelRules(replicate_kv_heads=True, vocab_parallel_embedding=True)
TP_RULES = {"runtime": RUNTIME_TP, "megatron": MEGATRON_TP}


def tensor_parallel_error(shape: ModelShape, tp: int, rules: TensorParallelRules = RUNTIME_TP) -> Optional[str]:
    """Why ``shape`` cannot be split over ``tp`` ranks under ``rules``, naming the keys; None if it can."""
    key = f"train.tensor_model_parallel_size={tp}"
    if tp < 1:
        return f"{key} must be >= 1"
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(shape, name) % tp:
            return f"{key} must divide model.{name}={getattr(shape, name)}"
    kv = shape.num_key_value_heads
    if rules.replicate_kv_heads:
        if kv % tp and tp % kv:
            return f"{key} and model.num_key_value_heads={kv} must divide one another"
    elif kv % tp:
        return f"{key} must divide model.num_key_value_heads={kv}"
    return None


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads each TP rank holds: kv / T, or one replicated head when T > kv (Megatron rules)."""
    return max(1, shape.num_key_value_heads // tp)


def parallel_layout_error(shape: ModelShape, *, tp: int, pp: int, virtual: int, schedule: str,
                          num_microbatches: int, rules: TensorParallelRules = RUNTIME_TP) -> Optional[str]:
    """First reason a (tp, pp, v, schedule, m) layout cannot train ``shape``; None if it can. Both the
    run config (stages/config.py) and the plan config (planner/validate.py) ask this one question."""
    return (tensor_parallel_error(shape, tp, rules)
            or schedule_error(schedule, pp, num_microbatches, virtual, shape.num_hidden_layers))
