"""notebooks/quickstart.ipynb runs top to bottom (its last cell asserts what it read back)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOFLOW_NOTEBOOK_RUNS", str(tmp_path))
    monkeypatch.setenv("GRPOFLOW_NOTEBOOK_OVERRIDES", "warmup.steps=30 task.prompts_per_step=8 train.micro_batch_size=16")
    root = Path(__file__).resolve().parents[2]
    nb = nbformat.read(root / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "run quickstart: 2 iterations" in text
    assert (tmp_path / "quickstart" / "summary.json").exists()
