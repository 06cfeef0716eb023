"""The weight-sync channel's config and what a sync reports: its stats and the version tag."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal
from urllib.parse import urlparse

__all__ = ["DEFAULT_SYNC_BUCKET_BYTES", "WeightSyncConfig", "WeightSyncError", "PolicyTag", "SyncStats"]

DEFAULT_SYNC_BUCKET_BYTES = 32 * 2**20  # a few buckets per GB, bounded staging memory on the sender


class WeightSyncError(RuntimeError):
    """A weight sync could not complete; the message names the sync, the peer and the cause."""


@dataclass(frozen=True)
class WeightSyncConfig:
    """One weight-sync channel, the same on every training rank and engine that joins it."""

    init_method: str
    """tcp://host:port of the channel's rendezvous store; pipeline rank 0 hosts it."""
    num_sources: int
    """Pipeline ranks that send (train.pipeline_model_parallel_size)."""
    num_engines: int
    """Rollout engines that receive."""
    bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES
    """Largest broadcast; a sender stages at most two buckets at a time."""
    timeout_s: float = 60.0
    """Bound of every wait: the signature exchange, each broadcast."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl where the tensors are on CUDA, gloo otherwise."""
    content_hash: Literal["verify", "send", "none"] = "verify"
    """verify: the pipeline ranks send a sha256 per tensor and the engine checks the bytes it got
    against them; send: the engine trusts the transport and only combines the ranks' digests
    (half the hashing); none: no hashing, the version tag's content hash is empty."""
    channel: str = "weights"
    """Name of the channel in the store; a reconnect after a failure takes a new one."""

    def __post_init__(self) -> None:
        url = urlparse(self.init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"sync.init_method={self.init_method!r} must look like tcp://host:port")
        if self.num_sources < 1 or self.num_engines < 1:
            raise ValueError(f"sync needs at least one source and one engine, got num_sources={self.num_sources}, "
                             f"num_engines={self.num_engines}")
        if self.bucket_bytes < 2**10:
            raise ValueError(f"sync.bucket_bytes={self.bucket_bytes} is below 1 KiB; use e.g. "
                             f"{DEFAULT_SYNC_BUCKET_BYTES}")
        if self.timeout_s <= 0:
            raise ValueError(f"sync.timeout_s={self.timeout_s} must be positive")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"sync.backend={self.backend!r} must be auto, gloo or nccl")
        if self.content_hash not in ("verify", "send", "none"):
            raise ValueError(f"sync.content_hash={self.content_hash!r} must be verify, send or none")
        if not self.channel or "/" in self.channel:
            raise ValueError(f"sync.channel={self.channel!r} must be a non-empty name without '/'")

    @property
    def hashing(self) -> bool:
        return self.content_hash != "none"

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


@dataclass(frozen=True)
class PolicyTag:
    """Which policy an engine holds: its version and content hash (:func:`stages.sync.plan.state_digest`
    of the whole state dict; "" with ``content_hash=none``)."""

    version: int
    content_hash: str = ""


@dataclass(frozen=True)
class SyncStats:
    """One side's view of one sync. ``seconds`` runs from the call to its return, waiting for the
    peers included; ``hash_seconds`` is the part spent hashing."""

    version: int
    num_bytes: int
    """Tensor bytes this side sent (a source) or received (an engine), padding excluded."""
    num_buckets: int
    seconds: float
    hash_seconds: float = 0.0

    @property
    def gib_per_s(self) -> float:
        return self.num_bytes / 2**30 / max(self.seconds, 1e-9)
