"""The pipeline's layer split (train.layer_split): the balanced rule worked by hand, the stages it
builds, the tensors each rank loads, the run schema's checks, and the runtime's auto agreeing with
the planner's."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from conftest import make_decoder_config
from flows.config import GRPOConfig
from planner.loader import plan_config_from_run
from planner.training import estimate_stage_layout
from stages.config import ConfigError, ModelConfig, RolloutConfig, TaskConfig, TrainConfig
from stages.data import DatasetConfig
from stages.layout import ParallelLayout, balanced_layer_split, layer_ranges, layers_per_stage, stage_to_rank
from stages.policy import build_stage, hf_state, stage_hf_names
from stages.train.setup import train_setup
from stages.train.engine import TrainSetup, rank_tensor_names
from storage.policies import PolicyStore, load_model_folder


def _work(split: tuple[int, ...], head: float) -> list[float]:
    """Each stage's work in decoder layers, the head on the last."""
    return [n + (head if s == len(split) - 1 else 0.0) for s, n in enumerate(split)]


# -- the balanced rule --------------------------------------------------------------------------------
def test_head_of_seven_layers_over_two_stages_by_hand():
    # 30 layers + a head of 7 = 37 layers' work, 18.5 a stage: stage 1 holds 18.5 - 7 = 11.5 layers,
    # rounded to 19 / 11 (work 19 / 18; 18 / 12 is 18 / 19, the same maximum: the first stage takes the tie)
    assert balanced_layer_split(30, 2, 7.0) == (19, 11)
    # the smollm2-arithmetic config's head: 7.8 with full logits, 1.7 chunked over half its completion slots
    assert balanced_layer_split(30, 2, 7.82) == (19, 11)  # work 19 / 18.82
    assert balanced_layer_split(30, 2, 1.74) == (16, 14)  # work 16 / 15.74 (17 / 13: 17 / 14.74)


@pytest.mark.parametrize("num_layers, num_stages", [(30, 2), (81, 8), (10, 3), (4, 4), (7, 1)])
@pytest.mark.parametrize("head", [0.0, 0.02, 0.99])
def test_a_head_under_one_layer_keeps_the_even_split(num_layers, num_stages, head):
    # the tiny model's head (vocab 15, hidden 64) weighs 0.02 layers
    assert balanced_layer_split(num_layers, num_stages, head) == layers_per_stage(num_layers, num_stages)


def test_v_shaped_and_interleaved_stages_put_the_head_on_the_last_stage():
    # p = 2 ranks x v = 2: 30 layers + 7 = 37, 9.25 a stage; stages 0-2 fill to 8 with stage 3's 1 + 7, then
    # four more each take one (9, 9, 9, 2: work 9 each), and the last layer goes to stage 0
    split = balanced_layer_split(30, 4, 7.0)
    assert split == (10, 9, 9, 2)
    for schedule, rank0, rank1 in (("zbv", 10 + 2 + 7, 9 + 9), ("interleaved-1f1b", 10 + 9, 9 + 2 + 7)):
        ranks = stage_to_rank(schedule, 2, 2)  # zbv: rank 0 holds stages 0 and 3; interleaved: 0 and 2
        work = [0.0, 0.0]
        for s, w in enumerate(_work(split, 7.0)):
            work[ranks[s]] += w
        assert work == [rank0, rank1]
    # the even split leaves the head's rank 7 layers' work above the other (zbv: 8+7+7 = 22 against 15)
    assert layers_per_stage(30, 4) == (8, 8, 7, 7)


@pytest.mark.parametrize("num_layers, num_stages, head", [(9, 3, 2.5), (8, 2, 12.8), (10, 4, 1.5), (7, 3, 0.4),
                                                         (12, 2, 4.0), (11, 3, 6.3)])
def test_the_slowest_stage_is_as_fast_as_any_split_makes_it(num_layers, num_stages, head):
    best = min(max(_work(c, head)) for c in itertools.product(range(1, num_layers + 1), repeat=num_stages)
               if sum(c) == num_layers)
    split = balanced_layer_split(num_layers, num_stages, head)
    assert sum(split) == num_layers and min(split) >= 1
    assert max(_work(split, head)) == pytest.approx(best)


def test_a_head_heavier_than_every_layer_leaves_one_layer_on_the_last_stage():
    assert balanced_layer_split(8, 2, 12.8) == (7, 1)


