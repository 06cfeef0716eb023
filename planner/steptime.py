"""GRPO step time: rollout, reference log-probs, training, weight sync, for each placement and staleness.

- colocated: the phases take turns on the same GPUs, so the step is their sum (plus moving optimiser
  state to host and back); staleness cannot overlap anything, every GPU is busy in every phase.
- decoupled, staleness 0: rollout waits for the new weights and training waits for the rollout: a sum.
- decoupled, staleness k >= 1: rollout of step n+1 runs while step n trains, so the period is the slower
  of the two sides, max(rollout + its weight-load pause, reference + train + weight send). Larger k
  does not shorten this period any further in this model; it only absorbs step-to-step jitter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTimeEstimate", "estimate_step_time"]


@dataclass(frozen=True, slots=True)
class StepTimeEstimate:
    """Seconds per GRPO step, split by phase, and throughput."""

    placement: str
    staleness: int
    training_gpus: int
    rollout_gpus: int
    rollout_s: float
    reference_s: float
    train_s: float
    weight_sync_s: float
    """rollout-side pause for new weights (transfer + KV handling)"""
    weight_send_s: float
    """trainer-side time spent sending weights"""
    offload_s: float
    step_s: float
    trained_tokens: float
    """prompt + generated tokens trained per step (mean lengths)"""
    generated_tokens: float

    @property
    def sequential_s(self) -> float:
        """The step without any overlap of rollout and training."""
        return self.rollout_s + self.reference_s + self.train_s + self.weight_sync_s + self.offload_s

    @property
    def overlap_saving_s(self) -> float:
        return self.sequential_s - self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.step_s

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.step_s


def estimate_step_time(*, placement: str, staleness: int, training_gpus: int, rollout_gpus: int,
                       rollout_s: float, reference_s: float, train_s: float, weight_sync_s: float,
                       weight_send_s: float, offload_s: float, trained_tokens: float,
                       generated_tokens: float) -> StepTimeEstimate:
    """Combine phase times into a step period according to placement and staleness (module docstring)."""
    sequential = rollout_s + reference_s + train_s + weight_sync_s + offload_s
    if placement == "decoupled" and staleness >= 1:
        step = max(rollout_s + weight_sync_s, reference_s + train_s + weight_send_s)
    else:
        step = sequential
    return StepTimeEstimate(placement, staleness, training_gpus, rollout_gpus, rollout_s, reference_s, train_s,
                            weight_sync_s, weight_send_s, offload_s, step, trained_tokens, generated_tokens)
