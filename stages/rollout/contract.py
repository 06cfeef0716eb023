"""The rollout engine contract: what a generation engine does, whichever engine it is.

```
            load(PolicyWeights: version, folder, [tensors received in memory])
                 │
prompt ids ──► generate(version, prompts, SamplingParams, seed) ──► RolloutBatch: completion ids,
                 │                                                   behaviour log-probs (of the
            healthy()  close()                                       distribution sampled), finish
                                                                     reasons, policy_version
```

An engine **backend** (:class:`EngineBackend`: stages/rollout/native.py, the project's own torch
engine; stages/rollout/vllm_engine.py, vLLM in a process of its own) loads weights and generates.
:class:`RolloutEngine` holds a backend and the version it holds, and is the one place a version is
checked: a step is generated only from the version it names (``policy_version`` in the rollout
store), and a load that fails part-way leaves it holding no version, so the next step loads its
version whole instead of generating from half-copied weights.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

import torch

from stages.rollout.engine import RolloutBatch, SamplingParams

__all__ = ["EngineError", "PolicyVersionError", "PolicyWeights", "EngineBackend", "RolloutEngine"]


class EngineError(RuntimeError):
    """An engine could not load or generate; the message says which engine and why."""


class PolicyVersionError(RuntimeError):
    """A step asked for a policy version the engine does not hold."""


@dataclass(frozen=True)
class PolicyWeights:
    """One policy version, as an engine loads it."""

    version: int
    path: str
    """The version's published HF folder (config.json, tokenizer files, safetensors shards)."""
    sha256: str = ""
    """The folder's content hash (its manifest's); "" when unknown (then a load is never skipped)."""
    tensors: Optional[Mapping[str, torch.Tensor]] = None
    """The HF-named tensors, received in memory (cluster.weight_sync=memory); None: read the folder."""
    content_hash: str = ""
    """The weight sync's digest of ``tensors`` (stages/sync/plan.py state_digest), for lineage."""


class EngineBackend(Protocol):
    """What :class:`RolloutEngine` drives."""

    kind: str
    """native, vllm, ..."""

    def load(self, weights: PolicyWeights) -> None:
        """Hold ``weights``' tensors (from ``tensors`` when given, else from the folder)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> RolloutBatch:
        """``params.group_size`` samples of each prompt, the rows of a prompt contiguous; ``seed``
        decides every draw."""
        ...

    def healthy(self) -> bool:
        ...

    def close(self) -> None:
        ...


class RolloutEngine:
    """An engine backend and the policy version it holds."""

    def __init__(self, backend: EngineBackend, version: Optional[int] = None):
        """``version``: the version a backend built with its weights already holds (a model that a
        single-process loop trains and samples from); default none until the first load."""
        self.backend = backend
        self._version: Optional[int] = version
        self._sha256 = ""

    @property
    def kind(self) -> str:
        return self.backend.kind

    @property
    def version(self) -> Optional[int]:
        """The policy version held; None before the first load and after a failed one."""
        return self._version

    def load(self, weights: PolicyWeights) -> dict[str, float | str]:
        """Hold ``weights``' version. The same bytes as the version held (a step whose update left
        every weight as it was) are not loaded again, only tagged. Returns where the weights came
        from (``weights_from``: held, memory or disk) and the seconds it took."""
        if self.holds(weights.sha256) and self.backend.healthy():
            self._version = weights.version
            return {"weights_from": "held", "weight_load_seconds": 0.0}
        self._version, self._sha256 = None, ""  # half-loaded weights belong to no version
        t0 = time.perf_counter()
        self.backend.load(weights)
        self._version, self._sha256 = weights.version, weights.sha256
        return {"weights_from": "disk" if weights.tensors is None else "memory",
                "weight_load_seconds": time.perf_counter() - t0}

    def holds(self, sha256: str) -> bool:
        """Whether the engine holds a version of these bytes (its folder's content hash)."""
        return bool(sha256) and sha256 == self._sha256 and self._version is not None

    def require(self, version: int) -> None:
        """Nothing, if the engine holds policy ``version``; otherwise a one-line PolicyVersionError."""
        if self._version is None:
            raise PolicyVersionError(f"the step asks for policy v{version}, the rollout engine holds no policy "
                                     "version yet: sync or load one first")
        if self._version != version:
            raise PolicyVersionError(f"the step asks for policy v{version}, the rollout engine holds "
                                     f"v{self._version}: sync v{version} to the engine before generating")

    def generate(self, version: int, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seed: int) -> RolloutBatch:
        """The backend's samples, refused unless the engine holds ``version``; stamped with it."""
        self.require(version)
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("generate needs at least one prompt, each of at least one token")
        batch = self.backend.generate(prompts, params, seed)
        return dataclasses.replace(batch, policy_version=version)

    def healthy(self) -> bool:
        return self.backend.healthy()

    def close(self) -> None:
        self._version, self._sha256 = None, ""
        self.backend.close()
