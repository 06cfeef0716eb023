"""In-memory weight sync: two pipeline ranks of a tiny decoder broadcast to one or two engines
(gloo, local processes). After a sync the engine's weights equal the trainers' bit for bit and its
tag carries the version and the content hash of an independent full-model hash; a signature
mismatch, a missing peer, a dying or stalling sender and bytes that do not match their digests end
every side within the timeout with a one-line error; a wrong version is refused."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time

import pytest
import torch
import torch.multiprocessing as tmp

from conftest import make_decoder_config, make_model
from stages.policy import build_stage, hf_state, load_hf_state
from stages.rollout import SamplingParams
from stages.rollout.contract import PolicyVersionError, PolicyWeights, RolloutEngine
from stages.rollout.native import NativeEngine
from stages.sync import (PolicyTag, SignatureMismatchError, WeightReceiver, WeightSender, WeightSyncConfig, plan_sync,
                         state_digest, tensor_specs)
from stages.sync import channel
from stages.sync.channel import _Endpoint

TIMEOUT_S = 4.0
SLACK_S = 4.0  # a loaded 2-core machine: process start-up, scheduling
_START_S = 30.0  # forkserver start and imports, on top of the timeouts


# -- the process harness ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(index: int, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        out = {"value": fn(*args), "error": None}
    except Exception as exc:
        out = {"value": None, "error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = time.monotonic() - t0
    # Plain pickle: tensors travel as bytes, not as shared memory that dies with this process.
    results.put((index, pickle.dumps(out)))


def _run(targets: list[tuple], limit_s: float, wait_for: set[int] | None = None) -> list[dict | None]:
    """Run fn(*args) of each target in its own process; None for a process that returned nothing.
    Once the processes in ``wait_for`` (default: all) have reported, the others get a second to
    report and are then killed."""
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["stages.sync", "stages.policy"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, fn, args, results)) for i, (fn, args) in enumerate(targets)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    wait_for = set(range(len(procs))) if wait_for is None else wait_for
    deadline = time.monotonic() + limit_s
    while not wait_for <= out.keys() and time.monotonic() < deadline:
        try:
            i, result = results.get(timeout=0.2)
            out[i] = pickle.loads(result)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    deadline = min(deadline, time.monotonic() + 1.0)
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    return [out.get(i) for i in range(len(procs))]


def _config(num_engines: int = 1, bucket_bytes: int = 3000, content_hash: str = "verify") -> WeightSyncConfig:
    return WeightSyncConfig(f"tcp://127.0.0.1:{_free_port()}", num_sources=2, num_engines=num_engines,
                            bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S, content_hash=content_hash)


# -- process bodies -----------------------------------------------------------------------------------
def _trainer(cfg: WeightSyncConfig, model_cfg, pp: int, versions: list[dict], fail_after: int | None = None,
             fail: str = "exit"):
    """Pipeline rank ``pp`` of a 2-stage split: load each version's weights, send it. With
    ``fail_after``, the process exits abruptly (or stalls) after that many broadcasts."""
    stage = build_stage(model_cfg, pp, 2)
    load_hf_state(stage, versions[0])
    sender = WeightSender.connect(cfg, pp, hf_state(stage))
    if fail == "corrupt":  # digests of other bytes than those sent
        channel._StreamHash.digests = lambda self: [bytes(32)] * len(self.hashers)
    if fail_after is not None:
        calls, broadcast = [0], _Endpoint._broadcast

        def failing(self, source, tensor):
            calls[0] += 1
            if calls[0] > fail_after:
                if fail == "stall":
                    time.sleep(10 * TIMEOUT_S)
                os._exit(3)
            return broadcast(self, source, tensor)

        _Endpoint._broadcast = failing
    stats = []
    for v, full in enumerate(versions, start=1):
        load_hf_state(stage, full)
        stats.append(sender.send(hf_state(stage), version=v))
    return stats


def _engine(cfg: WeightSyncConfig, model_cfg, num_syncs: int, index: int = 0):
    """A native engine receiving ``num_syncs`` versions over the channel and loading each one."""
    native = NativeEngine(model=make_model(model_cfg, seed=99))
    engine = RolloutEngine(native)
    receiver = WeightReceiver.connect(cfg, index, hf_state(native.model))
    out = []
    for _ in range(num_syncs):
        tag, tensors, stats = receiver.receive()
        engine.load(PolicyWeights(tag.version, "", tensors=tensors, content_hash=tag.content_hash))
        refused = None
        try:
            engine.require(engine.version - 1)
        except PolicyVersionError as exc:
            refused = str(exc)
        out.append((tag, hf_state(native.model), stats, refused))
    return out


# -- tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_engines,content_hash", [(1, "verify"), (2, "send"), (1, "none")])
def test_engines_hold_the_trainers_weights_bit_for_bit(num_engines, content_hash):
    model_cfg = make_decoder_config(tie_word_embeddings=True)  # the tied embedding sits on both pp ranks
    versions = [hf_state(make_model(model_cfg, seed=s)) for s in (1, 2)]
    cfg = _config(num_engines, content_hash=content_hash)
    out = _run([(_trainer, (cfg, model_cfg, 0, versions)), (_trainer, (cfg, model_cfg, 1, versions))]
               + [(_engine, (cfg, model_cfg, 2, e)) for e in range(num_engines)], limit_s=_START_S + 4 * TIMEOUT_S)
    assert all(o is not None and o["error"] is None for o in out), out
    s0, s1 = out[0]["value"], out[1]["value"]
    received = [(v, full, r) for o in out[2:] for v, (full, r) in enumerate(zip(versions, o["value"]), start=1)]
    assert len(received) == 2 * num_engines
    for v, full, (tag, state, stats, refused) in received:
        assert state.keys() == full.keys()
        assert all(torch.equal(state[k], full[k]) for k in full)
        assert tag == PolicyTag(v, state_digest(full) if content_hash != "none" else "")
        payload = sum(t.numel() * t.element_size() for t in full.values())
        assert stats.num_bytes == payload  # the embedding once, though two ranks hold it
        assert s0[v - 1].num_bytes + s1[v - 1].num_bytes == payload
        assert stats.num_buckets == s0[v - 1].num_buckets + s1[v - 1].num_buckets >= payload // 3000
        assert refused == f"the step asks for policy v{v - 1}, the rollout engine holds v{v}: sync v{v - 1} " \
                          "to the engine before generating"


def test_a_signature_mismatch_fails_every_side_with_the_same_message():
    model_cfg = make_decoder_config()
    versions = [hf_state(make_model(model_cfg, seed=1))]
    cfg = _config()
    out = _run([(_trainer, (cfg, model_cfg, 0, versions)), (_trainer, (cfg, model_cfg, 1, versions)),
                (_engine, (cfg, make_decoder_config(intermediate_size=40), 1))], limit_s=_START_S + 2 * TIMEOUT_S)
    errors = [o["error"] for o in out]
    assert all(e is not None and e.startswith("SignatureMismatchError") for e in errors), errors
    assert len(set(errors)) == 1 and "\n" not in errors[0]
    assert "pp=0 sends model.layers.0.mlp.down_proj.weight as [32, 48] float32, the engines expect [32, 40] " \
           "float32" in errors[0]
    assert all(o["seconds"] < TIMEOUT_S + SLACK_S for o in out), [o["seconds"] for o in out]


@pytest.mark.parametrize("fail", ["exit", "stall"])
def test_a_sender_failing_mid_sync_fails_the_engine_within_the_timeout(fail):
    model_cfg = make_decoder_config()
    versions = [hf_state(make_model(model_cfg, seed=1))]
    cfg = _config(bucket_bytes=1024)
    out = _run([(_trainer, (cfg, model_cfg, 0, versions)), (_trainer, (cfg, model_cfg, 1, versions, 4, fail)),
                (_engine, (cfg, model_cfg, 1))], limit_s=_START_S + 3 * TIMEOUT_S, wait_for={0, 2})
    assert out[1] is None  # pp=1 died or stalled after its header and three buckets
    engine = out[2]
    assert engine is not None and engine["error"].startswith("WeightSyncError: weight sync receiver engine 0: "
                                                             "receiving sync 0 (v1): bucket "), engine
    assert "from pp=1 failed" in engine["error"]
    if fail == "stall":  # gloo's own bound on the wait ("Timed out ..." or "Application timeout ...")
        assert "time" in engine["error"].split("failed: ")[1].lower() and engine["seconds"] > TIMEOUT_S, engine
    assert engine["seconds"] < TIMEOUT_S + SLACK_S
    assert out[0] is not None and out[0]["seconds"] < 2 * TIMEOUT_S + SLACK_S  # pp=0 ends too, whatever it saw


def test_a_missing_peer_fails_the_others_within_the_timeout():
    model_cfg = make_decoder_config()
    versions = [hf_state(make_model(model_cfg, seed=1))]
    cfg = _config()
    out = _run([(_trainer, (cfg, model_cfg, 0, versions)), (_engine, (cfg, model_cfg, 1))],  # no pp=1
               limit_s=_START_S + 2 * TIMEOUT_S)
    for o in out:
        assert o["error"].startswith(f"WeightSyncError: weight sync channel 'weights': pp=1 did not join within "
                                     f"{TIMEOUT_S} s"), o
        assert o["seconds"] < TIMEOUT_S + SLACK_S
    assert max(o["seconds"] for o in out) >= TIMEOUT_S  # the first to time out tells the other


def test_bytes_that_do_not_match_their_digests_are_refused():
    model_cfg = make_decoder_config()
    versions = [hf_state(make_model(model_cfg, seed=1))]
    cfg = _config()
    out = _run([(_trainer, (cfg, model_cfg, 0, versions)), (_trainer, (cfg, model_cfg, 1, versions, None, "corrupt")),
                (_engine, (cfg, model_cfg, 1))], limit_s=_START_S + 2 * TIMEOUT_S)
    assert out[0]["error"] is None and out[1]["error"] is None
    assert out[2]["error"] == ("WeightSyncError: weight sync receiver engine 0: sync 0 (v1): "
                               "lm_head.weight from pp=1 arrived corrupted (sha256 differs)")


def test_the_engine_refuses_a_version_it_does_not_hold():
    model_cfg = make_decoder_config()
    native = NativeEngine(model=make_model(model_cfg, seed=0))
    engine = RolloutEngine(native)
    with pytest.raises(PolicyVersionError, match="^the step asks for policy v0, the rollout engine holds no policy"):
        engine.require(0)
    new = hf_state(make_model(model_cfg, seed=5))
    engine.load(PolicyWeights(3, "", tensors=new, content_hash=state_digest(new)))
    params = SamplingParams(group_size=2, max_new_tokens=3)
    with pytest.raises(PolicyVersionError, match=r"^the step asks for policy v4, the rollout engine holds v3: "):
        engine.generate(4, [[1, 5, 6]], params, seed=0)
    batch = engine.generate(3, [[1, 5, 6]], params, seed=0)
    assert batch.tokens.shape == (2, 3) and batch.policy_version == 3
    assert all(torch.equal(t, new[k]) for k, t in hf_state(native.model).items())
    broken = {k: v for k, v in new.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        engine.load(PolicyWeights(4, "", tensors=broken))
    assert engine.version is None  # half-loaded weights hold no version
    with pytest.raises(PolicyVersionError, match="holds no policy"):
        engine.require(3)


# -- the plan, in-process -----------------------------------------------------------------------------
def test_buckets_cover_every_byte_once_and_the_tied_embedding_is_sent_once():
    model_cfg = make_decoder_config(tie_word_embeddings=True)
    full = hf_state(make_model(model_cfg))
    shards = []
    for pp in range(2):
        stage = build_stage(model_cfg, pp, 2)
        load_hf_state(stage, full)
        shards.append(tensor_specs(hf_state(stage)))
    assert "model.embed_tokens.weight" in {s[0] for s in shards[1]}  # the last stage's tied head
    plan = plan_sync(shards, [tensor_specs(full)], bucket_bytes=1000)
    assert "model.embed_tokens.weight" not in {s[0] for s in plan.sources[1].specs}
    assert plan.payload_bytes == sum(t.numel() * 4 for t in full.values())
    for src in plan.sources:
        covered = {i: 0 for i in range(len(src.specs))}
        for b in range(src.num_buckets):
            lo, hi = src.bucket_range(b)
            assert 0 < hi - lo <= 1000
            for i, start, count in src.segments(b):
                assert start == covered[i] and src.offsets[i] + start >= lo  # in order, inside the bucket
                covered[i] += count
        sizes = [torch.Size(shape).numel() * 4 for _, shape, _ in src.specs]
        assert list(covered.values()) == sizes and all(off % 16 == 0 for off in src.offsets)
    with pytest.raises(SignatureMismatchError, match="which no training rank holds"):
        plan_sync([shards[0]], [tensor_specs(full)], bucket_bytes=1000)
    with pytest.raises(SignatureMismatchError, match="backends differ"):
        plan_sync(shards, [tensor_specs(full)], 1000, {"pp=0": "gloo", "engine 0": "nccl"})
