"""Training durations and memory, rollout, weight sync, step composition and the staleness model."""

import math

import pytest

from planner.layout import estimate_layout, estimate_step_for_staleness
from planner.memory import estimate_stage_parameters
from planner.rollout import estimate_decode_step_s, estimate_rollout, speculative_tokens_per_step
from planner.staleness import estimate_staleness, normal_cdf
from planner.steptime import estimate_step_time
from planner.training import estimate_action_durations, estimate_training_memory, pipeline_hop_crosses_node
from planner_factories import make_plan_config


def test_forward_duration_is_flops_over_tp_peak_mfu_plus_tp_collectives():
    cfg = make_plan_config(cluster={"collective_latency_s": 0.0}, train={"layer_split": [8, 8, 8, 8]})
    m, c, t = cfg.model_shape, cfg.cluster, cfg.train
    d = estimate_action_durations(m, c, t, cfg.seq_len)
    tokens, layers = cfg.seq_len, 8  # 32 layers / PP 4, split evenly
    layer_matmul = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    flops = 2 * layer_matmul * tokens * layers + 4 * 4096 * cfg.seq_len * 0.5 * tokens * layers
    collective = 2 * (2 - 1) / 2 * tokens * 4096 * 2 / c.intra_node_bandwidth_bytes_per_s
    assert d.duration(0, "F") == pytest.approx(flops / 2 / (c.peak_flops * c.mfu) + 2 * layers * collective)
    assert d.duration(3, "F") > d.duration(0, "F")  # lm_head on the last stage
    assert d.duration(1, "B") == pytest.approx(d.duration(1, "I") + d.duration(1, "W"))


def test_full_recompute_adds_a_forward_to_the_input_backward():
    even = {"layer_split": [8, 8, 8, 8]}  # auto would move layers to the head's stage under recompute
    plain = make_plan_config(train=even)
    full = make_plan_config(train={"recompute": "full", **even})
    a = estimate_action_durations(plain.model_shape, plain.cluster, plain.train, plain.seq_len)
    b = estimate_action_durations(full.model_shape, full.cluster, full.train, full.seq_len)
    assert b.duration(1, "I") == pytest.approx(a.duration(1, "I") + a.duration(1, "F"))
    assert b.duration(1, "W") == a.duration(1, "W")


@pytest.mark.parametrize(("gpus", "tp", "dp", "crosses"), [(8, 2, 2, False), (8, 1, 1, False), (16, 2, 2, True),
                                                          (16, 4, 2, True)])
