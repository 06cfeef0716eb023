"""A two-iteration run seen the way a person sees it: the CLI's re-run, summary.json, and the MLflow
UI in a real Chromium (Debian's /usr/bin/chromium driven by playwright; skipped where either is
missing). Screenshots land in runs/_test_artifacts/browser/ (or $GRPOFLOW_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.config import load_config
from flows.loop import run
from storage.lineage import iteration_runs

pytestmark = pytest.mark.slow

GRPOFLOW = [sys.executable, "-m", "flows.cli"]
CHROMIUM = Path("/usr/bin/chromium")
# Flags for a headless, offline, sandbox-less container: no GPU, no update or sync traffic.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
OVERRIDES = ["iterations=2", "run_name=browser", "warmup.steps=30", "task.prompts_per_step=8",
             "train.micro_batch_size=16"]
UI_START_S = 120  # MLflow's server imports and migrates the store: ~20 s alone, longer on a busy host
_REPO = Path(__file__).resolve().parents[2]


def _artifacts_dir() -> Path:
    out = Path(os.environ.get("GRPOFLOW_TEST_ARTIFACTS", _REPO / "runs" / "_test_artifacts")) / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    cfg = load_config("configs/tiny.yaml", OVERRIDES + [f"runs_dir={runs_dir}"])
    summary = run(cfg, progress=False)
    return cfg, summary, runs_dir / "browser"


def test_summary_json_is_strict(finished_run):
    _, summary, run_dir = finished_run

    def reject(constant: str):
        raise ValueError(f"summary.json holds a bare {constant}")

    data = json.loads((run_dir / "summary.json").read_text(), parse_constant=reject)
    assert data["iterations"] == 2 and data["mlflow_run_id"] == summary.mlflow_run_id


def test_child_runs_span_their_steps(finished_run):
    _, summary, _ = finished_run
    runs = iteration_runs(summary.tracking_uri, summary.mlflow_run_id)
    assert list(runs["tags.grpoflow.step"]) == ["0", "1"]
    assert list(runs["tags.policy.version_in"]) == ["0", "1"] and list(runs["tags.policy.version_out"]) == ["1", "2"]
    for (_, child), m in zip(runs.iterrows(), summary.metrics):
        duration_s = (child["end_time"] - child["start_time"]).total_seconds()
        # Rollout and train both sit on every step's critical path, one after the other.
        assert duration_s >= m["rollout_seconds"] + m["train_seconds"], (duration_s, m)
    import mlflow

    parent = mlflow.MlflowClient(summary.tracking_uri).get_run(summary.mlflow_run_id)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True)
    assert parent.data.tags["mlflow.source.git.commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert parent.data.tags["dask.dashboard_link"].startswith("http://127.0.0.1:")


def test_rerun_says_nothing_to_do_and_leaves_summary_alone(finished_run):
    cfg, _, run_dir = finished_run
    path = run_dir / "summary.json"
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    proc = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", *OVERRIDES, f"runs_dir={run_dir.parent}", "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=_REPO)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    again = run(cfg, progress=False)  # the API says so too, without starting a cluster
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before and again.iterations == 2
    # A changed config is refused, finished run or not, never passed as "nothing to do".
    changed = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", *OVERRIDES, f"runs_dir={run_dir.parent}",
                                         "train.lr=0.5", "--quiet"], capture_output=True, text=True, timeout=300, cwd=_REPO)
    assert changed.returncode == 2 and "nothing to do" not in changed.stdout
    assert changed.stderr.strip().endswith("was started with a different config: train.lr differ; run with --new "
                                           "(or another run_name) to start over"), changed.stderr
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


@pytest.fixture(scope="module")
def ui(finished_run):
    """``grpoflow ui RUN_DIR`` on a free port: (address, training-runs URL)."""
    _, _, run_dir = finished_run
    port = _free_port()
    proc = subprocess.Popen(GRPOFLOW + ["ui", str(run_dir), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=_REPO)
    try:
        address = f"http://127.0.0.1:{port}"
        assert address in proc.stdout.readline()
        page_line = proc.stdout.readline()
        assert page_line.startswith("training runs: ") and "workflowType=machine_learning" in page_line
        deadline, status = time.monotonic() + UI_START_S, None
        while time.monotonic() < deadline and status is None:
            try:
                status = urllib.request.urlopen(f"{address}/health", timeout=2).status
            except OSError:
                time.sleep(1.0)
        assert status == 200, f"the MLflow UI did not answer within {UI_START_S} s"
        yield address, page_line.removeprefix("training runs: ").strip()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (make setup installs it where it can)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 900})
        finally:
            browser.close()


@pytest.mark.browser
def test_mlflow_ui_shows_runs_plots_and_samples(page, finished_run, ui):
    _, summary, _ = finished_run
    address, runs_url = ui
    shots = _artifacts_dir()
    runs = iteration_runs(summary.tracking_uri, summary.mlflow_run_id)
    exp_id = runs["experiment_id"].iloc[0]
    view = "?workflowType=machine_learning"

    # The experiment's runs table, training view: the parent, then its children once expanded.
    page.goto(runs_url)
    page.get_by_role("link", name="browser", exact=True).wait_for(timeout=90_000)
    assert page.get_by_text("Model training").count() >= 1
    row = page.locator('[role="row"]', has_text="browser")
    row.locator('button[data-component-id*="runnamecellrenderer"]').click()
    for step in (0, 1):
        page.get_by_role("link", name=f"step={step}", exact=True).wait_for(timeout=30_000)
    page.screenshot(path=str(shots / "runs.png"))

    # The parent's reward plot, rendered as an image.
    page.goto(f"{address}/#/experiments/{exp_id}/runs/{summary.mlflow_run_id}/artifacts/plots/reward.png{view}")
    image = page.locator('img[alt="plots/reward.png"]')
    image.wait_for(timeout=60_000)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle(), timeout=30_000)
    assert image.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [640, 360]
    page.screenshot(path=str(shots / "reward_plot.png"))

    # The parent's charts: the main curves' section first, then the per-function rewards, then the diagnostics.
    page.goto(f"{address}/#/experiments/{exp_id}/runs/{summary.mlflow_run_id}/model-metrics{view}")
    page.wait_for_function("() => /Model metrics\\s*\\(\\d+\\)/.test(document.body.innerText)", timeout=60_000)
    text = page.inner_text("body")
    heads = [re.search(rf"{name}\s*\(\d+\)", text) for name in ("grpo", "reward", "Model metrics")]
    assert all(heads) and heads[0].start() < heads[1].start() < heads[2].start(), text[:2000]
    page.screenshot(path=str(shots / "parent_charts.png"))

    # The last step's decoded samples, shown as a table.
    child = runs["run_id"].iloc[1]
    page.goto(f"{address}/#/experiments/{exp_id}/runs/{child}/artifacts/samples/step_1.json{view}")
    page.get_by_text("View as table").wait_for(timeout=60_000)
    for column in ("prompt", "completion", "reward", "advantage"):
        page.get_by_text(column, exact=True).first.wait_for(timeout=30_000)
    page.get_by_text("step=1/group=8/sample=0").first.wait_for(timeout=30_000)
    page.screenshot(path=str(shots / "samples.png"))
    print(f"screenshots: {shots}")
