"""Every schedule and parallel layout computes the single-process full-batch gradient, and
measures what it did.

Each test spawns one set of rank processes and runs several calls in it (three loss aggregations,
a packed batch, the forward-only passes, an optimiser step with clipping): process start-up is
the cost here.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.config import LOSS_AGGREGATIONS
from stages.policy import hf_named_parameters, hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import TrainSetup
from stages.layout import SPLIT_BACKWARD
from stages.train.local import run_local_pipeline
from stages.train.loss import LossConfig, grpo_microbatch_loss, token_logp
from stages.train.plan import microbatch_layout
from stages.train.timeline import COMM_KINDS, chrome_events

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)
NUM_GROUPS, GROUP_SIZE, PROMPT_WIDTH, MAX_NEW = 4, 4, 5, 6
CALLS = ["grad"] * (len(LOSS_AGGREGATIONS) + 1) + ["reference", "proximal", "train"]
_PACKED = len(LOSS_AGGREGATIONS)  # the call index of the packed batch
_REF, _PROX, _TRAIN = range(len(CALLS) - 3, len(CALLS))


def full_batch_grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = grpo_microbatch_loss(model(batch.input_ids, **batch.stage_kwargs()), batch.target, LOSS)
    loss.backward()
    return {name: p.grad.clone() for name, p in hf_named_parameters(model)}


def make_batches(model):
    """One padded batch per aggregation mode, then a packed one with the same shape (a pipeline's
    shapes are fixed after its first step): 11-token rows, so one sequence each, but carrying the
    stage kwargs positions and doc ids (masked attention)."""
    arrays = make_rollout_arrays(model, num_groups=NUM_GROUPS, group_size=GROUP_SIZE, prompt_width=PROMPT_WIDTH,
                                 max_new_tokens=MAX_NEW)
    batches = [build_global_batch(arrays, mode, 0) for mode in LOSS_AGGREGATIONS]
    layout = microbatch_layout(NUM_GROUPS, GROUP_SIZE, PROMPT_WIDTH, MAX_NEW, 44, packing=True, pack_row_tokens=11)
    assert layout.num_microbatches == 4 and layout.total_rows == 16
    packed = build_global_batch(arrays, "token-mean", 0, layout)
    assert set(packed.stage_kwargs()) == {"positions", "doc_ids"}
    return batches + [packed] + [batches[0]] * 3


def merged(outputs, call: int, atol: float) -> dict[str, torch.Tensor]:
    """HF-named gradients of every rank; copies held by several ranks (tied embedding, DP and TP
    replicas) must agree."""
    got: dict[str, torch.Tensor] = {}
    for out in outputs:
        assert out.errors[call] is None, out.errors[call]
        for name, g in out.grads[call].items():
            if name in got:
                torch.testing.assert_close(got[name], g, rtol=0, atol=atol)
            got[name] = g
    return got


def worst_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(expected)
    return max((got[n] - expected[n]).abs().max().item() for n in expected)


def run_and_check(schedule: str, virtual: int = 1, dp: int = 1, tp: int = 1, tied: bool = False,
                  chunk_tokens: int | None = None, layer_split: tuple[int, ...] | None = None):
    """Run CALLS on a PP=2 layout and check gradients, log-probs and the clipped step; returns the
    outputs and the number of microbatches per rank. ``layer_split``: layers per stage (their sum is
    the model's; None: 4 layers split evenly)."""
    cfg = make_decoder_config(tie_word_embeddings=tied, num_hidden_layers=sum(layer_split) if layer_split else 4)
    model = make_model(cfg)
    batches = make_batches(model)
    expected = [full_batch_grads(model, b) for b in batches[:_PACKED + 1]]
    norm = torch.cat([g.reshape(-1) for g in expected[0].values()]).norm().item()
    m = 4 // dp
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule=schedule,
                       virtual_stages=virtual, data_parallel_size=dp, tensor_parallel_size=tp, loss=LOSS,
                       max_grad_norm=norm / 2, logprob_chunk_tokens=chunk_tokens, timeout_s=60,
                       layer_split=layer_split)
    outputs = run_local_pipeline(setup, hf_state(model), batches, calls=CALLS)
    tol = 1e-5 if tp > 1 else 1e-6
    for call, want in enumerate(expected):
        worst = worst_diff(merged(outputs, call, tol), want)
        assert worst <= tol, f"{schedule} dp={dp} tp={tp} call {call}: max abs gradient difference {worst:.2e}"
    assert max(g.abs().max().item() for g in expected[0].values()) > 1e-3  # a gradient worth comparing
    # The step clipped by the global norm over all ranks: grads are the full ones scaled to norm / 2.
    clipped = {n: g * (norm / 2) / (norm + 1e-6) for n, g in expected[0].items()}
    assert worst_diff(merged(outputs, _TRAIN, tol), clipped) <= tol
    for out in outputs:
        assert out.steps[_TRAIN].metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    check_forward_only(model, batches[0], outputs, tol=1e-4 if tp > 1 else 1e-6)
    check_weights_after_step(model, outputs)
    return outputs, m


