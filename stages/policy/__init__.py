"""The policy: a Llama / Qwen2 decoder, its pipeline split, and its tokenizer."""

from __future__ import annotations

import torch
from torch import nn

from stages.policy.model import (DecoderConfig, DecoderStage, build_stage, from_hf_name,
                                 layer_ranges, to_hf_name)

__all__ = ["DecoderConfig", "DecoderStage", "build_stage", "layer_ranges", "hf_named_parameters",
           "hf_state", "load_hf_state", "stage_hf_names", "to_hf_name", "from_hf_name"]


def hf_named_parameters(stage: DecoderStage) -> list[tuple[str, nn.Parameter]]:
    """(HF checkpoint name, parameter) of every tensor the stage holds. A tied head is the
    embedding under HF naming: on a stage that also holds the embedding it is listed once."""
    out = []
    for local, p in stage.named_parameters(remove_duplicate=True):
        name = to_hf_name(local)
        if local == "lm_head.weight" and stage.cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        out.append((name, p))
    return out


def stage_hf_names(stage: DecoderStage) -> list[str]:
    return sorted({name for name, _ in hf_named_parameters(stage)})


def hf_state(stage: DecoderStage) -> dict[str, torch.Tensor]:
    """The stage's parameters under HF names, detached copies."""
    return {name: p.detach().clone().contiguous() for name, p in hf_named_parameters(stage)}


def load_hf_state(stage: DecoderStage, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the stage; every parameter of the stage must be present."""
    missing = []
    with torch.no_grad():
        for name, p in hf_named_parameters(stage):
            if name not in tensors:
                missing.append(name)
                continue
            src = tensors[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, "
                                 f"the model expects {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of this stage, e.g. {missing[0]}")