def test_layer_ranges_follow_a_split_and_refuse_a_bad_one():
    assert layer_ranges(30, 2, (19, 11)) == [(0, 19), (19, 30)]
    assert layer_ranges(7, 3) == layer_ranges(7, 3, (3, 2, 2))
    for bad, fragment in (((20, 11), "holds 31 decoder layers"), ((30,), "lists 1 stages"), ((30, 0), ">= 1")):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            layer_ranges(30, 2, bad)


# -- what the runtime builds ---------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, p, v, split", [("1f1b", 2, 1, (3, 1)), ("zbv", 2, 2, (2, 1, 2, 1)),
                                                   ("interleaved-1f1b", 2, 2, (1, 2, 2, 1))])
def test_each_rank_loads_the_layers_of_its_stages(schedule, p, v, split):
    cfg = make_decoder_config(num_hidden_layers=sum(split), tie_word_embeddings=True)
    layout = ParallelLayout(pp=p, virtual=v, schedule=schedule)
    ranges = layer_ranges(cfg.num_hidden_layers, p * v, split)
    for rank in range(p):
        names = rank_tensor_names(cfg, layout, rank, split)
        held = {int(n) for n in re.findall(r"model\.layers\.(\d+)\.", " ".join(names))}
        assert held == {i for s in layout.stages_of(rank) for i in range(*ranges[s])}
        # the embedding goes with stage 0, the final norm (and the tied head) with the last stage
        assert ("model.norm.weight" in names) == (p * v - 1 in layout.stages_of(rank))
        assert ("model.embed_tokens.weight" in names) == bool({0, p * v - 1} & set(layout.stages_of(rank)))
    with torch.device("meta"):
        stages = [build_stage(cfg, s, p * v, layer_split=split) for s in range(p * v)]
    assert [len(m.layers) for m in stages] == list(split)


def test_policy_shards_saved_under_one_split_load_under_another(tmp_path):
    """A policy version is HF-named tensors: a run resumed with another split reads each rank's names
    from the shards whatever split wrote them."""
    cfg = make_decoder_config(num_hidden_layers=4, tie_word_embeddings=True)
    full = build_stage(cfg)
    full.init_weights(torch.Generator().manual_seed(0))
    whole = hf_state(full)
    store = PolicyStore(tmp_path)
    for s, part in enumerate((3, 1)):  # each pipeline rank writes the tensors of its stage of a 3 / 1 split
        stage = build_stage(cfg, s, 2, layer_split=(3, 1))
        assert set(stage_hf_names(stage)) <= set(whole)
        store.save_shard(1, s, 2, {n: whole[n] for n in stage_hf_names(stage)})
    ref = store.finalize_policy(1, cfg.to_hf(), "{}", 2)
    layout = ParallelLayout(pp=2)
    for rank in range(2):
        names = rank_tensor_names(cfg, layout, rank, (1, 3))
        _, _, tensors = load_model_folder(ref.path, names=names)
        assert set(tensors) == names and all(torch.equal(tensors[n], whole[n]) for n in names)


def test_train_setup_takes_the_resolved_split_and_checks_it():
    cfg = make_decoder_config(num_hidden_layers=4)
    assert train_setup(TrainConfig(), cfg, 2, 1.0).layer_split is None  # auto, unresolved: the even split
    assert train_setup(TrainConfig(layer_split=[3, 1]), cfg, 2, 1.0).layer_split == (3, 1)
    assert train_setup(TrainConfig(), cfg, 2, 1.0, layer_split=(1, 3)).layer_split == (1, 3)
    with pytest.raises(ValueError, match="holds 5 decoder layers, the model has model.num_hidden_layers=4"):
        TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, layer_split=(4, 1))


# -- the run schema ----------------------------------------------------------------------------------
def _run(layers: int = 4, vocab: int | None = None, chunk=None, **train) -> GRPOConfig:
    return GRPOConfig(task=TaskConfig(prompts_per_step=2), dataset=DatasetConfig(num_digits=2),
                      model=ModelConfig(num_hidden_layers=layers, vocab_size=vocab),
                      rollout=RolloutConfig(group_size=2, max_new_tokens=8),
                      train=TrainConfig(micro_batch_size=2, logprob_chunk_tokens=chunk, **train))


