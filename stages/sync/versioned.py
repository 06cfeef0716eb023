"""A rollout engine's model together with the policy version it holds.

The flow asks for a version at every rollout step; :meth:`VersionedEngine.require` refuses a
step whose version is not the one held, so a completion is never sampled from a policy other
than the one its rows will record (``policy_version`` in the rollout store).
"""

from __future__ import annotations

import time
from typing import Mapping, Optional

import torch

from stages.policy import DecoderStage, load_hf_state
from stages.rollout import RolloutBatch, SamplingParams, generate
from stages.sync.channel import WeightReceiver
from stages.sync.config import PolicyTag, SyncStats

__all__ = ["PolicyVersionError", "VersionedEngine"]


class PolicyVersionError(RuntimeError):
    """A step asked for a policy version the engine does not hold."""


class VersionedEngine:
    """The engine's whole model (one stage holding every layer) and the tag of its weights."""

    def __init__(self, model: DecoderStage, tag: Optional[PolicyTag] = None):
        if not (model.is_first and model.is_last):
            raise ValueError("a rollout engine holds the whole model (build_stage(cfg) with one stage)")
        self.model = model
        self._tag = tag

    @property
    def tag(self) -> Optional[PolicyTag]:
        return self._tag

    def load(self, tensors: Mapping[str, torch.Tensor], tag: PolicyTag) -> None:
        """Copy HF-named tensors into the model and hold ``tag``; a failed load holds no version."""
        self._tag = None  # half-copied weights belong to no version
        load_hf_state(self.model, dict(tensors))
        self._tag = tag

    def sync(self, receiver: WeightReceiver) -> SyncStats:
        """Receive the next version over ``receiver`` and load it; ``seconds`` includes the load."""
        tag, tensors, stats = receiver.receive()
        t0 = time.perf_counter()
        self.load(tensors, tag)
        load_s = time.perf_counter() - t0
        return SyncStats(stats.version, stats.num_bytes, stats.num_buckets, stats.seconds + load_s,
                         stats.hash_seconds)

    def require(self, version: int) -> DecoderStage:
        """The model, if it holds policy ``version``; otherwise a one-line PolicyVersionError."""
        if self._tag is None:
            raise PolicyVersionError(f"the step asks for policy v{version}, the rollout engine holds no policy "
                                     "version yet: sync or load one first")
        if self._tag.version != version:
            raise PolicyVersionError(f"the step asks for policy v{version}, the rollout engine holds "
                                     f"v{self._tag.version}: sync v{version} to the engine before generating")
        return self.model

    def generate(self, version: int, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator) -> RolloutBatch:
        """stages.rollout.generate on the held model, refused unless it holds ``version``."""
        return generate(self.require(version), prompts, params, generator)
