"""The run's plots as PNG files: reward curve, seconds per stage, pipeline bubble.

Input is the per-step metrics the loop already collects (one dict per finished step, with a
``step`` key). Figures are drawn on ``matplotlib.figure.Figure`` (the Agg canvas, no pyplot), so no
global backend state is touched and nothing needs a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["PLOT_FILES", "EVAL_PLOT_FILE", "save_run_plots", "save_eval_plot"]

PLOT_FILES = ("reward.png", "stage_seconds.png", "bubble.png")
EVAL_PLOT_FILE = "eval.png"
_EVAL_CURVES = ("eval_greedy_accuracy", "eval_accuracy", "eval_greedy_format_rate", "eval_greedy_truncation_rate")
_DPI = 100  # 6.4 x 3.6 in -> 640 x 360 px: legible in MLflow's artifact preview, small on disk


def _figure() -> Figure:
    # Fixed margins: tight_layout would draw every figure twice (it measures a first rendering).
    fig = Figure(figsize=(6.4, 3.6))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.14, top=0.9)
    return fig


def _axes(fig: Figure):
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return ax


def _steps(metrics: Sequence[dict[str, float]]) -> list[int]:
    return [int(m["step"]) for m in metrics]


def _reward(metrics: Sequence[dict[str, float]], path: Path) -> None:
    fig = _figure()
    ax = _axes(fig)
    steps = _steps(metrics)
    mean = [m.get("reward_mean", float("nan")) for m in metrics]
    ax.plot(steps, mean, marker="o", markersize=3, label="reward_mean")
    if all("reward_std" in m for m in metrics):
        std = [m["reward_std"] for m in metrics]
        ax.fill_between(steps, [a - s for a, s in zip(mean, std)], [a + s for a, s in zip(mean, std)],
                        alpha=0.2, label="± reward_std (over samples)")
    ax.set(xlabel="step", ylabel="reward", title="Reward per step")
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=_DPI)


def _stage_seconds(metrics: Sequence[dict[str, float]], stages: Sequence[str], path: Path) -> None:
    fig = _figure()
    ax = _axes(fig)
    steps = _steps(metrics)
    # One stacked band per stage (a bar per step and stage would be an artist each: slow to draw
    # for long runs, and the plot is redrawn every mlflow.plot_every_steps).
    ax.stackplot(steps, [[m.get(f"{stage}_seconds", 0.0) for m in metrics] for stage in stages], labels=stages,
                 step="mid")
    ax.set(xlabel="step", ylabel="seconds", title="Seconds per stage (critical path of each step)")
    ax.legend(loc="upper left", fontsize="small", ncol=3)
    fig.savefig(path, dpi=_DPI)


def _bubble(metrics: Sequence[dict[str, float]], path: Path) -> None:
    fig = _figure()
    ax = _axes(fig)
    steps = _steps(metrics)
    ranks = sorted({k for m in metrics for k in m if k.startswith("bubble_fraction_rank")},
                   key=lambda k: int(k.removeprefix("bubble_fraction_rank")))
    for key in ranks:
        ax.plot(steps, [m.get(key, float("nan")) for m in metrics], linewidth=1, alpha=0.6,
                label=key.removeprefix("bubble_fraction_"))
    ax.plot(steps, [m.get("bubble_fraction", float("nan")) for m in metrics], color="black", linewidth=2,
            label="mean over ranks")
    ax.set(xlabel="step", ylabel="idle fraction", title="Pipeline bubble per step", ylim=(0, 1))
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=_DPI)


def save_run_plots(metrics: Sequence[dict[str, float]], out_dir: str | Path, stages: Sequence[str]) -> list[Path]:
    """Write :data:`PLOT_FILES` for the steps in ``metrics`` under ``out_dir``; returns their paths
    (none when there is no step yet)."""
    if not metrics:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOT_FILES]
    _reward(metrics, paths[0])
    _stage_seconds(metrics, stages, paths[1])
    _bubble(metrics, paths[2])
    return paths


def save_eval_plot(results: dict[int, dict[str, float]], out_dir: str | Path) -> Path | None:
    """Held-out accuracy (and format and truncation rates) by policy version, as ``eval.png`` under
    ``out_dir``; None when no version was evaluated."""
    if not results:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = _figure()
    ax = _axes(fig)
    versions = sorted(results)
    for name in _EVAL_CURVES:
        if all(name in results[v] for v in versions):
            ax.plot(versions, [results[v][name] for v in versions], marker="o", markersize=3,
                    label=name.removeprefix("eval_"))
    ax.set(xlabel="policy version (steps trained)", ylabel="share of held-out prompts", ylim=(-0.02, 1.3),
           title="Held-out evaluation")
    ax.legend(loc="upper center", ncol=2, fontsize="small")  # above the curves, which stay in [0, 1]
    path = out / EVAL_PLOT_FILE
    fig.savefig(path, dpi=_DPI)
    return path
