"""Peak bytes of tensors alive at once, on any device (CPU included), for a region of torch code.

``torch.cuda.max_memory_allocated`` exists only on CUDA, and tracemalloc does not see torch's
allocator. :class:`LiveTensorBytes` is a TorchDispatchMode: every tensor an operator returns inside
the region is counted once per storage until that storage is freed, which a weakref finaliser
reports. An output that shares its storage with an input (a view, an in-place result) adds
nothing: that memory belongs to the input.

What it measures: bytes of tensor storages created in the region and alive at the same time,
autograd's saved tensors and gradients included. What it does not: tensors made before the region
(inputs, parameters), kernel workspaces and allocator rounding, so on a GPU it reads somewhat below
``max_memory_allocated``.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorBytes"]


def _storage(t) -> torch.UntypedStorage | None:
    """The storage of a dense tensor (None for non-tensors and tensors without one)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveTensorBytes(TorchDispatchMode):
    """with LiveTensorBytes() as m: ...; then m.peak_bytes (and m.live_bytes at exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._alive: dict[int, weakref.finalize] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(st) for st in map(_storage, tree_flatten((args, kwargs))[0]) if st is not None}
        for t in tree_flatten(out)[0]:
            storage = _storage(t)
            if storage is None:
                continue
            key = id(storage)
            if key in self._alive or key in inputs:
                continue
            nbytes = storage.nbytes()
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._alive[key] = weakref.finalize(storage, self._freed, key, nbytes)
        return out
