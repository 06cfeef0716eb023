"""Tensor and data parallelism of pipeline stages, kept beside the model (stages/policy has no
mesh code).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, Sec. 3): in every decoder layer q/k/v and
gate/up are column-parallel (each TP rank holds heads/T query heads, kv_heads/T kv heads and
intermediate/T MLP columns) and o_proj/down_proj row-parallel, so each block needs one all-reduce
forward and one backward. Embedding, norms and the LM head stay replicated: their gradients are
already whole on every TP rank (the column-parallel input's backward all-reduces).

Data parallelism: an exact bucketed all-reduce SUM of gradients over the dp group after the
pipeline step. Sum, not mean: every loss weight is normalised over the whole global batch
(stages/train/batch.py), so each DP rank's gradient is a partial sum of the global one.
(docs/performance.md argues the choice against DDP / FSDP2.)
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["apply_tensor_parallel", "local_tensor", "allreduce_grads", "unique_parameters", "sum_tied_grads",
           "clip_grad_norm", "DEFAULT_BUCKET_BYTES", "head_local_parameters"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size: few collectives, bounded extra memory
_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def apply_tensor_parallel(stage: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the attention and MLP of every decoder layer of ``stage`` over ``tp_mesh`` in place
    (weights must already be loaded: they are split from the full tensors)."""
    T = tp_mesh.size()
    cfg = stage.cfg
    for key, value in (("num_attention_heads", cfg.num_attention_heads),
                       ("num_key_value_heads", cfg.num_key_value_heads),
                       ("intermediate_size", cfg.intermediate_size)):
        if value % T:
            raise ValueError(f"model {key}={value} is not divisible by tensor_model_parallel_size={T}")
    plan = {}
    for name, layer in stage.layers.items():
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"layers.{name}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"layers.{name}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"layers.{name}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"layers.{name}.mlp.up_proj"] = ColwiseParallel()
        plan[f"layers.{name}.mlp.down_proj"] = RowwiseParallel()
        # The attention reshapes by its local head counts; outputs are plain local tensors.
        layer.self_attn.num_heads //= T
        layer.self_attn.num_kv_heads //= T
    parallelize_module(stage, tp_mesh, plan)


def head_local_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Replicated weights applied to each rank's own heads (Qwen3's q_norm / k_norm over head_dim):
    under TP a rank's gradient of one is only its heads' share, so the shares are summed over the
    TP group (as Megatron-LM does for its q/k layernorms) to keep the replicas equal."""
    return [p for m in modules for name, p in m.named_parameters()
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of several stage modules, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def allreduce_grads(params: list[nn.Parameter], group: Optional[dist.ProcessGroup],
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Sum every parameter's gradient over ``group``, bucket by bucket (flatten, one all-reduce,
    copy back); returns the number of collectives. A missing gradient takes part as zeros so every
    rank's buckets line up."""
    if group is None or dist.get_world_size(group) == 1:
        return 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local_tensor(p.grad) for p in params]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(buckets)


def sum_tied_grads(weights: list[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
    """Give both copies of a tied embedding the sum of their gradients: locally when this rank
    holds both (``weights`` has two), else by an all-reduce with the rank holding the other."""
    for w in weights:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
    if len(weights) == 2:
        total = weights[0].grad + weights[1].grad
        weights[0].grad.copy_(total)
        weights[1].grad.copy_(total)
    elif weights and group is not None:
        dist.all_reduce(weights[0].grad, group=group)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, counted: Callable[[nn.Parameter], bool]) -> float:
    """Global L2 norm of the gradients, ||g|| = sqrt(sum over ranks of the squares this rank counts),
    one all-reduce over the world; scales every gradient by max_norm / (||g|| + 1e-6) when above
    ``max_norm`` > 0 (torch.nn.utils.clip_grad_norm_'s rule). Returns ||g||."""
    device = local_tensor(params[0]).device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)  # on the gradients' device (NCCL on CUDA)
    for p in params:
        if p.grad is not None and counted(p):
            sq += local_tensor(p.grad).double().pow(2).sum()
    dist.all_reduce(sq)
    norm = math.sqrt(float(sq))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + _CLIP_EPS)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
