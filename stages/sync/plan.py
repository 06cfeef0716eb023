"""What a weight sync moves, agreed before any byte moves: signatures, ownership, buckets, digests.

Each pipeline rank (a *source*) lists its HF-named tensors as ``(name, shape, dtype)`` specs; each
rollout engine lists the specs its model expects. :func:`plan_sync` checks that the two sides
describe the same model and fixes, for every source, the tensors it owns and their byte layout:

- a name held by several sources (a tied embedding lives on the first and the last pipeline
  stage) is owned by the lowest pipeline rank; its copies are equal after every optimiser step
  (stages/train/engine.py), so one is enough;
- a source's owned tensors, sorted by name, form one byte stream; each tensor starts at a
  multiple of ``_ALIGN_BYTES`` so the receiver can view it in place with its own dtype;
- the stream is cut into buckets of at most ``bucket_bytes``: a large tensor spans several
  buckets, several small tensors share one.

Every side computes the plan from the same table, so every side raises the same
:class:`SignatureMismatchError`. Pure arithmetic plus hashing: no process group here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = ["TensorSpec", "SourcePlan", "SyncPlan", "SignatureMismatchError", "tensor_specs", "plan_sync",
           "tensor_digest", "combine_digests", "state_digest"]

_ALIGN_BYTES = 16  # the widest element size (complex128) divides it: every in-place dtype view is legal
_MAX_LISTED = 3  # mismatches spelled out in an error; the rest are counted

TensorSpec = tuple[str, tuple[int, ...], str]
"""(HF name, shape, dtype without the ``torch.`` prefix)."""


class SignatureMismatchError(ValueError):
    """The training ranks and the rollout engines do not describe the same model."""


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of a state dict, sorted by name."""
    return [(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in sorted(tensors.items())]


def _nbytes(spec: TensorSpec) -> int:
    _, shape, dtype = spec
    numel = 1
    for d in shape:
        numel *= d
    return numel * getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class SourcePlan:
    """The tensors one pipeline rank sends and where their bytes sit in its stream."""

    source: int
    specs: tuple[TensorSpec, ...]
    """Owned tensors, sorted by name."""
    offsets: tuple[int, ...]
    """Byte offset of each tensor in the stream (multiples of 16)."""
    stream_bytes: int
    """Stream length including alignment padding: the receiver's buffer for this source."""
    bucket_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(_nbytes(s) for s in self.specs)

    @property
    def num_buckets(self) -> int:
        return -(-self.stream_bytes // self.bucket_bytes)

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        lo = bucket * self.bucket_bytes
        return lo, min(lo + self.bucket_bytes, self.stream_bytes)

    def segments(self, bucket: int) -> list[tuple[int, int, int]]:
        """(tensor index, first byte within the tensor, byte count) of the tensors overlapping a
        bucket, in stream order; padding between tensors is not listed."""
        lo, hi = self.bucket_range(bucket)
        out = []
        for i, (spec, off) in enumerate(zip(self.specs, self.offsets)):
            end = off + _nbytes(spec)
            if end <= lo or off >= hi:
                continue
            a, b = max(lo, off), min(hi, end)
            out.append((i, a - off, b - a))
        return out


@dataclass(frozen=True)
class SyncPlan:
    sources: tuple[SourcePlan, ...]
    digest: int
    """63-bit fingerprint of the plan; every sync's header carries it, so a peer that planned
    differently is refused before its bytes are read."""

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.sources)

    @property
    def num_buckets(self) -> int:
        return sum(s.num_buckets for s in self.sources)


def _layout(source: int, specs: list[TensorSpec], bucket_bytes: int) -> SourcePlan:
    offsets, pos = [], 0
    for spec in specs:
        pos = -(-pos // _ALIGN_BYTES) * _ALIGN_BYTES
        offsets.append(pos)
        pos += _nbytes(spec)
    return SourcePlan(source, tuple(specs), tuple(offsets), pos, bucket_bytes)


def _fmt(spec: TensorSpec) -> str:
    return f"{list(spec[1])} {spec[2]}"


def _mismatches(senders: Sequence[Sequence[TensorSpec]], engines: Sequence[Sequence[TensorSpec]],
                backends: Mapping[str, str]) -> list[str]:
    problems = []
    if len(set(backends.values())) > 1:
        problems.append("backends differ (" + ", ".join(f"{k}: {v}" for k, v in backends.items())
                        + "): put every side on the same device type or set sync.backend")
    for e, specs in enumerate(engines[1:], start=1):
        if list(specs) != list(engines[0]):
            problems.append(f"engine {e} expects a different model than engine 0")
    held: dict[str, tuple[int, TensorSpec]] = {}
    for p, specs in enumerate(senders):
        for spec in specs:
            first = held.setdefault(spec[0], (p, spec))
            if first[1] != spec:
                problems.append(f"{spec[0]} is {_fmt(first[1])} on pp={first[0]} but {_fmt(spec)} on pp={p}")
    expected = {spec[0]: spec for spec in (engines[0] if engines else [])}
    for name in sorted(held.keys() | expected.keys()):
        if name not in expected:
            problems.append(f"pp={held[name][0]} sends {name} {_fmt(held[name][1])}, which the engines do not expect")
        elif name not in held:
            problems.append(f"the engines expect {name} {_fmt(expected[name])}, which no training rank holds")
        elif held[name][1] != expected[name]:
            problems.append(f"pp={held[name][0]} sends {name} as {_fmt(held[name][1])}, "
                            f"the engines expect {_fmt(expected[name])}")
    return problems


def plan_sync(senders: Sequence[Sequence[TensorSpec]], engines: Sequence[Sequence[TensorSpec]],
              bucket_bytes: int, backends: Mapping[str, str] | None = None) -> SyncPlan:
    """The plan of a channel with ``len(senders)`` pipeline ranks and ``len(engines)`` engines.

    ``backends`` maps a side's description to the backend it chose; they must agree.
    Raises :class:`SignatureMismatchError` (one line, the same on every side) when the sides
    describe different models.
    """
    if bucket_bytes < _ALIGN_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be at least {_ALIGN_BYTES}")
    problems = _mismatches(senders, engines, backends or {})
    if problems:
        more = len(problems) - _MAX_LISTED
        listed = "; ".join(problems[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
        raise SignatureMismatchError(f"weight sync: the training ranks and the rollout engines disagree on the "
                                     f"model: {listed}; build both from the same HF config.json and dtype")
    owner: dict[str, int] = {}
    for p, specs in enumerate(senders):
        for spec in specs:
            owner.setdefault(spec[0], p)
    sources = tuple(_layout(p, sorted(s for s in specs if owner[s[0]] == p), bucket_bytes)
                    for p, specs in enumerate(senders))
    text = json.dumps([[s.specs, s.offsets, s.bucket_bytes] for s in sources])
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    return SyncPlan(sources, digest)


# -- content digests ------------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor) -> bytes:
    """sha256 of a tensor's raw bytes (row-major, native byte order)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.cpu().numpy())).digest()


def combine_digests(specs: Sequence[TensorSpec], digests: Sequence[bytes]) -> str:
    """The content hash of a state dict from its tensors' digests: sha256 over the name-sorted
    ``name shape dtype digest`` lines, independent of how the tensors were split across ranks."""
    lines = sorted(f"{name} {list(shape)} {dtype} {d.hex()}\n" for (name, shape, dtype), d in zip(specs, digests))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The content hash of a whole state dict, as a weight sync computes it."""
    names = sorted(tensors)
    return combine_digests(tensor_specs(tensors), [tensor_digest(tensors[n]) for n in names])
