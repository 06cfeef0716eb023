"""The notebooks under notebooks/ run top to bottom twice in a row, in one kernel and one run folder
(a user re-running all cells; the quickstart also once more in a fresh kernel), and show what they promise: PNG figures and tables with rows. Each
notebook's last cell checks its numbers against independent ones (hand-worked counts, a second
read path); these tests check what a reader sees."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Two iterations of 8 prompts x G 8 after a 30-step warm-up: seconds of training, not minutes.
RUN_OVERRIDES = "iterations=2 warmup.steps=30 task.prompts_per_step=8 train.micro_batch_size=16"
PLAN_OVERRIDES = "plan.search.enabled=false"  # the layout search is the slow part of a 70B plan
_CELL_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """One runs folder for the module: the rollout explorer reads the run the quickstart trained."""
    path = tmp_path_factory.mktemp("notebook-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPOFLOW_NOTEBOOK_RUNS", str(path))
        mp.setenv("GRPOFLOW_NOTEBOOK_OVERRIDES", RUN_OVERRIDES)
        mp.setenv("GRPOFLOW_NOTEBOOK_PLAN_OVERRIDES", PLAN_OVERRIDES)
        yield path


def execute(name: str, passes_per_kernel: tuple[int, ...] = (2,)) -> list[list[dict]]:
    """The outputs of every code cell, per pass over the notebook: ``passes_per_kernel[k]`` passes in
    the k-th kernel, each kernel started fresh."""
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    passes = []
    for count in passes_per_kernel:
        client = NotebookClient(nb, timeout=_CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT)}})
        with client.setup_kernel():
            for _ in range(count):
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        client.execute_cell(cell, index)  # raises CellExecutionError on a failing cell
                passes.append([dict(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs])
    return passes


def _text(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)


def _pngs(outputs: list[dict]) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _table_rows(outputs: list[dict]) -> list[int]:
    """Body rows of each HTML table shown (pandas DataFrames)."""
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    return [len(re.findall(r"<tr\b", h.split("<tbody>", 1)[1])) for h in html if "<tbody>" in h]


def test_quickstart_trains_then_reads_back(runs_dir):
    # Rerun in the same kernel, then once more in a fresh one (reopening the notebook).
    first, *reruns = execute("quickstart.ipynb", passes_per_kernel=(2, 1))
    assert "nothing to train" not in _text(first)
    assert all("nothing to train" in _text(outputs) for outputs in reruns)  # the finished run is read back
    for outputs in (first, *reruns):
        text = _text(outputs)
        assert "run quickstart: 2 iterations published" in text
        assert "checked 2 steps and 64 decoded samples" in text
        assert _pngs(outputs) == 1  # the reward curve
        # per-step curve (2 steps), decoded samples (2 groups of G = 8), MLflow iterations (2)
        assert _table_rows(outputs) == [2, 16, 2]
        assert re.search(r"\d+\+\d+=", text)  # decoded prompts, not token ids
    assert (runs_dir / "quickstart" / "summary.json").exists()


def test_rollout_explorer_reads_every_step(runs_dir):
    for outputs in execute("rollout_explorer.ipynb"):
        text = _text(outputs)
        assert "published steps [0, 1]" in text
        assert "checked 2 steps, 16 groups, 128 samples" in text
        assert _pngs(outputs) == 2  # reward by policy version, length histogram
        rows = _table_rows(outputs)
        # random samples (8), by version (2), dask means (2), lengths (2), then 2 best + 2 worst groups of G = 8
        assert rows == [8, 2, 2, 2, 8, 8, 8, 8]
        assert text.count("best: step=") == 2 and text.count("worst: step=") == 2


def test_planner_plots_both_plans(runs_dir):
    for outputs in execute("planner.ipynb"):
        text = _text(outputs)
        assert "plan: TP4 PP8 DP2 1f1b" in text and "plan: TP1 PP2 DP1 1f1b" in text
        assert "middle rank of the 70B plan: 2,139,258,880 parameters per GPU" in text
        assert _pngs(outputs) == 4  # memory per stage and schedule Gantt, for each plan
        rows = _table_rows(outputs)
        # 70B memory (8 ranks), 70B schedules (one row each), tiny memory (2 ranks)
        assert rows[0] == 8 and rows[1] >= 2 and rows[2] == 2
    assert (runs_dir / "plans" / "seed-70b" / "memory_training.png").stat().st_size > 0
