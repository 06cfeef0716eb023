"""A training rank's setup (stages/train/engine.py ``TrainSetup``) from the train section, the
model and what the run config resolves (flows/config.py ``GRPOConfig``): no torch work, no IO.
"""

from __future__ import annotations

from typing import Optional

from stages.config import TrainConfig, effective_off_policy
from stages.policy import DecoderConfig
from stages.train.auto import auto_logprob_chunk_tokens, auto_lr
from stages.train.engine import InjectedFault, TrainSetup
from stages.train.loss import LossConfig

__all__ = ["train_setup"]


def train_setup(train: TrainConfig, model_cfg: DecoderConfig, num_microbatches: int, temperature: float,
                faults: tuple[InjectedFault, ...] = (), max_staleness: int = 0,
                reference_parallel: Optional[str] = None,
                logprob_chunk_tokens: Optional[int] = None,
                layer_split: Optional[tuple[int, ...]] = None, engine: str = "native",
                lr: Optional[float] = None, engine_dtype: str = "float32") -> TrainSetup:
    """A training rank's setup: the train section, the model, the per-pipeline microbatch count
    and the rollout temperature (the loss scores log-probs at the sampling temperature);
    max_staleness, the rollout engine and its resolved dtype (GRPOConfig.engine_dtype) pick the
    off-policy default (stages/config.py effective_off_policy);
    reference_parallel: train.reference_parallel resolved (GRPOConfig.reference_parallel; None:
    the section's own value, or pipeline for auto); logprob_chunk_tokens: train.logprob_chunk_tokens
    resolved (GRPOConfig.logprob_chunk_tokens; None: the section's own value, auto resolved for
    model_cfg's vocabulary by the same rule, stages/train/auto.py); layer_split: train.layer_split
    resolved (GRPOConfig.layer_split; None: the section's own list, or the even split for auto);
    lr: train.lr resolved (GRPOConfig.lr; None: the section's own number, or for auto the built-in
    model's rate; each training step sets its own rate after this one, flows/tasks.py)."""
    t = train
    chunk = t.logprob_chunk_tokens
    if chunk == "auto":
        chunk = auto_logprob_chunk_tokens(model_cfg.vocab_size)
    return TrainSetup(
        model=model_cfg, pipeline_parallel_size=t.pipeline_model_parallel_size,
        num_microbatches=num_microbatches, schedule=t.schedule,
        virtual_stages=t.virtual_pipeline_model_parallel_size, data_parallel_size=t.data_parallel_size,
        tensor_parallel_size=t.tensor_model_parallel_size,
        lr=lr if lr is not None else (t.lr if t.lr != "auto" else auto_lr(pretrained=False)), weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss=LossConfig(t.clip_eps_low, t.clip_eps_high, t.kl_beta, temperature,
                        effective_off_policy(t, max_staleness, engine, engine_dtype),
                        ratio_level=t.policy_ratio),
        logprob_chunk_tokens=logprob_chunk_tokens or chunk, timeout_s=t.timeout_s, faults=faults,
        reference_parallel=reference_parallel or (t.reference_parallel if t.reference_parallel != "auto"
                                                  else "pipeline"),
        reference=t.uses_reference, device=t.device, dtype=t.dtype,
        reference_fill=t.reference_pass == "fused" and t.reference_fill == "auto",
        layer_split=layer_split or (tuple(t.layer_split) if t.layer_split != "auto" else None))
