"""In-memory weight sync from the training pipeline ranks to the rollout engines.

Topology. P *sources* (the training ranks with dp = tp = 0, one per pipeline rank) and E engines.
Each source p has a process group of its own, {source p (group rank 0), engine 0 .. E-1 (group
ranks 1 .. E)}: every source broadcasts its shard in its own group, so the P shards travel
concurrently and no training rank receives another's bytes. An engine joins all P groups and
receives straight into one preallocated buffer per source.

Rendezvous (stages/sync/rendezvous.py). Pipeline rank 0 hosts a TCPStore at ``init_method`` (a
port of its own, not the training world's). ``connect`` posts this side's signature (HF names,
shapes, dtypes, backend) there, waits up to ``timeout_s`` for every other side's, and plans the
sync (stages/sync/plan.py): on disagreement every side raises the same SignatureMismatchError.

One sync, in every group: a header (int64 [magic, sync index, policy version, plan digest,
status]), the buckets of the source's byte stream, then (``content_hash``) the sha256 of each
tensor the source owns. The engine checks that every source sent the same version and the agreed
plan, checks every tensor's digest against the bytes it received, and tags the result with the
version and the content hash (:func:`stages.sync.plan.state_digest` of the whole state dict).

Failing loudly. Every wait is bounded: store waits by ``timeout_s``, gloo operations by the
group's timeout, NCCL ones by its watchdog. A peer that dies closes its sockets and the others
fail at once; one that stalls makes them fail at the timeout. A failed endpoint refuses later
calls: reconnect under a new ``channel`` name.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from stages.sync.config import PolicyTag, SyncStats, WeightSyncConfig, WeightSyncError
from stages.sync.plan import SyncPlan, TensorSpec, combine_digests, tensor_specs
from stages.sync.rendezvous import first_line, join, new_group, open_store, resolve_backend

__all__ = ["WeightSender", "WeightReceiver"]

_MAGIC = 0x5359_4E43_4750_52  # "GRPGCNYS": a header, not stray bytes of another stream
_OK, _REFUSED = 0, 1
_DIGEST_BYTES = 32  # sha256
_IN_FLIGHT = 2  # a sender fills one staging buffer while the other is on the wire


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _StreamHash:
    """sha256 of each tensor of a source, fed bucket by bucket while later buckets are on the
    wire; a tensor's segments arrive in order, so the result is :func:`tensor_digest`."""

    def __init__(self, count: int):
        self.hashers = [hashlib.sha256() for _ in range(count)]
        self.seconds = 0.0

    def update(self, segments: list[tuple[int, int, int]], byte_views: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for i, start, count in segments:
            part = byte_views[i][start:start + count]
            self.hashers[i].update(memoryview(part.cpu().numpy()))
        self.seconds += time.perf_counter() - t0

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self.hashers]


