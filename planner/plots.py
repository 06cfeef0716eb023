"""PNG figures of a :class:`Plan` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

from planner.constants import GIB  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.schedules import estimate_closed_form_bubble  # noqa: E402
from stages.layout import schedule_error  # noqa: E402
from planner.simulator import ActionDurations, simulate_schedule  # noqa: E402

__all__ = ["write_plots", "PLOT_FILES"]

PLOT_FILES = {
    "timeline": "schedule_timeline.png",
    "bubble": "bubble_vs_microbatches.png",
    "memory_training": "memory_training.png",
    "memory_rollout": "memory_rollout.png",
    "step_time": "step_time.png",
    "split": "rollout_split.png",
    "staleness": "staleness.png",
    "rollout_variants": "rollout_variants.png",
    "weight_sync": "weight_sync.png",
}
_KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
_PHASE_COLORS = ["#4C72B0", "#8172B3", "#DD8452", "#55A868", "#937860"]
_DPI = 110


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def _timeline(plan: Plan, path: Path) -> None:
    """Gantt chart per rank of each schedule on this layout's stage times, m = 2p for legibility."""
    p = plan.config.train.pipeline_model_parallel_size
    m = 2 * p
    rows = [r for r in plan.schedules
            if r.durations is not None and schedule_error(r.schedule, p, m, r.num_virtual) is None]
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.1 + 0.32 * p * len(rows)), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        sim = simulate_schedule(row.schedule, p, m, row.num_virtual, row.durations)
        for rank in range(p):
            for kind, color in _KIND_COLORS.items():
                spans = [(e.start_s, e.end_s - e.start_s) for e in sim.events if e.rank == rank and e.kind == kind]
                if spans:
                    ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
        ax.set_xlim(0, sim.makespan_s * 1.01)
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)], fontsize=6)
        label = row.schedule + (f" (v={row.num_virtual})" if row.num_virtual > 1 else "")
        ax.set_title(f"{label}: m={m}, bubble {sim.bubble_fraction:.1%}, step {sim.makespan_s:.2f} s", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("seconds (this layout's per-stage F / I / W times)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLORS.values()]
    axes[0, 0].legend(handles, ["F forward", "B full backward", "I input-backward", "W weight-backward"],
                      fontsize=7, ncol=4, loc="upper right")
    _save(fig, path)


def _bubble(plan: Plan, path: Path) -> None:
    p = plan.config.train.pipeline_model_parallel_size
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, row in enumerate(r for r in plan.schedules):
        ms = [m for m in range(p, 8 * p + 1, p) if schedule_error(row.schedule, p, m, row.num_virtual) is None]
        v = row.num_virtual
        sims = [simulate_schedule(row.schedule, p, m, v, ActionDurations(
            forward_s=1 / v, backward_input_s=1 / v, backward_weight_s=1 / v), keep_events=False).bubble_fraction
            for m in ms]
        closed = [estimate_closed_form_bubble(row.schedule, p, m, v, 1, 1, 1) for m in ms]
        label = row.schedule + (f" v={v}" if v > 1 else "") + (" (same as 1f1b)" if row.schedule == "gpipe" else "")
        color = f"C{i}"
        ax.plot(ms, closed, color=color, linestyle="--", linewidth=1)
        hollow = row.schedule == "gpipe"
        ax.plot(ms, sims, "o", color=color, markersize=8 if hollow else 4, label=label,
                markerfacecolor="none" if hollow else color)
    ax.set_xlabel(f"microbatches m (p = {p}, equal F = I = W, free transfers)")
    ax.set_ylabel("bubble fraction")
    ax.set_title("Bubble: closed form (dashed) vs simulated order (dots)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


def _memory_training(plan: Plan, path: Path) -> None:
    mem = plan.layout.memory
    parts = [("weights", "weights_bytes"), ("frozen reference", "reference_bytes"), ("grads", "grads_bytes"),
             ("optimiser", "optimizer_bytes"),
             ("activation stash", "activation_bytes"), ("logits buffers", "logits_bytes"),
             ("working layer", "working_bytes")]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    bottoms = [0.0] * len(mem)
    for i, (name, attr) in enumerate(parts):
        values = [getattr(m, attr) / GIB for m in mem]
        ax.bar([m.rank for m in mem], values, bottom=bottoms, label=name, color=f"C{i}")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    cfg = plan.config.cluster
    ax.axhline(cfg.memory_cap_bytes / GIB, color="red", linestyle="--", label=f"cap {cfg.memory_cap_bytes / GIB:.0f} GiB")
    ax.axhline(cfg.memory_bytes / GIB, color="black", linewidth=0.8, label=f"device {cfg.memory_bytes / GIB:.0f} GiB")
    for m, top in zip(mem, bottoms):
        ax.text(m.rank, top + 0.8, f"{top:.1f}\n({m.peak_in_flight:g} mb)", ha="center", fontsize=7)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"Training-phase memory per pipeline rank: {plan.label}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    ax.set_ylim(0, cfg.memory_bytes / GIB * 1.25)
    _save(fig, path)


def _memory_rollout(plan: Plan, path: Path) -> None:
    cases = [("configured: " + plan.config.rollout.placement, plan.layout)]
    if plan.best_decoupled_async is not None:
        cases.append(("decoupled " + f"{plan.best_decoupled_async.config.rollout_gpus} GPUs",
                      plan.best_decoupled_async.estimate))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    names = [c[0] for c in cases]
    parts = [("engine weights", lambda r: r.weights_bytes_per_gpu), ("resident training state",
                                                                      lambda r: r.resident_bytes_per_gpu),
             ("KV cache (live)", lambda r: r.kv_bytes_per_gpu), ("workspace", lambda r: r.workspace_bytes_per_gpu)]
    bottoms = [0.0] * len(cases)
    for i, (name, fn) in enumerate(parts):
        values = [fn(est.rollout) / GIB for _, est in cases]
        ax.bar(names, values, bottom=bottoms, label=name, color=f"C{i}")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, (_, est) in enumerate(cases):
        r = est.rollout
        ax.text(x, bottoms[x] + 0.8, f"{bottoms[x]:.1f} GiB, {r.concurrent_groups} groups live\n"
                f"(all groups: KV {r.kv_bytes_all_groups_per_gpu / GIB:.1f} GiB)", ha="center", fontsize=7)
    cfg = plan.config.cluster
    ax.axhline(cfg.memory_cap_bytes / GIB, color="red", linestyle="--", label="cap")
    ax.set_ylabel("GiB per GPU")
    ax.set_title("Rollout-phase memory per GPU", fontsize=10)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    ax.set_ylim(0, cfg.memory_bytes / GIB * 1.25)
    _save(fig, path)


def _step_cases(plan: Plan) -> list[tuple[str, object]]:
    cases = [("configured", plan.layout.step)]
    if plan.best_colocated is not None:
        cases.append(("best colocated", plan.best_colocated.estimate.step))
    for name, cand, k in (("best decoupled k=0", plan.best_decoupled_sync, 0),
                          ("best decoupled k=1", plan.best_decoupled_async, 1)):
        if cand is not None:
            row = next((r.step for r in plan.staleness if r.drift.staleness == k), None)
            cases.append((name, row or cand.estimate.step))
    return cases


def _step_time(plan: Plan, path: Path) -> None:
    cases = _step_cases(plan)
    phases = [("rollout", "rollout_s"), ("reference", "reference_s"), ("train", "train_s"),
              ("weight sync", "weight_sync_s"), ("offload", "offload_s")]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * len(cases)))
    for y, (name, step) in enumerate(cases):
        overlapped = step.placement == "decoupled" and step.staleness >= 1
        lanes = ([(y - 0.15, [("rollout", step.rollout_s), ("weight sync", step.weight_sync_s)]),
                  (y + 0.15, [("reference", step.reference_s), ("train", step.train_s),
                              ("weight sync", step.weight_send_s)])] if overlapped else
                 [(y, [(phase, getattr(step, attr)) for phase, attr in phases])])
        right = 0.0
        for lane_y, segments in lanes:
            left = 0.0
            for phase, width in segments:
                color = _PHASE_COLORS[[p[0] for p in phases].index(phase)]
                ax.barh(lane_y, width, left=left, color=color, height=0.28 if overlapped else 0.55)
                left += width
            right = max(right, left)
        ax.plot([step.step_s, step.step_s], [y - 0.38, y + 0.38], color="black", linewidth=2)
        note = " (rollout lane above, trainer lane below)" if overlapped else ""
        ax.text(right + 2, y, f"step {step.step_s:.0f} s, {step.tokens_per_s / 1e3:.1f}k tok/s{note}", va="center",
                fontsize=8)
    for i, (phase, _) in enumerate(phases):
        ax.barh(0, 0, color=_PHASE_COLORS[i], label=phase)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([c[0] for c in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (bars: phases back to back; black tick: step period with overlap)")
    ax.set_xlim(0, max(c[1].sequential_s for c in cases) * 1.55)
    ax.legend(fontsize=7, loc="lower right", ncol=5)
    ax.set_title("GRPO step time: colocated vs decoupled", fontsize=10)
    _save(fig, path)


def _split(plan: Plan, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if plan.search is not None:
        for k, style in ((0, "o-"), (1, "s-")):
            best = plan.search.best_by_split(k, plan.config.search.min_headroom_fraction)
            points = sorted((g, c.step_s_sync if k == 0 else c.step_s_async)
                            for (placement, g), c in best.items() if placement == "decoupled")
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=f"decoupled, staleness {k}")
        if plan.best_colocated is not None:
            ax.axhline(plan.best_colocated.step_s_sync, color="black", linestyle="--", label="colocated (best layout)")
    ax.set_xlabel("GPUs given to rollout (the rest train)")
    ax.set_ylabel("step time (s), best feasible training layout")
    ax.set_title("Rollout / training GPU split", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "search disabled: no split to compare", transform=ax.transAxes, ha="center")
    _save(fig, path)


def _staleness(plan: Plan, path: Path) -> None:
    ks = [r.drift.staleness for r in plan.staleness]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    drift = [r.drift for r in plan.staleness]
    left.plot(ks, [d.clipped_gradient_fraction for d in drift], "o-", label="clip zeroes gradient (PPO clip vs behaviour)")
    left.plot(ks, [d.clipped_gradient_fraction_decoupled for d in drift], "s-",
              label="same, decoupled PPO (clip vs proximal)")
    left.plot(ks, [r.drift.mis_masked_fraction for r in plan.staleness], "^-", label="MIS masked (r outside [1/2, 2])")
    left.plot(ks, [r.drift.tis_truncated_fraction for r in plan.staleness], "v-", label="TIS truncated (r > 2)")
    left.set_xlabel("staleness k (policy versions)")
    left.set_ylabel("fraction of tokens")
    left.set_title("Drift model: tokens affected vs staleness", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    steps = [r.step for r in plan.staleness]
    if all(s is not None for s in steps):
        right.plot(ks, [s.tokens_per_s / 1e3 for s in steps], "o-", label="best decoupled layout")
    if plan.best_colocated is not None:
        right.axhline(plan.best_colocated.estimate.step.tokens_per_s / 1e3, color="black", linestyle="--",
                      label="colocated (staleness has no effect)")
    right.set_xlabel("staleness k")
    right.set_ylabel("trained tokens / s (thousands)")
    right.set_title("Throughput vs staleness", fontsize=10)
    right.grid(alpha=0.3)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "search disabled", transform=right.transAxes, ha="center")
    right.set_ylim(bottom=0)
    _save(fig, path)


def _rollout_variants(plan: Plan, path: Path) -> None:
    rows = plan.rollout_variants
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.6 * len(rows)))
    ax.barh(range(len(rows)), [r.rollout.total_s for r in rows], color="C0")
    pad = 0.01 * max(r.rollout.total_s for r in rows)
    for y, r in enumerate(rows):
        ax.text(r.rollout.total_s + pad, y, f"{r.rollout.total_s:.3g} s", va="center", fontsize=8)
    ax.set_xlim(0, max(r.rollout.total_s for r in rows) * 1.15)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.name for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("rollout seconds per step (configured placement; 'mean gen_len/2': lengths vary, mean half the cap)")
    ax.set_title("Generation: batching and speculative decoding", fontsize=10)
    _save(fig, path)


def _weight_sync(plan: Plan, path: Path) -> None:
    rows = plan.sync_variants
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.5 * len(rows)))
    names = [f"{r.placement}, KV {r.mode}" + ("" if r.in_flight else " (nothing in flight)") for r in rows]
    ax.barh(range(len(rows)), [r.sync.transfer_s for r in rows], color="C0", label="weight transfer")
    ax.barh(range(len(rows)), [r.sync.kv_s for r in rows], left=[r.sync.transfer_s for r in rows], color="C3",
            label="KV of in-flight sequences")
    pad = 0.01 * max(r.sync.total_s for r in rows)
    for y, r in enumerate(rows):
        ax.text(r.sync.total_s + pad, y, f"{r.sync.total_s:.3g} s", va="center", fontsize=8)
    ax.set_xlim(0, max(r.sync.total_s for r in rows) * 1.15)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds the rollout engines pause per weight update")
    ax.legend(fontsize=7)
    ax.set_title("Weight synchronisation latency", fontsize=10)
    _save(fig, path)


def write_plots(plan: Plan, out_dir: str | Path) -> dict[str, Path]:
    """Write every figure into ``out_dir``; returns name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = {"timeline": _timeline, "bubble": _bubble, "memory_training": _memory_training,
               "memory_rollout": _memory_rollout, "step_time": _step_time, "split": _split,
               "staleness": _staleness, "rollout_variants": _rollout_variants, "weight_sync": _weight_sync}
    paths = {}
    for name, writer in writers.items():
        path = out / PLOT_FILES[name]
        writer(plan, path)
        paths[name] = path
    return paths
