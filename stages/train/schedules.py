"""The pipeline schedules of ``train.schedule``, built on torch.distributed.pipelining, and a
forward-only schedule for the reference and proximal log-prob passes.

========================  ==========================================  =====================
train.schedule            torch class                                 stages per rank (v)
========================  ==========================================  =====================
gpipe                     ScheduleGPipe                               1
1f1b                      Schedule1F1B                                1
interleaved-1f1b          ScheduleInterleaved1F1B                     >= 2, looped
zb-h1                     ScheduleInterleavedZeroBubble (ZB-H1)       1
zbv                       ScheduleZBVZeroBubble                       2, V-shape
dualpipev                 ScheduleDualPipeV                           2, V-shape
========================  ==========================================  =====================

Every schedule is built with ``scale_grads=False``: torch would otherwise divide gradients by the
number of microbatches, while our microbatch losses are already exact partial sums of the global
loss (stages/train/loss.py). The multi-stage ones run on torch's ``_PipelineScheduleRuntime``,
which calls the same ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
of each stage as the single-stage schedules, so TimedStage's hooks fire under both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B,
                                                    ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.stage import _PipelineStageBase

from stages.train.loss import chunked_token_logp, token_logp

__all__ = ["SCHEDULE_CLASSES", "build_train_schedule", "ForwardOnlySchedule", "LogpStage"]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def build_train_schedule(name: str, stages: list[_PipelineStageBase], num_microbatches: int,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The training schedule ``name`` over this rank's stages (ascending stage index)."""
    if name not in SCHEDULE_CLASSES:
        raise ValueError(f"train.schedule={name!r} is not one of {', '.join(SCHEDULE_CLASSES)}")
    cls = SCHEDULE_CLASSES[name]
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"train.schedule={name} runs one stage per rank, this rank holds {len(stages)}")
        return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


class ForwardOnlySchedule(PipelineScheduleMulti):
    """Forward passes only, under any stage placement (looped or V): each rank runs its stages in
    ascending order, every microbatch of a stage before the next stage (GPipe over the virtual
    stages). Sends are waited at the end, receives just before use, so no rank waits on one that
    waits on it. Run it under ``torch.no_grad()``: nothing is stashed for a backward.
    """

    def __init__(self, stages: list[_PipelineStageBase], num_microbatches: int, stage_to_rank: dict[int, int]):
        super().__init__(stages, num_microbatches, loss_fn=None, scale_grads=False)
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0])
        local = {s.stage_index: s for s in self._stages}
        sends = []
        for index in sorted(local):
            stage = local[index]
            for mb in range(self._n_microbatches):
                if not stage.is_first and index - 1 not in local:
                    # looked up on the module so that timeline.timed_p2p sees it
                    _schedules._wait_batch_p2p(_schedules._batch_p2p(stage.get_fwd_recv_ops(mb)))
                out = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs)
                if index + 1 in local:  # V-shape turn: hand over on this rank
                    local[index + 1].set_local_fwd_input(out, mb)
                elif not stage.is_last:
                    sends.append(_schedules._batch_p2p(stage.get_fwd_send_ops(mb)))
                stage.fwd_cache.pop(mb, None)  # no backward will need it
        for works in sends:
            _schedules._wait_batch_p2p(works)


class LogpStage(nn.Module):
    """Forward-only wrapper of a stage: the last stage returns per-token log-probs [B, T] of
    ``next_ids`` (a keyword every stage receives) instead of logits."""

    def __init__(self, stage: nn.Module, temperature: float, chunk_tokens: Optional[int]):
        super().__init__()
        self.stage, self.temperature, self.chunk_tokens = stage, temperature, chunk_tokens

    def forward(self, x: torch.Tensor, next_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.stage(x, **kwargs)
        if not self.stage.is_last:
            return h
        if self.stage.return_hidden:
            return chunked_token_logp(h, next_ids, self.stage.lm_head, self.temperature, self.chunk_tokens)
        return token_logp(h, next_ids, self.temperature)
