"""Generation engines behind one small protocol; the torch engine is the default."""

from stages.rollout.engine import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams, generate

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "RolloutBatch", "SamplingParams", "generate"]
