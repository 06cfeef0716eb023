"""The torch generation engine: continuous batching over a paged KV cache, optional speculative decoding."""

from stages.rollout.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    RolloutBatch,
    SamplingParams,
    generate,
)

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "EngineConfig", "RolloutBatch", "SamplingParams", "generate"]
