"""The planner's action orders are the ones torch.distributed.pipelining executes (skipped without torch).

The multi-stage schedules expose their per-rank order (``_calculate_single_rank_operations``, a private
API of the torch the runtime pins); 1F1B and GPipe run theirs in code, checked in test_schedules.py.
"""

import pytest

from planner.schedules import build_pipeline_order

S = pytest.importorskip("torch.distributed.pipelining.schedules")

_CLASSES = {"interleaved-1f1b": "ScheduleInterleaved1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _torch_rank_actions(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    obj = object.__new__(getattr(S, _CLASSES[schedule]))  # only the order arithmetic, no stages or groups
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
    obj.num_stages = obj._num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    obj.rank = rank
    flat = []
    for action in obj._calculate_single_rank_operations(rank):
        if action is not None:
            flat += list(action.sub_actions) if action.sub_actions else [action]
    return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat]


@pytest.mark.parametrize(("schedule", "v"), [("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1),
                                             ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("rounds", (1, 2, 3))
def test_orders_equal_torch(schedule, v, p, rounds):
    m = rounds * p + (p if schedule == "dualpipev" else 0)
    mine = build_pipeline_order(schedule, p, m, v)
    for rank in range(p):
        ours = [(a.kind, a.stage, a.microbatch) for a in mine.rank_actions[rank]]
        assert ours == _torch_rank_actions(schedule, p, m, v, rank)
