"""Views of a stored step for people: a table of decoded samples (the array schema is
RolloutStore.array_specs)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from storage.rollouts import RolloutStore

__all__ = ["SAMPLE_COLUMNS", "load_sample_table"]

SAMPLE_COLUMNS = ("id", "prompt", "completion", "reward", "advantage", "policy_version")


def load_sample_table(rollouts_root: str | Path, step: int, decode: Callable[[list[int]], str],
                      num_groups: int, decode_prompt: Callable[[list[int]], str] | None = None) -> dict[str, list]:
    """The first ``num_groups`` groups of a step, one row per completion, as :data:`SAMPLE_COLUMNS`
    columns: ids render as ``step=7/group=12/sample=3``, token ids turned into text by ``decode``
    (the policy tokenizer's, as the reward saw them), prompts by ``decode_prompt`` (default
    ``decode``; TextCodec.decode_prompt shows the question without the chat template around it);
    rewards and advantages rounded to 4 decimals, as a reader compares them."""
    store = RolloutStore(rollouts_root)
    group_size = store.attrs(step)["group_size"]
    rows = min(num_groups * group_size, store.layout(step).num_samples)
    a = store.read(step, "prompt_ids", "prompt_len", "tokens", "length", "reward", "advantage", "group_id",
                   "policy_version", stop=rows)
    table: dict[str, list] = {c: [] for c in SAMPLE_COLUMNS}
    for i in range(rows):
        table["id"].append(f"step={step}/group={int(a['group_id'][i])}/sample={i % group_size}")
        table["prompt"].append((decode_prompt or decode)(a["prompt_ids"][i, : a["prompt_len"][i]].tolist()))
        table["completion"].append(decode(a["tokens"][i, : a["length"][i]].tolist()))
        table["reward"].append(round(float(a["reward"][i]), 4))
        table["advantage"].append(round(float(a["advantage"][i]), 4))
        table["policy_version"].append(int(a["policy_version"][i]))
    return table