def check_forward_only(model, batch, outputs, tol: float) -> None:
    with torch.no_grad():
        want = token_logp(model(batch.input_ids), batch.target[..., 0].long(), LOSS.temperature)
    for call in (_REF, _PROX):
        got = [out.logps[call] for out in outputs if out.logps[call] is not None]
        assert len(got) == 1  # only the output rank returns the (DP-gathered) log-probs
        torch.testing.assert_close(got[0], want, rtol=0, atol=tol)
        for out in outputs:  # forward-only: nothing stashed for a backward
            metrics = out.steps[call].metrics
            assert not any(k.startswith(("activation_bytes", "peak_inflight")) for k in metrics), metrics


def check_weights_after_step(model, outputs) -> None:
    """Copies of a weight (tied embedding, DP / TP replicas) stay identical and moved."""
    before = hf_state(model)
    state: dict[str, torch.Tensor] = {}
    for out in outputs:
        for name, w in out.state.items():
            if name in state:
                assert torch.equal(state[name], w), name  # bit for bit: a version stores one copy
            state[name] = w
    assert set(state) == set(before)
    assert any((state[n] - before[n]).abs().max() > 1e-5 for n in state)


def check_timeline(outputs, schedule: str, m: int) -> None:
    """Each stage ran m forwards and m backwards (B, or I then W), with its sends and receives."""
    for out in outputs:
        step = out.steps[0]
        stages = {a.stage for a in step.actions}
        for s in stages:
            kinds = [a.kind for a in step.actions if a.stage == s]
            assert kinds.count("F") == m, (schedule, s, kinds)
            assert kinds.count("B") + kinds.count("W") == m and kinds.count("I") == kinds.count("W"), kinds
            if schedule in SPLIT_BACKWARD and schedule != "dualpipev":
                assert kinds.count("I") == m
        comm = [a for a in step.actions if a.kind in COMM_KINDS]
        assert comm and all(a.peer >= 0 and a.end_ns >= a.start_ns for a in comm)
        assert 0.0 <= step.metrics["bubble_fraction"] < 1.0
        events = chrome_events(out.rank, step.actions, step.window_ns, origin_ns=step.window_ns[0])
        assert {e.get("cat") for e in events} >= {"F"} | {a.kind for a in comm}
        json.dumps(events)
        for s in stages:
            assert step.metrics[f"activation_bytes_per_microbatch_stage{s}"] > 0
        assert all(a.num_bytes > 0 for a in comm)
        assert step.metrics["p2p_send_bytes"] == sum(a.num_bytes for a in comm if a.kind.startswith("SEND"))
    # every byte sent is received
    sent, received = ({k: sum(a.num_bytes for out in outputs for a in out.steps[0].actions if a.kind == k)
                       for k in kinds} for kinds in (("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")))
    assert (sent["SEND_F"], sent["SEND_B"]) == (received["RECV_F"], received["RECV_B"]) and sent["SEND_F"] > 0


