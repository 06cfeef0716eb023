"""Weight sync: in memory (stages/sync) vs through disk (storage/policies), seconds and bytes.

Two pipeline ranks hold the halves of a model and one rollout engine needs the whole of it. Each
path is timed from "the training ranks hold the new weights" to "the engine's model holds them":

  memory        local processes: each pp rank WeightSender.send, the engine VersionedEngine.sync
                (receive + load_hf_state); the engine's seconds, which include waiting for the
                senders; per sync.content_hash: verify (a sha256 per tensor on the pp ranks,
                checked on the engine), send (the engine only combines the ranks' digests),
                none (no hashing)
  disk          in this process: each pp rank's PolicyStore.save_shard (timed apart; the larger
                counts, as the ranks write in parallel), finalize_policy (index, manifest, the
                sha256 of the shards), load_model_folder + load_hf_state on the engine's model.
                The files are fresh in the page cache, so the read side is a memory copy plus
                safetensors parsing: a lower bound of a real reload

Medians over ``--reps`` versions; the first memory sync (connection warm-up) is not counted.

    .venv/bin/python benchmarks/weight_sync.py [--reps 5] [--bucket-mib 32]
"""

from __future__ import annotations

import argparse
import pickle
import queue
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as tmp

from stages.policy import DecoderConfig, build_stage, hf_state, load_hf_state
from stages.sync import VersionedEngine, WeightReceiver, WeightSender, WeightSyncConfig
from storage.policies import PolicyStore, load_model_folder

MODELS = {
    # configs/tiny.yaml (vocabulary of the addition task)
    "tiny (h64, 4 layers)": DecoderConfig(vocab_size=15, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "h512, 8 layers": DecoderConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=8, head_dim=64),
}
_START_S = 120.0  # process start-up on a loaded machine, on top of the syncs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _versions(cfg: DecoderConfig, n: int) -> list[dict[str, torch.Tensor]]:
    model = build_stage(cfg)
    out = []
    for v in range(n):
        model.init_weights(torch.Generator().manual_seed(v))
        out.append(hf_state(model))
    return out


def _sender(sync: WeightSyncConfig, cfg: DecoderConfig, pp: int, num_versions: int, results) -> None:
    torch.set_num_threads(1)
    versions = _versions(cfg, num_versions)  # built here: a tensor per fd would not pass to the process
    stage = build_stage(cfg, pp, sync.num_sources)
    load_hf_state(stage, versions[0])
    sender = WeightSender.connect(sync, pp, hf_state(stage))
    stats = []
    for v, full in enumerate(versions):
        load_hf_state(stage, full)
        stats.append(sender.send(hf_state(stage), v))
    results.put(("sender", pp, pickle.dumps(stats)))


def _engine(sync: WeightSyncConfig, cfg: DecoderConfig, num_syncs: int, results) -> None:
    torch.set_num_threads(1)
    engine = VersionedEngine(build_stage(cfg))
    receiver = WeightReceiver.connect(sync, 0, hf_state(engine.model))
    stats = [engine.sync(receiver) for _ in range(num_syncs)]
    results.put(("engine", 0, pickle.dumps(stats)))


def memory_sync(cfg: DecoderConfig, num_versions: int, bucket_bytes: int, content_hash: str) -> dict[str, list]:
    sync = WeightSyncConfig(f"tcp://127.0.0.1:{_free_port()}", num_sources=2, num_engines=1,
                            bucket_bytes=bucket_bytes, timeout_s=60.0, content_hash=content_hash)
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["stages.sync"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(sync, cfg, pp, num_versions, results)) for pp in range(2)]
    procs.append(ctx.Process(target=_engine, args=(sync, cfg, num_versions, results)))
    for p in procs:
        p.start()
    out: dict[str, list] = {"sender": [], "engine": []}
    deadline = time.monotonic() + _START_S + 10 * num_versions
    while sum(map(len, out.values())) < len(procs):
        try:
            role, _, data = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError("a weight sync process did not report; see its output above") from None
        out[role].append(pickle.loads(data))
    for p in procs:
        p.join()
    return out


def disk_sync(cfg: DecoderConfig, versions) -> dict[str, list[float]]:
    halves = [set(hf_state(build_stage(cfg, pp, 2)).keys()) for pp in range(2)]
    engine = build_stage(cfg)
    out: dict[str, list[float]] = {"write": [], "finalize": [], "load": [], "bytes": []}
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as root:
        store = PolicyStore(root)
        for v, full in enumerate(versions):
            writes = []
            for pp, names in enumerate(halves):
                t0 = time.perf_counter()
                store.save_shard(v, pp, 2, {n: full[n] for n in names})
                writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = store.finalize_policy(v, cfg.to_hf(), "{}", 2)
            t1 = time.perf_counter()
            _, _, tensors = load_model_folder(ref.path)
            load_hf_state(engine, tensors)
            t2 = time.perf_counter()
            out["write"].append(max(writes))
            out["finalize"].append(t1 - t0)
            out["load"].append(t2 - t1)
            out["bytes"].append(ref.num_bytes)
            store.remove_from(v)
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mib", type=float, default=32.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bucket = int(args.bucket_mib * 2**20)
    modes = ("verify", "send", "none")
    rows = []
    for name, cfg in MODELS.items():
        versions = _versions(cfg, args.reps + 1)
        payload = sum(t.numel() * t.element_size() for t in versions[0].values())
        mem = {mode: memory_sync(cfg, args.reps + 1, bucket, mode) for mode in modes}
        disk = disk_sync(cfg, versions)
        engine_s = {mode: _median([s.seconds for s in mem[mode]["engine"][0]]) for mode in modes}
        hash_s = _median([s.hash_seconds for s in mem["verify"]["engine"][0]])
        buckets = mem["verify"]["engine"][0][0].num_buckets
        d_total = _median([w + f + lo for w, f, lo in zip(disk["write"], disk["finalize"], disk["load"])])
        rows.append((name, payload, buckets, engine_s, hash_s, disk["bytes"][0],
                     [_median(disk[k]) for k in ("write", "finalize", "load")], d_total))
    print(f"bucket {args.bucket_mib:g} MiB, 2 pp ranks -> 1 engine, gloo on 127.0.0.1, median of {args.reps}; "
          "seconds until the engine's model holds the version")
    print(f"{'model':21} {'MiB':>7} {'bkts':>4} | {'verify':>7} {'(hash)':>7} {'send':>7} {'none':>7} | "
          f"{'file MiB':>8} {'write':>6} {'final':>6} {'load':>6} {'disk':>7} | disk / memory: verify send none")
    for name, payload, buckets, mem_s, hash_s, fbytes, (w, f, lo), d in rows:
        print(f"{name:21} {payload / 2**20:7.2f} {buckets:4d} | {mem_s['verify']:7.4f} {hash_s:7.4f} "
              f"{mem_s['send']:7.4f} {mem_s['none']:7.4f} | {fbytes / 2**20:8.2f} {w:6.4f} {f:6.4f} {lo:6.4f} "
              f"{d:7.4f} | {d / mem_s['verify']:20.1f} {d / mem_s['send']:4.1f} {d / mem_s['none']:4.1f}")


if __name__ == "__main__":
    main()