def test_pipeline_hops_cross_nodes_once_the_pipeline_leaves_the_node(gpus, tp, dp, crosses):
    cfg = make_plan_config(cluster={"num_gpus": gpus}, rollout={"rollout_tensor_parallel_size": 1},
                           train={"tensor_model_parallel_size": tp, "data_parallel_size": dp,
                                  "pipeline_model_parallel_size": gpus // (tp * dp)})
    assert pipeline_hop_crosses_node(cfg.train, 8) is crosses


def test_training_memory_stack_by_hand():
    cfg = make_plan_config(train={"layer_split": [8, 8, 8, 8]})
    ranks = estimate_training_memory(cfg)
    params0 = estimate_stage_parameters(cfg.model_shape, 8, has_embedding=True, has_head=False, tensor_parallel_size=2)
    assert ranks[0].weights_bytes == 2 * params0 and ranks[0].grads_bytes == 4 * params0
    assert ranks[0].reference_bytes == 2 * params0  # the frozen reference's stage, bf16, beside the policy's
    assert ranks[0].optimizer_bytes == 12 * params0 / 2  # distributed optimiser over DP 2
    assert [r.peak_in_flight for r in ranks] == [4, 3, 2, 1]  # 1F1B, p = 4
    assert ranks[1].activation_bytes == pytest.approx(3 / 2 * ranks[2].activation_bytes)
    assert ranks[3].logits_bytes > 0 == ranks[0].logits_bytes
    r = ranks[0]
    assert r.total_bytes == (2 + 2 + 4 + 6) * params0 + r.activation_bytes + r.logits_bytes + r.working_bytes


def test_decode_step_is_the_hbm_roofline_plus_tp_latency():
    cfg = make_plan_config(rollout={"rollout_tensor_parallel_size": 1}, cluster={"collective_latency_s": 0.0})
    c, m = cfg.cluster, cfg.model_shape
    weights = 8_030_261_248 * 2
    kv = 4 * 1000 * 2 * 32 * 1024 * 2  # batch 4, context 1000, 131,072 B per token
    bandwidth = c.hbm_bandwidth_bytes_per_s * c.hbm_efficiency
    assert estimate_decode_step_s(cfg, 4, 1000) == pytest.approx((weights + kv) / bandwidth)
    assert m.num_hidden_layers == 32


def test_rollout_concurrency_is_limited_by_the_kv_budget():
    roomy = estimate_rollout(make_plan_config(), 16)
    assert roomy.concurrent_groups == roomy.groups_per_engine == 2  # 16 prompts over 8 engines of TP 2
    tight = estimate_rollout(make_plan_config(cluster={"gpu_memory_gib": 9.0}), 16)
    assert 0 <= tight.concurrent_groups < 2 or not tight.feasible


def test_speculative_tokens_per_step():
    assert speculative_tokens_per_step(0, 0.7) == 1.0
    assert speculative_tokens_per_step(1, 0.5) == 1.5
    assert speculative_tokens_per_step(4, 0.7) == pytest.approx((1 - 0.7**5) / 0.3)


def test_step_time_sums_when_synchronous_and_takes_the_slower_lane_when_async():
    kw = dict(training_gpus=8, rollout_gpus=8, rollout_s=50.0, reference_s=10.0, train_s=30.0, weight_sync_s=2.0,
              weight_send_s=1.0, offload_s=0.0, trained_tokens=1e6, generated_tokens=5e5)
    assert estimate_step_time(placement="colocated", staleness=3, **kw).step_s == 92.0
    assert estimate_step_time(placement="decoupled", staleness=0, **kw).step_s == 92.0
    async_ = estimate_step_time(placement="decoupled", staleness=1, **kw)
    assert async_.step_s == 52.0 and async_.overlap_saving_s == 40.0
    assert async_.tokens_per_s == pytest.approx(1e6 / 52.0)


def test_staleness_only_pays_off_when_decoupled():
    col = estimate_layout(make_plan_config())
    assert estimate_step_for_staleness(col, 1).step_s == estimate_step_for_staleness(col, 0).step_s
    dec = estimate_layout(make_plan_config(rollout={"placement": "decoupled", "rollout_gpus": 8},
                                           train={"data_parallel_size": 1}))
    assert estimate_step_for_staleness(dec, 1).step_s < estimate_step_for_staleness(dec, 0).step_s


def test_drift_model_hand_worked_and_monotone():
    assert normal_cdf(0.0) == 0.5
    zero = estimate_staleness(0, sigma_step=0.05, sigma_mismatch=0.0, eps_low=0.2, eps_high=0.28, gen_len=100)
    assert zero.outside_clip_fraction == 0.0 and zero.token_ess == 1.0
    # single population, s = 0.1: P(r > 1.28) = 1 - Phi((ln 1.28 + 0.005) / 0.1)
    one = estimate_staleness(1, sigma_step=0.1, sigma_mismatch=0.0, eps_low=0.2, eps_high=0.28, gen_len=100,
                             hot_share=0.0)
    above = 1 - normal_cdf((math.log(1.28) + 0.005) / 0.1)
    below = normal_cdf((math.log(0.8) + 0.005) / 0.1)
    assert one.outside_clip_fraction == pytest.approx(above + below)
    assert one.sequence_log10_ess == pytest.approx(-100 * 0.01 / math.log(10))
    fractions = [estimate_staleness(k, sigma_step=0.05, sigma_mismatch=0.02, eps_low=0.2, eps_high=0.28,
                                    gen_len=100).clipped_gradient_fraction for k in range(6)]
    assert fractions == sorted(fractions) and fractions[-1] > fractions[0]
    decoupled = estimate_staleness(5, sigma_step=0.05, sigma_mismatch=0.02, eps_low=0.2, eps_high=0.28, gen_len=100)
    assert decoupled.clipped_gradient_fraction_decoupled == 0.0  # one update per step: clip sees no drift


def test_data_parallel_reference_holds_the_whole_model_and_shares_the_microbatches():
    from planner.model import estimate_parameter_count
    from planner.training import estimate_reference_pass_s

    layout = {"tensor_model_parallel_size": 1, "data_parallel_size": 4}
    piped = make_plan_config(train=layout)
    shared = make_plan_config(train={**layout, "reference_parallel": "data"})
    whole = estimate_parameter_count(shared.model_shape)
    for a, b in zip(estimate_training_memory(piped), estimate_training_memory(shared)):
        assert a.reference_bytes == a.weights_bytes and b.reference_bytes == 2 * whole
        assert b.total_bytes - a.total_bytes == b.reference_bytes - a.reference_bytes
    durations = estimate_action_durations(shared.model_shape, shared.cluster, shared.train, shared.seq_len)
    p, m = 4, shared.workload.num_samples // (4 * shared.train.micro_batch_size)
    forward = [durations.duration(s, "F") for s in range(p)]
    assert estimate_reference_pass_s(shared, durations) == pytest.approx(-(-m // p) * sum(forward) + durations.p2p_s)
    assert estimate_reference_pass_s(piped, durations) == pytest.approx((m + p - 1) * max(forward)
                                                                        + (p - 1) * durations.p2p_s)
    assert estimate_reference_pass_s(shared, durations) < estimate_reference_pass_s(piped, durations)


def test_data_parallel_reference_needs_tp_1():
    from planner.config import PlanConfigError
    from stages.config import ConfigError

    with pytest.raises((PlanConfigError, ConfigError), match="reference_parallel.data holds the whole reference"):
        make_plan_config(train={"reference_parallel": "data"})