@pytest.mark.parametrize("schedule, virtual, tied, chunk_tokens", [
    ("gpipe", 1, False, None),
    ("1f1b", 1, True, None),
    ("interleaved-1f1b", 2, True, None),
    ("zb-h1", 1, False, None),
    ("zbv", 2, True, None),
    ("dualpipev", 2, False, 7),  # last stage returns hidden states, the loss applies the head in chunks
])
def test_schedule_gradient_equals_single_process(schedule, virtual, tied, chunk_tokens):
    outputs, m = run_and_check(schedule, virtual, tied=tied, chunk_tokens=chunk_tokens)
    check_timeline(outputs, schedule, m)
    peaks = {k: v for out in outputs for k, v in out.steps[0].metrics.items() if k.startswith("peak_inflight")}
    p = 2
    if schedule == "1f1b":  # warm-up of p - i forwards, then one in, one out
        assert peaks == {f"peak_inflight_stage{i}": min(m, p - i) for i in range(p)}
        # Stage 0 sends m activations, stage 1 m gradients: each [rows / m, S, H] float32.
        rows, seq = make_batches(make_model(make_decoder_config()))[0].input_ids.shape
        one = rows // m * seq * make_decoder_config().hidden_size * 4
        assert [out.steps[0].metrics["p2p_send_bytes"] for out in outputs] == [m * one, m * one]
    if schedule == "gpipe":  # every forward before any backward
        assert peaks == {f"peak_inflight_stage{i}": m for i in range(p)}
    assert set(peaks) == {f"peak_inflight_stage{i}" for i in range(p * virtual)}


@pytest.mark.parametrize("schedule, virtual, dp, tp, tied", [
    ("1f1b", 1, 2, 1, True),  # PP2 x DP2
    ("zbv", 2, 1, 2, False),  # PP2 x TP2
    ("1f1b", 1, 2, 2, True),  # PP2 x TP2 x DP2
])
def test_3d_layout_gradient_equals_single_process(schedule, virtual, dp, tp, tied):
    outputs, m = run_and_check(schedule, virtual, dp=dp, tp=tp, tied=tied)
    assert len(outputs) == 2 * dp * tp
    losses = [out.steps[0].metrics["loss"] for out in outputs if "loss" in out.steps[0].metrics]
    assert len(losses) == dp * tp and max(losses) - min(losses) < 1e-6  # reduced over DP: the global loss


@pytest.mark.parametrize("schedule, virtual, tied, layer_split", [
    ("1f1b", 1, True, (3, 1)),  # the head's stage lighter, as train.layer_split=auto makes it
    ("zbv", 2, False, (1, 2, 2, 1)),  # rank 0 holds stages 0 and 3 (embedding and head)
])
def test_an_uneven_layer_split_computes_the_same_gradient(schedule, virtual, tied, layer_split):
    outputs, m = run_and_check(schedule, virtual, tied=tied, layer_split=layer_split)
    stash = {k for out in outputs for k in out.steps[0].metrics if k.startswith("activation_bytes")}
    assert stash == {f"activation_bytes_per_microbatch_stage{s}" for s in range(len(layer_split))}


def test_microbatch_losses_sum_to_full_batch_loss():
    model = make_model()
    arrays = make_rollout_arrays(model, num_groups=3, group_size=4)
    for mode in LOSS_AGGREGATIONS:
        batch = build_global_batch(arrays, mode, 0)
        with torch.no_grad():
            full, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, LOSS)
            parts = sum(grpo_microbatch_loss(model(ids), tgt, LOSS)[0]
                        for ids, tgt in zip(batch.input_ids.split(3), batch.target.split(3)))
        torch.testing.assert_close(parts, full, rtol=1e-6, atol=1e-7)
