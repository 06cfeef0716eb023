"""A run's per-step lineage, written by the loop's background process (flows/background.py).

The driver opens the run's parent MLflow run, then hands every later MLflow call of the loop to
one child process: :func:`open_run` once, then per step :func:`start_step` when the step is
submitted and :func:`log_step` when it has finished (or :func:`end_step` when it failed). The
child keeps the open child runs and the tokenizer in this module between calls. Each call's
arguments are small and picklable: the config, the run folder, a step's metrics, policy and
timeline.

For a step, :func:`log_step` writes the timeline (timelines/step_<k>.json), logs the decoded
sample table, the timeline, the step's Zarr group as the input dataset, the metrics and the
policy tags on the child run (the metrics on the parent too), ends the child run, redraws the
plots when asked and writes the step's "lineage" mark last, with its metrics: a step with that
mark needs no rerun (flows/loop.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flows.schema import GRPOConfig
from stages.policy.tokenizer import TextCodec
from storage.lineage import Lineage, StepRun
from storage.plots import save_run_plots
from storage.policies import PolicyRef
from storage.run_folder import RunFolder
from storage.samples import load_sample_table, step_array_specs

__all__ = ["open_run", "start_step", "log_step", "end_step"]


@dataclass
class _Run:
    cfg: GRPOConfig
    folder: RunFolder
    lineage: Lineage
    stages: tuple[str, ...]
    steps: dict[int, StepRun] = field(default_factory=dict)
    codec: TextCodec | None = None


_RUN: list[_Run] = []  # the run this process logs for (one per process)


def _run() -> _Run:
    if not _RUN:
        raise RuntimeError("lineage_writer.open_run was not called in this process")
    return _RUN[0]


def open_run(cfg: GRPOConfig, folder: RunFolder, tracking_uri: str, experiment_id: str, run_id: str,
             params: dict[str, str], stages: tuple[str, ...]) -> None:
    """Log for the parent run ``run_id`` (created by the driver) from this process from now on;
    ``stages``: the stage names the plots show."""
    _RUN[:] = [_Run(cfg, folder, Lineage.attached(tracking_uri, experiment_id, run_id, params), tuple(stages))]


def start_step(step: int, policy_version_in: int, start_time_ms: int, reopen: bool) -> str:
    """Open step ``step``'s child run (Lineage.start_step); its run id."""
    run = _run()
    handle = run.lineage.start_step(step, policy_version_in, start_time_ms=start_time_ms, reopen=reopen)
    run.steps[step] = handle
    return handle.run_id


def end_step(step: int, status: str) -> None:
    """End step ``step``'s child run with ``status`` (a step that failed)."""
    handle = _run().steps.pop(step, None)
    if handle is not None:
        handle.end(status)


def log_step(step: int, policy: PolicyRef, metrics: dict[str, float], trace_events: list[dict],
             plot_rows: list[dict] | None) -> str | None:
    """Step ``step``'s lineage (``policy``: the version it published), then its "lineage" mark
    (the module docstring); with ``plot_rows`` (every finished step's metrics) the parent's plots
    are redrawn. Returns a line with one decoded sample every mlflow.plot_every_steps steps, for
    the terminal, else None."""
    t0 = time.perf_counter()
    run = _run()
    cfg, folder = run.cfg, run.folder
    store = folder.rollout_store()
    trace_path = folder.save_trace(step, trace_events)
    if run.codec is None:  # the run's tokenizer: every version is published with the base policy's
        run.codec = TextCodec.from_policy_folder(policy.path, cfg.dataset.chat_template)
    child = run.steps.pop(step)
    with child:  # decoded samples, timeline, dataset with schema, metrics and policy; ends the child run
        table = load_sample_table(folder.rollouts, step, run.codec.decode, max(cfg.mlflow.sample_groups, 1))
        tags = child.log_samples(table, set_tag=False) if cfg.mlflow.sample_groups else {}
        child.log_artifact(trace_path, "timelines")
        child.log_rollouts(store.ref(step).path, store.digest(step), step_array_specs(folder.rollouts, step))
        child.log_metrics(metrics, tags={**tags, **child.policy_tags(policy.version, policy.path, policy.sha256)})
    if plot_rows is not None:  # refresh the plots
        run.lineage.log_plots(save_run_plots(plot_rows, folder.plots, run.stages))
    line = None
    if step % cfg.mlflow.plot_every_steps == 0 and table["id"]:  # one decoded example now and then
        line = (f"{table['id'][0]} (policy v{table['policy_version'][0]}): {table['prompt'][0]!r} -> "
                f"{table['completion'][0]!r}, reward {table['reward'][0]:.2f}, "
                f"advantage {table['advantage'][0]:+.2f}")
    stored = {k: float(v) for k, v in metrics.items()}
    stored["lineage_seconds"] = time.perf_counter() - t0
    store.mark_complete(step, "lineage", metrics=stored, mlflow_run_id=child.run_id)
    return line
