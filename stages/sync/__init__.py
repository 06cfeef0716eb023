"""In-memory weight sync: training pipeline ranks broadcast a new policy version to the rollout
engines over process groups of their own; the engine holds the version it received.

Disk versions (storage/policies.py) stay the lineage and the resume point; this is the fast path
from training to rollout.
"""

from stages.sync.channel import WeightReceiver, WeightSender
from stages.sync.config import (DEFAULT_SYNC_BUCKET_BYTES, PolicyTag, SyncStats, WeightSyncConfig,
                                WeightSyncError)
from stages.sync.plan import SignatureMismatchError, plan_sync, state_digest, tensor_specs

__all__ = ["DEFAULT_SYNC_BUCKET_BYTES", "PolicyTag", "SyncStats", "WeightReceiver", "WeightSender",
           "WeightSyncConfig", "WeightSyncError", "SignatureMismatchError", "plan_sync", "state_digest",
           "tensor_specs"]
