"""The project's own torch engine as a rollout engine backend (``rollout.engine: native``).

It holds one decoder (the whole model, on ``device`` in ``dtype``) and generates with
stages/rollout/engine.py (continuous batching over a prefix-shared paged KV cache), or speculatively
with a draft (stages/rollout/speculative.py): ``draft_layers`` makes the draft from the first layers
of every version it loads, so the draft follows the policy; ``draft_path`` loads another model once.
A version of the architecture held is copied into the held model in place (no new modules to build
and initialise); another architecture gets a model of its own. A load that fails part-way drops the
held model, so the next load builds it whole.

Bit-reproducible: every draw is a hash of (seed, prompt, sample, token), so a sample depends on
neither the batch nor the thread count's scheduling of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stages.policy import DecoderConfig, DecoderStage, build_stage, load_hf_state
from stages.rollout.contract import PolicyWeights
from stages.rollout.engine import EngineConfig, RolloutBatch, SamplingParams, generate
from stages.rollout.speculative import draft_from_target, generate_speculative
from storage.policies import load_model_folder

__all__ = ["DraftSpec", "NativeEngine"]


@dataclass(frozen=True)
class DraftSpec:
    """Speculative decoding: a draft of the policy's first ``layers`` layers, or the model at ``path``."""

    layers: int = 0
    path: Optional[str] = None
    num_tokens: int = 4


class NativeEngine:
    """A rollout engine backend (stages/rollout/contract.py) running the project's decoder."""

    kind = "native"

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 engine: EngineConfig | None = None, draft: DraftSpec | None = None,
                 model: Optional[DecoderStage] = None):
        """``model``: a whole model to generate with as it is (its device and dtype rule)."""
        self.device, self.dtype = torch.device(device), dtype
        self.engine = engine or EngineConfig()
        self.draft_spec = draft if draft is not None and (draft.layers or draft.path) else None
        self.model: Optional[DecoderStage] = model
        self.draft: Optional[DecoderStage] = None
        if model is not None:
            p = next(model.parameters())
            self.device, self.dtype = p.device, p.dtype
            self._load_draft()

    def load(self, weights: PolicyWeights) -> None:
        model, self.model = self.model, None  # half-copied weights belong to no version
        if weights.tensors is not None and model is not None:
            # Received in memory: the run's architecture (the sync's signatures matched it).
            cfg, tensors = model.cfg, dict(weights.tensors)
        else:
            hf_config, _, tensors = load_model_folder(weights.path, names=None if weights.tensors is None else set())
            tensors = dict(weights.tensors) if weights.tensors is not None else tensors
            cfg = DecoderConfig.from_hf(hf_config)
        if model is None or model.cfg != cfg:
            model = build_stage(cfg).to(device=self.device, dtype=self.dtype)
            model.eval()
        load_hf_state(model, tensors)  # copies each tensor to the model's device and dtype
        self.model = model
        self._load_draft()

    def _load_draft(self) -> None:
        spec = self.draft_spec
        if spec is None:
            return
        if spec.layers:  # follows the policy: rebuilt from every version
            self.draft = draft_from_target(self.model, spec.layers)
        elif self.draft is None:  # another model, loaded once
            hf_config, _, tensors = load_model_folder(spec.path)
            draft = build_stage(DecoderConfig.from_hf(hf_config)).to(device=self.device, dtype=self.dtype)
            load_hf_state(draft, tensors)
            self.draft = draft.eval()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> RolloutBatch:
        if self.model is None:
            raise RuntimeError("the native engine holds no model: load a version first")
        ids = [list(p) for p in prompts]
        gen = torch.Generator().manual_seed(seed)
        if self.draft is None:
            return generate(self.model, ids, params, gen, self.engine)
        batch, stats = generate_speculative(self.model, self.draft, ids, params, gen, self.draft_spec.num_tokens,
                                            self.engine)
        batch.metrics.update(speculative_acceptance=stats.acceptance,
                             speculative_tokens_per_forward=stats.tokens_per_verify)
        return batch

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.model = self.draft = None
