"""``grpoflow plan CONFIG [key=value ...] [--out DIR]``: print a summary, write plan.json, report.md, PNGs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner.config import PlanConfigError
from planner.loader import load_plan_config
from planner.layout import estimate_step_for_staleness
from planner.plan import Plan, build_plan
from planner.serialize import gib, pct, plan_to_dict, secs

__all__ = ["plan_command", "main", "format_summary"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*map(str, r)) for r in rows])


def format_summary(plan: Plan) -> str:
    """The concise human summary printed to stdout."""
    cfg, est = plan.config, plan.layout
    sim = est.train_step.simulation
    c = cfg.cluster
    if c.device == "cpu":
        lines = [f"plan: {plan.label}  ({cfg.model_shape.name}, {c.num_gpus} CPU ranks on this host, cap "
                 f"{gib(c.memory_cap_bytes)} per rank)",
                 f"device: this host's CPU (train.device cpu): per rank {c.peak_flops / 1e9:.0f} GFLOP/s measured "
                 f"matmul at MFU {c.mfu:g}, {c.hbm_bandwidth_bytes_per_s / 1e9:.1f} GB/s memory; times are "
                 "first-order (planner/host.py). Set plan.cluster.* to plan GPUs instead.", ""]
    else:
        lines = [f"plan: {plan.label}  ({cfg.model_shape.name}, {c.num_gpus} GPUs, cap "
                 f"{gib(c.memory_cap_bytes)} per GPU)", ""]
    lines.append(_table(["rank", "weights", "reference", "grads", "optimiser", "activations", "in flight", "logits",
                         "total"],
                        [[m.rank, gib(m.weights_bytes), gib(m.reference_bytes), gib(m.grads_bytes), gib(m.optimizer_bytes),
                          gib(m.activation_bytes), f"{m.peak_in_flight:g}", gib(m.logits_bytes), gib(m.total_bytes)]
                         for m in est.memory]))
    r = est.rollout
    lines += ["", f"fits: {'yes' if est.rejection is None else 'NO - ' + est.rejection}",
              f"rollout per GPU: weights {gib(r.weights_bytes_per_gpu)} + KV {gib(r.kv_bytes_per_gpu)} "
              f"({r.concurrent_groups}/{r.groups_per_engine} groups live) + resident {gib(r.resident_bytes_per_gpu)}; "
              f"KV per step {plan.kv.step_shared_bytes / 1e9:.1f} GB (prefix shared)",
              f"bubble ({cfg.train.schedule}): simulated {pct(sim.bubble_fraction)}", ""]
    rows = [["configured", plan.label, secs(est.step.rollout_s), secs(est.step.train_s), secs(est.step.step_s),
             f"{est.step.tokens_per_s:,.0f}"]]
    for name, cand, k in (("best colocated", plan.best_colocated, 0), ("decoupled k=0", plan.best_decoupled_sync, 0),
                          ("decoupled k=1", plan.best_decoupled_async, 1)):
        if cand is not None:
            step = estimate_step_for_staleness(cand.estimate, k)
            rows.append([name, cand.label, secs(step.rollout_s), secs(step.train_s), secs(step.step_s),
                         f"{step.tokens_per_s:,.0f}"])
    lines.append(_table(["case", "layout", "rollout", "train", "step", "tokens/s"], rows))
    if plan.search is not None:
        lines += ["", f"search: {plan.search.evaluated} layouts, {len(plan.search.feasible)} fit; rejected "
                  + ", ".join(f"{n} {k}" for k, n in sorted(plan.search.rejection_counts.items()))]
        lines.append(_table(["#", "layout", "step", "peak memory"],
                            [[i + 1, c.label, secs(c.step_s), gib(c.estimate.peak_training_bytes)]
                             for i, c in enumerate(plan.search.top(min(5, cfg.search.top_k)))]))
        near = [x for x in plan.search.rejected if x.kind == "memory"][:3]
        for x in near:
            lines.append(f"  rejected {x.label}: {x.reason}")
    return "\n".join(lines)


def plan_command(config_path: str, overrides: list[str], out_dir: str | None) -> int:
    """Plan ``config_path`` with ``key=value`` overrides; print a summary; write plan.json, report.md, PNGs."""
    try:
        cfg = load_plan_config(config_path, overrides)
    except PlanConfigError as exc:
        print(f"grpoflow plan: {exc}", file=sys.stderr)
        return 2
    plan = build_plan(cfg)
    print(format_summary(plan))
    if out_dir is not None:
        from planner.plots import write_plots
        from planner.report import render_report

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(plan_to_dict(plan), indent=1, sort_keys=True) + "\n")
        write_plots(plan, out)
        command = " ".join(["grpoflow plan", config_path, *overrides, "--out", out_dir])
        (out / "report.md").write_text(render_report(plan, command))
        print(f"\nwrote {out / 'plan.json'}, {out / 'report.md'} and plots to {out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m planner CONFIG [key=value ...] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="grpoflow plan", description=__doc__)
    parser.add_argument("config", help="run YAML (with an optional plan: section), e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.schedule=zbv plan.cluster.num_gpus=32")
    parser.add_argument("--out", default=None, help="folder for plan.json, report.md and the PNG plots")
    args = parser.parse_args(argv)
    return plan_command(args.config, args.overrides, args.out)