@pytest.mark.parametrize("split, fragment", [
    ([2, 1], "holds 3 decoder layers, the model has model.num_hidden_layers=4"),
    ([4], "lists 1 stages, the pipeline has 2"),
    ([4, 0], "whole number of decoder layers >= 1"),
    ("even", "must be auto or a list"),
])
def test_a_bad_split_is_one_line_naming_the_key(split, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        _run(layer_split=split)
    assert str(info.value).startswith("train.layer_split=") and "\n" not in str(info.value)


def test_the_run_and_the_planner_pick_the_same_split():
    cases = [_run(), _run(layers=12, vocab=8192), _run(layers=12, vocab=8192, chunk=4),
             _run(layers=12, vocab=8192, layer_split=[2, 10]),
             _run(layers=12, vocab=8192, schedule="zbv", virtual_pipeline_model_parallel_size=2)]
    splits = []
    for run in cases:
        plan = plan_config_from_run(run)
        assert estimate_stage_layout(plan.model_shape, plan.train, plan.seq_len).layers == run.layer_split
        splits.append(run.layer_split)
    # tiny vocabulary: even; 8,192 tokens at hidden 64: the head outweighs layers; chunked over 8 of 15 positions, less
    assert splits[0] == (2, 2) and splits[3] == (2, 10)
    assert splits[1][1] < splits[2][1] < 6 and splits[4][-1] == 1


# -- against measured stage times -------------------------------------------------------------------------
_TIMED_CALLS = 4  # the first is a warm-up (allocator, thread pools)
_ROUNDS = 3  # at most: a shared machine can starve one rank for a whole run


def _fastest_actions(layer_split: tuple[int, ...], cfg, batches, fastest: dict) -> None:
    """Lower ``fastest[(split, stage, kind)]`` to the fastest F and B of each stage in the ranks'
    timelines, over the calls after the first and their microbatches."""
    from stages.train.local import run_local_pipeline

    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=4, layer_split=layer_split, timeout_s=60)
    for out in run_local_pipeline(setup, hf_state(model), batches, optimizer_step=False):
        for step in out.steps[1:]:
            for a in step.actions:
                if a.kind in ("F", "B"):
                    key = (layer_split, a.stage, a.kind)
                    fastest[key] = min(fastest.get(key, float("inf")), a.seconds)


def test_auto_split_brings_the_measured_stage_times_closer():
    """A small model with a large vocabulary (hidden 128, 8 layers, vocab 8,192: the head weighs 4.2
    layers): the even 4 / 4 split leaves the last stage about twice the first's work; auto's 6 / 2
    evens it out, and the ranks' timelines show it. A stage's time is its fastest forward plus its
    fastest backward of a microbatch: other processes only ever slow an action down, so the fastest
    is the truest (as in stages/perf/matmul_rate.py); a further round runs while the figures do not
    yet show it (measured here: even 2.0, auto 1.1 of the faster stage's time)."""
    from conftest import make_rollout_arrays
    from planner.model import ModelShape as PlannerShape
    from planner.training import estimate_head_layers
    from stages.train.batch import build_global_batch

    cfg = make_decoder_config(vocab_size=8192, hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    shape = PlannerShape(**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                         "num_hidden_layers", "num_attention_heads",
                                                         "num_key_value_heads", "head_dim")})
    head = estimate_head_layers(shape, 32)  # rows of prompt 8 + 24 new tokens
    auto = balanced_layer_split(8, 2, head)
    # head 2 x 8192 x 128 = 2,097,152 FLOPs a token; a layer 2 x 245,760 weights + 4 x 128 x 32 / 2 = 499,712
    assert head == pytest.approx(2_097_152 / 499_712) and auto == (6, 2)  # 4.2 layers: work 6 / 6.2
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    arrays = make_rollout_arrays(model, num_groups=8, group_size=4, prompt_width=8, max_new_tokens=24)
    batches = [build_global_batch(arrays, "token-mean", 0)] * _TIMED_CALLS  # 4 microbatches of 8 x 32 tokens
    fastest: dict = {}

    def ratio(split):  # the slower stage's time over the faster's
        times = [fastest[split, s, "F"] + fastest[split, s, "B"] for s in range(2)]
        return max(times) / min(times), times

    for _ in range(_ROUNDS):
        for split in ((4, 4), auto):
            _fastest_actions(split, cfg, batches, fastest)
        (even_ratio, even_s), (auto_ratio, auto_s) = ratio((4, 4)), ratio(auto)
        if even_ratio > 1.4 and even_s[1] > even_s[0] and auto_ratio < 0.8 * even_ratio:
            break
    assert even_ratio > 1.4 and even_s[1] > even_s[0], even_s  # the head's stage is the slow one
    assert auto_ratio < 0.8 * even_ratio, (even_s, auto_s)
