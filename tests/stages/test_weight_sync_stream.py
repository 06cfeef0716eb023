"""The engine's receiving thread (stages/sync/stream.py): two pipeline-rank senders (threads of this
process, gloo over 127.0.0.1) and one VersionStream. A version sent is handed over bit for bit with
its tag; a version never announced is answered at once (the engine loads it another way); after the
channel fails no call waits for a version that cannot come; at most ``keep`` versions are held."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.policy import build_stage, hf_state, load_hf_state
from stages.sync import WeightReceiver, WeightSender, WeightSyncConfig, state_digest
from stages.sync.plan import tensor_specs
from stages.sync.stream import VersionStream
from stages.tcp_store import free_port

TIMEOUT_S = 5.0


@pytest.fixture
def channel():
    """(versions v1..v3 as full state dicts, per-rank state of each, the senders, the stream)."""
    model_cfg = make_decoder_config(tie_word_embeddings=True)
    versions = {v: hf_state(make_model(model_cfg, seed=v)) for v in (1, 2, 3)}
    stages = [build_stage(model_cfg, pp, 2) for pp in range(2)]
    shards = {v: [] for v in versions}
    for v, full in versions.items():
        for stage in stages:
            load_hf_state(stage, full)
            shards[v].append(hf_state(stage))
    sync = WeightSyncConfig(f"tcp://127.0.0.1:{free_port()}", num_sources=2, num_engines=1, bucket_bytes=4096,
                            timeout_s=TIMEOUT_S)
    specs = tensor_specs(versions[1])
    stream = VersionStream(lambda: WeightReceiver.connect(sync, 0, specs), keep=2)
    senders: list = [None, None]

    def connect(pp: int) -> None:
        senders[pp] = WeightSender.connect(sync, pp, shards[1][pp])

    threads = [threading.Thread(target=connect, args=(pp,)) for pp in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    assert all(senders), "the senders did not connect"
    yield versions, shards, senders, stream
    stream.close()
    for s in senders:
        s.close()


def _send(senders, shards, version: int) -> None:
    def one(pp: int) -> None:
        senders[pp].announce(version)
        senders[pp].send(shards[version][pp], version)

    threads = [threading.Thread(target=one, args=(pp,)) for pp in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)


def test_a_sent_version_is_handed_over_bit_for_bit_and_an_unsent_one_at_once(channel):
    versions, shards, senders, stream = channel
    t0 = time.monotonic()
    got, why = stream.take(1, TIMEOUT_S)  # nothing announced yet: answered without waiting
    assert got is None and why == "v1 was not sent on this channel"
    assert time.monotonic() - t0 < 1.0
    _send(senders, shards, 1)
    _send(senders, shards, 2)
    got, why = stream.take(1, TIMEOUT_S)
    assert why == "" and got.tag.version == 1 and got.tag.content_hash == state_digest(versions[1])
    assert got.tensors.keys() == versions[1].keys()
    assert all(torch.equal(got.tensors[k], versions[1][k]) for k in versions[1])
    got2, _ = stream.take(2, TIMEOUT_S)
    assert all(torch.equal(got2.tensors[k], versions[2][k]) for k in versions[2])
    # Copies, not views of the receive buffers: no storage shared, and v1 is intact after v2.
    assert not {t.data_ptr() for t in got.tensors.values()} & {t.data_ptr() for t in got2.tensors.values()}
    assert all(torch.equal(got.tensors[k], versions[1][k]) for k in versions[1])
    assert got2.stats.num_bytes == sum(t.numel() * t.element_size() for t in versions[2].values())
    # Taking v2 dropped v1: a step never asks for an older version than its predecessor.
    assert stream.take(1, TIMEOUT_S)[0] is None


def test_at_most_keep_versions_are_held(channel):
    versions, shards, senders, stream = channel
    for v in (1, 2, 3):
        _send(senders, shards, v)
    deadline = time.monotonic() + TIMEOUT_S
    while 3 not in stream._received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(stream._received) == [2, 3]


def test_after_the_channel_fails_no_take_waits(channel):
    versions, shards, senders, stream = channel
    _send(senders, shards, 1)
    assert stream.take(1, TIMEOUT_S)[0] is not None
    senders[0].announce(2)  # announced, then pp=0 dies before sending: its sockets close
    senders[0].close()
    t0 = time.monotonic()
    got, why = stream.take(2, TIMEOUT_S)
    # pp=1 waits in its header broadcast for pp=0's group to form: the engine sees pp=0 gone at once.
    assert got is None and why.startswith(("the channel failed before v2 arrived", "the channel is closed")), why
    assert "from pp=0 failed" in why
    assert time.monotonic() - t0 <= TIMEOUT_S + 2.0
    assert not stream.alive and stream.error
    assert stream.take(3, TIMEOUT_S) == (None, f"the channel is closed ({stream.error})")