class _Endpoint:
    def __init__(self, cfg: WeightSyncConfig, plan: SyncPlan, store: dist.Store, groups: dict[int, dist.ProcessGroup],
                 device: torch.device, where: str):
        self.cfg, self.plan, self.device, self.where = cfg, plan, device, where
        self._store, self._groups = store, groups  # the store host keeps serving while this lives
        self._syncs = 0
        self._failed: Optional[str] = None

    @property
    def syncs_done(self) -> int:
        return self._syncs

    def _usable(self) -> None:
        if self._failed:
            raise WeightSyncError(f"{self.where}: this weight sync channel failed earlier ({self._failed}); "
                                  "reconnect under a new sync channel name")

    def _fail(self, message: str) -> WeightSyncError:
        self._failed = message
        return WeightSyncError(f"{self.where}: {message}")

    def _broadcast(self, source: int, tensor: torch.Tensor) -> dist.Work:
        return self._groups[source].broadcast([tensor], dist.BroadcastOptions())

    def _sync_clock(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _store_op(self, what: str, op):
        try:
            return op()
        except Exception as exc:
            raise self._fail(f"{what}: the channel's store is gone (pipeline rank 0 hosts it): "
                             f"{first_line(exc)}") from exc

    def was_announced(self, version: int) -> bool:
        """Whether a source announced policy ``version`` on this channel (:meth:`WeightSender.announce`):
        a version never announced here will not arrive here. No wait."""
        self._usable()
        return self._store_op(f"looking up v{version}", lambda: self._store.check([f"version/{version}"]))

    def close(self) -> None:
        """Drop the groups (a peer blocked on them fails at its timeout or at once)."""
        self._groups.clear()
        self._failed = self._failed or "closed"


# -- the training side --------------------------------------------------------------------------------
class WeightSender(_Endpoint):
    """Pipeline rank ``pp_rank``'s end of the channel: broadcasts the tensors it owns."""

    @classmethod
    def connect(cls, cfg: WeightSyncConfig, pp_rank: int, tensors: Mapping[str, torch.Tensor]) -> "WeightSender":
        """Join the channel with this rank's HF-named tensors (names, shapes, dtypes and device are
        what counts; later syncs send tensors of the same signature)."""
        if not 0 <= pp_rank < cfg.num_sources:
            raise ValueError(f"pp_rank={pp_rank} is outside the channel's {cfg.num_sources} sources")
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(f"pp={pp_rank} holds tensors on several devices {sorted(map(str, devices))}; "
                             "send from one device")
        device = devices.pop() if devices else torch.device("cpu")
        backend = resolve_backend(cfg, device)
        store = open_store(cfg, host=pp_rank == 0)
        plan = join(cfg, store, f"pp={pp_rank}", tensor_specs(tensors), backend)
        where = f"weight sync sender pp={pp_rank}"
        try:
            group = new_group(backend, dist.PrefixStore(f"pg{pp_rank}/", store), 0, 1 + cfg.num_engines, cfg.timeout)
        except Exception as exc:
            raise WeightSyncError(f"{where}: the engines did not join its group within {cfg.timeout_s} s: "
                                  f"{first_line(exc)}") from exc
        return cls(cfg, plan, store, {pp_rank: group}, device, where, pp_rank, tensor_specs(tensors))

    def __init__(self, cfg: WeightSyncConfig, plan: SyncPlan, store: dist.Store, groups: dict[int, dist.ProcessGroup],
                 device: torch.device, where: str, pp_rank: int, specs: list[TensorSpec]):
        super().__init__(cfg, plan, store, groups, device, where)
        self.pp_rank, self._specs = pp_rank, specs
        slot_bytes = min(cfg.bucket_bytes, plan.sources[pp_rank].stream_bytes)
        self._staging = [torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(_IN_FLIGHT)]

    def announce(self, version: int) -> None:
        """Post in the channel's store that the next sync carries policy ``version``, before its
        bytes: an idle receiver posts its receive only once it sees this (:meth:`WeightReceiver.announced`),
        so it never sits in a broadcast bounded by the timeout while the trainer computes. Every
        source announces; the keys are idempotent."""
        self._usable()
        n = self._syncs
        self._store_op(f"announcing v{version}", lambda: (self._store.set(f"announce/{n}", str(version)),
                                                          self._store.set(f"version/{version}", str(n))))

    def send(self, tensors: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Broadcast this rank's shard of policy ``version``; every engine must be receiving."""
        self._usable()
        t0 = time.perf_counter()
        n, source = self._syncs, self.plan.sources[self.pp_rank]
        specs = tensor_specs(tensors)
        refused = None
        if specs != self._specs:
            now, then = set(specs) - set(self._specs), set(self._specs) - set(specs)
            refused = (f"sync {n}: its tensors differ from those it connected with (now {sorted(now)[:1]}, "
                       f"then {sorted(then)[:1]}); send the same HF names, shapes and dtypes every time")
        header = torch.tensor([_MAGIC, n, version, self.plan.digest, _REFUSED if refused else _OK],
                              dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(self.pp_rank, header), f"sync {n} (v{version}): the header")
        if refused:
            raise self._fail(refused)
        flats = [_byte_view(tensors[name]) for name, _, _ in source.specs]
        hashes = _StreamHash(len(source.specs))
        pending: deque = deque()
        staged = 0
        for b in range(source.num_buckets):
            if len(pending) >= _IN_FLIGHT:
                self._wait(pending.popleft(), f"sync {n} (v{version}): bucket {b - _IN_FLIGHT}")
            lo, hi = source.bucket_range(b)
            segments = source.segments(b)
            if len(segments) == 1 and segments[0][2] == hi - lo:  # inside one tensor: send its bytes in place
                i, start, count = segments[0]
                buf = flats[i][start:start + count]
            else:
                buf = self._staging[staged % _IN_FLIGHT][: hi - lo]
                staged += 1
                for i, start, count in segments:
                    at = source.offsets[i] + start - lo
                    buf[at:at + count].copy_(flats[i][start:start + count])
            pending.append(self._broadcast(self.pp_rank, buf))
            if self.cfg.hashing:  # while this bucket is on the wire
                hashes.update(segments, flats)
        while pending:
            self._wait(pending.popleft(), f"sync {n} (v{version}): the last buckets")
        if self.cfg.hashing and source.specs:
            table = torch.frombuffer(bytearray(b"".join(hashes.digests())), dtype=torch.uint8).to(self.device)
            self._wait(self._broadcast(self.pp_rank, table), f"sync {n} (v{version}): the digests")
        self._sync_clock()
        self._syncs += 1
        return SyncStats(version, source.payload_bytes, source.num_buckets, time.perf_counter() - t0,
                         hashes.seconds)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self._fail(f"sending {what} to the engines failed: {first_line(exc)}") from exc


# -- the rollout side ---------------------------------------------------------------------------------
class WeightReceiver(_Endpoint):
    """Engine ``engine_index``'s end of the channel: receives every source's shard."""

    @classmethod
    def connect(cls, cfg: WeightSyncConfig, engine_index: int,
                expected: Mapping[str, torch.Tensor] | Sequence[TensorSpec],
                device: torch.device | str = "cpu") -> "WeightReceiver":
        """Join the channel expecting the HF-named tensors of the engine's whole model (a state dict
        or its specs); received tensors live on ``device``."""
        if not 0 <= engine_index < cfg.num_engines:
            raise ValueError(f"engine_index={engine_index} is outside the channel's {cfg.num_engines} engines")
        device = torch.device(device)
        specs = tensor_specs(expected) if isinstance(expected, Mapping) else sorted(expected)
        backend = resolve_backend(cfg, device)
        store = open_store(cfg, host=False)
        plan = join(cfg, store, f"engine {engine_index}", specs, backend)
        where = f"weight sync receiver engine {engine_index}"
        groups = {}
        for p in range(cfg.num_sources):
            try:
                groups[p] = new_group(backend, dist.PrefixStore(f"pg{p}/", store), 1 + engine_index,
                                       1 + cfg.num_engines, cfg.timeout)
            except Exception as exc:
                raise WeightSyncError(f"{where}: the group of pp={p} did not form within {cfg.timeout_s} s: "
                                      f"{first_line(exc)}") from exc
        return cls(cfg, plan, store, groups, device, where)

    def __init__(self, cfg: WeightSyncConfig, plan: SyncPlan, store: dist.Store, groups: dict[int, dist.ProcessGroup],
                 device: torch.device, where: str):
        super().__init__(cfg, plan, store, groups, device, where)
        # One buffer per source, received into in place; the tensors are views of it.
        self._buffers = [torch.empty(s.stream_bytes, dtype=torch.uint8, device=device) for s in plan.sources]
        self._views: dict[str, torch.Tensor] = {}
        self._byte_views: list[list[torch.Tensor]] = []
        for s, buf in zip(plan.sources, self._buffers):
            self._byte_views.append([])
            for (name, shape, dtype), off in zip(s.specs, s.offsets):
                nbytes = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
                self._byte_views[-1].append(buf[off:off + nbytes])
                self._views[name] = buf[off:off + nbytes].view(getattr(torch, dtype)).view(shape)

    def announced(self) -> Optional[int]:
        """The policy version a source announced for the next sync, or None while none has (no wait:
        a timed-out store wait would hold the store's socket, and log a warning, each time)."""
        self._usable()
        key = f"announce/{self._syncs}"
        return self._store_op("looking for the next sync",
                              lambda: int(self._store.get(key)) if self._store.check([key]) else None)

    def receive(self) -> tuple[PolicyTag, dict[str, torch.Tensor], SyncStats]:
        """The next policy version: its tag, the whole HF-named state dict and the stats.

        The tensors are views of the receiver's buffers: load or copy them before the next call.
        """
        self._usable()
        t0 = time.perf_counter()
        n, sources = self._syncs, self.plan.sources
        headers = [torch.zeros(5, dtype=torch.int64, device=self.device) for _ in sources]
        works = [self._broadcast(s.source, h) for s, h in zip(sources, headers)]
        for s, w in zip(sources, works):
            self._wait(w, s.source, f"sync {n}: the header")
        version = self._check_headers([h.tolist() for h in headers], n)
        works = []
        for s, buf in zip(sources, self._buffers):
            for b in range(s.num_buckets):
                lo, hi = s.bucket_range(b)
                works.append((s.source, b, self._broadcast(s.source, buf[lo:hi])))
        tables = []
        if self.cfg.hashing:  # queued behind the buckets of each group
            tables = [torch.zeros(len(s.specs) * _DIGEST_BYTES, dtype=torch.uint8, device=self.device)
                      for s in sources]
            works += [(s.source, -1, self._broadcast(s.source, t)) for s, t in zip(sources, tables) if s.specs]
        hashes = [_StreamHash(len(s.specs)) for s in sources]
        for p, b, w in works:
            self._wait(w, p, f"sync {n} (v{version}): " + (f"bucket {b}" if b >= 0 else "the digests"))
            if self.cfg.content_hash == "verify" and b >= 0:  # while later buckets arrive
                hashes[p].update(sources[p].segments(b), self._byte_views[p])
        self._sync_clock()
        tag = PolicyTag(version)
        if self.cfg.hashing:
            tag = PolicyTag(version, self._content_hash(n, version, tables, hashes))
        self._syncs += 1
        stats = SyncStats(version, self.plan.payload_bytes, self.plan.num_buckets, time.perf_counter() - t0,
                          sum(h.seconds for h in hashes))
        return tag, dict(self._views), stats

    def _check_headers(self, headers: list[list[int]], n: int) -> int:
        for s, (magic, index, version, digest, status) in zip(self.plan.sources, headers):
            if magic != _MAGIC or digest != self.plan.digest:
                raise self._fail(f"sync {n}: pp={s.source} sent a header of another plan or protocol; "
                                 "every side must connect with the same sync config")
            if status == _REFUSED:
                raise self._fail(f"sync {n}: pp={s.source} refused to send v{version}: its tensors differ from "
                                 "those it connected with")
            if index != n:
                raise self._fail(f"sync {n}: pp={s.source} sends its sync {index}; a side skipped a sync")
        versions = {h[2] for h in headers}
        if len(versions) > 1:
            listed = ", ".join(f"pp={s.source} v{h[2]}" for s, h in zip(self.plan.sources, headers))
            raise self._fail(f"sync {n}: the pipeline ranks send different policy versions ({listed})")
        return versions.pop()

    def _content_hash(self, n: int, version: int, tables: list[torch.Tensor], hashes: list[_StreamHash]) -> str:
        """The sources' digests combined; with ``verify`` each is first checked against the bytes
        received."""
        specs, digests = [], []
        for s, table, own in zip(self.plan.sources, tables, hashes):
            sent = table.cpu().numpy().tobytes()
            for i, spec in enumerate(s.specs):
                digest = sent[i * _DIGEST_BYTES:(i + 1) * _DIGEST_BYTES]
                if self.cfg.content_hash == "verify" and own.hashers[i].digest() != digest:
                    raise self._fail(f"sync {n} (v{version}): {spec[0]} from pp={s.source} arrived corrupted "
                                     "(sha256 differs)")
                specs.append(spec)
                digests.append(digest)
        return combine_digests(specs, digests)

    def _wait(self, work: dist.Work, source: int, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self._fail(f"receiving {what} from pp={source} failed: {first_line(exc)}") from exc
