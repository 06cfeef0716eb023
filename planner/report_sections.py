"""Report sections 3-4, the three follow-ups, the search and the assumptions (see planner.report)."""

from __future__ import annotations

import math
import re
from collections import OrderedDict

from planner.constants import BF16_BYTES
from planner.layout import estimate_step_for_staleness
from planner.memory import estimate_activation_breakdown
from planner.training import activation_impl_of
from planner.plan import Plan
from planner.plots import PLOT_FILES
from planner.rollout import speculative_tokens_per_step
from planner.serialize import gib, md_table, pct, secs

__all__ = [
    "memory_section",
    "staleness_section",
    "followup_speculative_section",
    "followup_group_section",
    "followup_sync_section",
    "search_section",
    "assumptions_section",
]

_NEAR_MISSES_SHOWN = 10
_EXAMPLES_PER_KIND = 3
_ASYNC_SHOWN = 5


def _img(name: str, alt: str) -> str:
    return f"![{alt}]({PLOT_FILES[name]})"


def _per_layer_bytes(plan: Plan, recompute: str) -> int:
    cfg = plan.config
    tr = cfg.train
    return estimate_activation_breakdown(cfg.model_shape, tr.micro_batch_size, cfg.seq_len, 1, BF16_BYTES, recompute,
                                         tensor_parallel_size=tr.tensor_model_parallel_size,
                                         impl=activation_impl_of(tr)).per_layer_bytes


def memory_section(plan: Plan) -> str:
    cfg, est = plan.config, plan.layout
    tr = cfg.train
    rows = [[m.rank, gib(m.weights_bytes), gib(m.reference_bytes), gib(m.grads_bytes), gib(m.optimizer_bytes),
             gib(m.activation_bytes),
             f"{m.peak_in_flight:g}", gib(m.logits_bytes), gib(m.working_bytes), f"**{gib(m.total_bytes)}**"]
            for m in est.memory]
    first, last = est.memory[0], est.memory[-1]
    layers = est.train_step.simulation.stage_ranks
    head = estimate_activation_breakdown(cfg.model_shape, tr.micro_batch_size, cfg.seq_len, 0, BF16_BYTES, tr.recompute,
                                         is_last_stage=True, tensor_parallel_size=tr.tensor_model_parallel_size,
                                         impl=activation_impl_of(tr),
                                         vocab_parallel=tr.tensor_parallel_rules.vocab_parallel_embedding).head_bytes
    recompute_rows = [[mode, gib(_per_layer_bytes(plan, mode), 3)] for mode in ("none", "selective", "full")]
    sim = est.train_step.simulation
    idle_per_rank = sim.bubble_fraction * est.train_step.pipeline_s
    text = [
        "## 3. Memory and the activation stash", "", "### 3.1 Training phase, per pipeline rank", "",
        md_table(["rank", "weights", "frozen reference", "grads", "optimiser", "activation stash", "in flight",
                  "logits buffers", "working layer", "total"], rows), "",
        _img("memory_training", "training memory"), "",
        f"Weights (bf16), the frozen reference (bf16, "
        + ("the whole model on every rank: train.reference_parallel = data" if tr.reference_parallel == "data"
           else "its copy of each rank's stages") + "; the KL's reference pass runs on this layout), fp32 main "
        "gradients and Adam state "
        f"({'sharded over DP' if tr.distributed_optimizer else 'replicated'}, "
        "12 B/parameter) are nearly equal on every rank; the embedding and lm_head add "
        f"{gib(first.weights_bytes - est.memory[len(est.memory) // 2].weights_bytes)} "
        f"of weights at the ends. The activation stash is what differs: under {tr.schedule} rank 0 keeps "
        f"{first.peak_in_flight:g} microbatches in flight ({gib(first.activation_bytes)}) and the last rank "
        f"{last.peak_in_flight:g} ({gib(last.activation_bytes)}). Stage PP-1 keeps the fewest microbatches but the "
        f"largest per-microbatch extras: the lm_head input and the fp32 log-softmax over V/TP kept for the token "
        f"log-probs ({gib(head)} per microbatch), plus transient bf16 logits and their fp32 gradient "
        f"({gib(last.logits_bytes)}) while the loss is back-propagated. Those scale with the vocabulary, not with the "
        "layers. Per layer and microbatch the stash is (Korthikanti et al. 2022, itemised for GQA/SwiGLU, "
        f"{tr.activation_impl} accounting, {tr.attention} attention, "
        f"{'sequence' if activation_impl_of(tr).sequence_parallel else 'no sequence'} parallelism):", "",
        md_table(["recompute", "bytes per layer per microbatch"], recompute_rows), "",
        ("With FlashAttention nothing of size s x s is kept, so selective recompute saves nothing here; full recompute "
         "keeps only each layer's input." if tr.attention == "flash" else
         "Eager attention keeps the s x s softmax; selective recompute removes it.")
        + f" Across the {len(set(layers))} pipeline ranks the peak runs from {gib(first.total_bytes)} on rank 0 "
        f"to {gib(last.total_bytes)} on the last rank.", "",
        f"Reference (and proximal-policy) log-probs are forward-only passes under no_grad and stash nothing. Per step the "
        f"reference pass costs {secs(est.reference_s)} on this layout, and the {tr.schedule} bubble leaves each rank "
        f"idle for {secs(idle_per_rank)} of the training step. Reference forwards slotted into the warm-up and "
        f"cool-down gaps could absorb {pct(min(1.0, idle_per_rank / est.reference_s), 0)} of the reference pass "
        "without adding a byte of stash. Running the pass concurrently with the policy backward on a separate "
        "stream also overlaps it, but it then competes for the same SMs and HBM bandwidth.", "",
    ]
    return "\n".join(text) + "\n" + _kv_section(plan)


def _kv_section(plan: Plan) -> str:
    cfg, est, kv = plan.config, plan.layout, plan.kv
    wl, r = cfg.workload, est.rollout
    tokens_shared = wl.prompts_per_step * wl.prompt_len + wl.num_samples * wl.gen_len
    cases = [("configured", est)] + ([("best decoupled (staleness 1)", plan.best_decoupled_async.estimate)]
                                     if plan.best_decoupled_async else [])
    rows = [[name, f"{e.rollout.rollout_gpus} GPUs, TP {e.rollout.engine_tp} x {e.rollout.num_engines}",
             gib(e.rollout.weights_bytes_per_gpu), gib(e.rollout.kv_bytes_per_group_per_gpu),
             f"{e.rollout.groups_per_engine} / {e.rollout.concurrent_groups}", gib(e.rollout.kv_bytes_per_gpu),
             gib(e.rollout.resident_bytes_per_gpu), gib(e.rollout.memory_bytes_per_gpu)] for name, e in cases]
    return "\n".join([
        "### 3.2 Rollout phase: the KV cache", "",
        f"KV per token = 2 x layers x KV heads x head_dim x bytes = {kv.per_token_bytes:,} B. The G samples of a prompt "
        f"share one prefix KV (how the runtime's engine allocates), so a group holds prompt_len + G x gen_len = "
        f"{wl.prompt_len + wl.group_size * wl.gen_len:,} tokens: {gib(kv.per_group_bytes)} for the whole model at "
        f"{cfg.rollout.page_size}-token pages. A full step of {wl.prompts_per_step} groups is {tokens_shared:,} tokens, "
        f"**{kv.step_shared_bytes / 1e9:.1f} GB** with the shared prefix against {kv.step_unshared_bytes / 1e9:.1f} GB "
        f"without ({pct(1 - kv.step_shared_bytes / kv.step_unshared_bytes)} saved). "
        + ("Page rounding adds nothing here: both lengths are whole pages. " if kv.step_paged_bytes == kv.step_shared_bytes
           else f"Page rounding adds {pct(kv.step_paged_bytes / kv.step_shared_bytes - 1, 2)}. ")
        + "Per GPU, an engine of TP t holds the KV heads of its rank:", "",
        md_table(["placement", "engines", "weights/GPU", "KV per group/GPU", "groups per engine / live",
                  "KV live/GPU", "resident training state", "total/GPU"], rows), "",
        _img("memory_rollout", "rollout memory"), "",
        f"Decode reads the weights and the live KV once per token step. At {r.concurrent_groups * wl.group_size} "
        f"sequences per engine a step takes {r.decode_step_s * 1e3:.1f} ms, so {wl.gen_len} steps are "
        f"{secs(r.decode_steps * r.decode_step_s)}: generation is bound by memory bandwidth and by the longest sample, "
        "not by FLOPs.", ""])


def staleness_section(plan: Plan) -> str:
    cfg = plan.config
    ro, tr = cfg.rollout, cfg.train
    rows = []
    for r in plan.staleness:
        d = r.drift
        rows.append([d.staleness, f"{d.logratio_std:.3f}", pct(d.outside_clip_fraction), pct(d.clipped_gradient_fraction),
                     pct(d.clipped_gradient_fraction_decoupled, 2), pct(d.tis_truncated_fraction, 2),
                     pct(d.mis_masked_fraction, 2), f"{d.token_ess:.3f}", f"1e{d.sequence_log10_ess:.0f}",
                     secs(r.step.step_s) if r.step else "-", f"{r.step.tokens_per_s:,.0f}" if r.step else "-"])
    text = [
        "## 4. Policy staleness and importance sampling", "",
        f"**Model (stated, not measured).** A token's log-ratio log(pi_train / pi_behaviour) is Gaussian with variance "
        f"sigma_0^2 + k sigma_step^2, with sigma_0 = {ro.logratio_std_mismatch} (inference/training numerics mismatch at "
        f"k = 0) and sigma_step = {ro.logratio_std_per_step} per optimiser step (2 KL ~ {ro.logratio_std_per_step ** 2:.1e}). "
        f"A share of {pct(ro.drift_hot_token_share, 0)} high-entropy tokens drifts {ro.drift_hot_std_multiplier:g}x faster, "
        f"which gives the distribution its heavy tail. The clip is [1 - {tr.clip_eps_low}, 1 + {tr.clip_eps_high}] "
        "(clip-higher); half of the tokens face each side.", "",
        md_table(["k", "std log r", "r outside clip", "gradient zeroed (PPO)", "zeroed, decoupled PPO", "TIS truncated (r>2)",
                  "MIS masked", "token ESS", "sequence ESS", "step (best decoupled)", "tokens/s"], rows), "",
        _img("staleness", "staleness"), "",
    ]
    text += [_staleness_argument(plan), ""]
    return "\n".join(text)


def _staleness_argument(plan: Plan) -> str:
    rows = {r.drift.staleness: r for r in plan.staleness}
    if 0 not in rows or 1 not in rows or rows[0].step is None or rows[1].step is None:
        return "Throughput rows need the search (search.enabled=true)."
    s0, s1, d1 = rows[0].step, rows[1].step, rows[1].drift
    d2 = rows.get(2, rows[1]).drift
    cfg = plan.config
    updates = cfg.workload.num_samples // cfg.global_batch_size
    prox = estimate_step_for_staleness(plan.best_decoupled_async.estimate, 1)
    if updates == 1:
        prox_cost = ("With one optimiser update per step pi_prox is the trainer's own log-prob, detached, from the "
                     "same forward, so it costs nothing.")
    else:
        trainer = prox.reference_s * 2 + prox.train_s + prox.weight_send_s
        period = max(prox.rollout_s + prox.weight_sync_s, trainer)
        prox_cost = (f"With {updates} mini-batch updates per step pi_prox needs one more forward pass "
                     f"({secs(prox.reference_s)}) on the trainer lane. The period becomes {secs(period)} "
                     f"({pct(period / prox.step_s - 1)}).")
    no_kl = max(prox.rollout_s + prox.weight_sync_s, prox.train_s + prox.weight_send_s)
    return (
        f"Overlap raises throughput from {s0.tokens_per_s:,.0f} to {s1.tokens_per_s:,.0f} tokens/s "
        f"({pct(s1.tokens_per_s / s0.tokens_per_s - 1)}) at k = 1, and further staleness adds nothing: the period is "
        f"already the slower lane. Drift grows with k all the same. At k = 1 the clip zeroes the gradient of "
        f"{pct(d1.clipped_gradient_fraction)} of tokens, at k = 2 {pct(d2.clipped_gradient_fraction)}, and those tokens "
        "are the high-entropy ones that carry the learning signal. The ratio r = pi_theta / pi_behaviour then mixes two "
        "things: the update (what the clip is for) and the lag (which the clip should not punish). Mitigations, in the "
        "order we apply them:\n\n"
        "1. **Bounded staleness k <= 1.** It takes all of the throughput gain. The store records `policy_version` per "
        "sample, and a sample older than k versions is dropped before the advantage stage.\n"
        "2. **Decoupled PPO** (Hilton et al. 2022). Clip against a proximal policy pi_prox, the trainer's weights "
        "at the start of the step. The lag and the engine mismatch move into an importance weight pi_prox / "
        "pi_behaviour. The clip sees only the drift since the snapshot, "
        f"{pct(d1.clipped_gradient_fraction_decoupled, 2)} zeroed at any k. {prox_cost}\n"
        f"3. **Truncated importance sampling** (TIS, cap C = 2) on that weight, per token. At k = 1 it truncates "
        f"{pct(d1.tis_truncated_fraction, 3)} of tokens. Masked IS (MIS) drops the tokens outside [1/2, 2] instead "
        f"of capping their weight ({pct(d1.mis_masked_fraction, 3)} at k = 1). That removes the truncation bias at "
        "the cost of those tokens.\n"
        "4. **Token-level ratios only.** A sequence-level ratio over a "
        f"{cfg.workload.gen_len}-token completion has an effective sample size of ~1e{d1.sequence_log10_ess:.0f} "
        "at k = 1.\n"
        "5. **Behaviour log-probs from the sampler.** `behav_logp` is stored as sampled by the inference engine and "
        "never recomputed with training numerics, so sigma_0 is corrected rather than ignored.\n\n"
        f"The reference pass ({secs(prox.reference_s)}) sits on the trainer lane. With no KL term (beta = 0, as in "
        f"DAPO) it disappears, and the k = 1 period would be {secs(no_kl)}.")


def followup_speculative_section(plan: Plan) -> str:
    cfg = plan.config
    wl, ro = cfg.workload, cfg.rollout
    rows = [[r.name, r.rollout.decode_steps, f"{r.rollout.decode_step_s * 1e3:.1f} ms", secs(r.rollout.total_s)]
            for r in plan.rollout_variants]
    base, cont, spec = plan.rollout_variants[0], plan.rollout_variants[2], plan.rollout_variants[3]
    gamma = ro.speculative_draft_tokens or 4
    tau = speculative_tokens_per_step(gamma, ro.speculative_acceptance)
    padded = wl.prompt_len + wl.gen_len
    packed = wl.prompt_len + max(1, wl.gen_len // 2)
    return "\n".join([
        "## Follow-up A: dynamic-length speculative decoding instead of synchronised batches", "",
        md_table(["generation mode", "decode steps", "per step", "rollout time"], rows), "",
        _img("rollout_variants", "rollout variants"), "",
        f"Synchronised batching runs every wave until its longest sample reaches {wl.gen_len} tokens. Continuous "
        "batching refills finished slots. "
        + (f"Here each engine holds all of its {base.rollout.groups_per_engine} groups at once, so there is nothing to "
           "refill with and the step is still bounded by the longest sample "
           if base.rollout.concurrent_groups >= base.rollout.groups_per_engine else
           f"Here an engine holds {base.rollout.concurrent_groups} of its {base.rollout.groups_per_engine} groups at "
           "once, so refilling removes the waves' tails ")
        + f"({secs(base.rollout.total_s)} -> {secs(cont.rollout.total_s)}). "
        f"Speculative decoding (gamma = {gamma}, acceptance {ro.speculative_acceptance}: "
        f"{tau:.2f} tokens per verification step) shortens exactly that critical path: {secs(spec.rollout.total_s)}. "
        "What changes for the pipeline:", "",
        "- **Completion becomes a stream.** Samples finish at data-dependent times, so generation is no longer a phase "
        "with a barrier. Rollout writes each group to the store when its G samples are done, and reward scoring, the "
        "reference pass and the advantage run per group. The group stays the unit of hand-off because its advantage "
        "needs all G rewards. A sample is never handed off alone.",
        "- **Training consumes whole groups**, with the staleness bound (Section 4) deciding how old a group may be. "
        "In the async layout the trainer starts the next update once a global batch of complete groups is stored; "
        "stragglers land in the next step, where partial rollouts resume on the new weights.",
        f"- **Fixed microbatch shapes.** torch's pipeline needs them. Padding every sample to {padded} tokens trains "
        f"{pct(1 - packed / padded)} padding when the mean completion is half the cap. Packing to a token budget removes "
        "that, but makes m vary per step, so the schedule is rebuilt per step with m from the packer; the bubble "
        "follows (p-1)/(m+p-1) with that m.",
        "- **The draft model is policy-dependent.** A trained draft drifts off the policy. Either sync it with the "
        "weights (more bytes) or use model-free drafting (n-gram / prompt lookup), whose acceptance does not decay.", ""])


def followup_group_section(plan: Plan) -> str:
    cfg = plan.config
    wl, tr = cfg.workload, cfg.train
    group_tokens = wl.group_size * cfg.seq_len
    fitting = [r for r in plan.microbatches if not r.error and r.fits and r.recompute == tr.recompute]
    cap_mbs = max((r.micro_batch_size for r in fitting), default=0)
    capacity = cap_mbs * cfg.seq_len
    spans = math.ceil(group_tokens / capacity) if capacity else float("inf")
    barrier = {r.microbatches: r for r in plan.group_barriers}
    k = max(1, int(spans)) if capacity else 1
    cost = barrier.get(k)
    full = max((r.micro_batch_size for r in plan.microbatches if not r.error and r.fits and r.recompute == "full"),
               default=0)
    full_note = (f" Full recompute raises that to {full} sequences ({full * cfg.seq_len:,} tokens) at the training-time "
                 "cost shown in Section 2." if full > cap_mbs else "")
    return "\n".join([
        "## Follow-up B: G larger than one microbatch's token capacity", "",
        f"On the configured layout (recompute {tr.recompute}) the largest micro-batch that fits is {cap_mbs} "
        f"sequence(s), {capacity:,} tokens.{full_note} A group is G x (prompt + generation) = {group_tokens:,} tokens, "
        f"so it spans {spans} microbatches, and more as G grows. The reward mean and variance do not need the "
        "microbatches at all:", "",
        "- Rewards are scalars, final once the reward stage has scored the group. The advantage stage computes "
        "mean and std per group from the store before training starts. For G too large for one task, it merges "
        "per-chunk (count, mean, M2) partials with Chan et al.'s parallel-variance update, in a fixed order, so the "
        "result is deterministic. Chunks are whole multiples of G, or shard-aligned sub-groups.",
        "- The loss needs only A_i per sample and the global denominators. Both are in the store before the first "
        "forward, so no microbatch waits on another and the pipeline never stalls. With token-mean "
        "aggregation the denominator is the batch's token count; with per-group normalisation it is a per-group "
        "count, computed in the same pass.",
        "- Doing it inside the pipeline instead costs the group barrier of Section 1.3: "
        + (f"at k = {k} microbatches per group rank 0 would stash {gib(cost.stash_bytes_first_rank)}."
           if cost else "beyond the simulated range, a stash that grows linearly with k.")
        + " Groups that straddle DP replicas would also need a cross-replica all-reduce per group. The batch split "
        "therefore keeps groups on one replica (Section 2).", ""])


def followup_sync_section(plan: Plan) -> str:
    cfg, est = plan.config, plan.layout
    rows = [[r.placement, r.mode, "yes" if r.in_flight else "no", secs(r.sync.transfer_s, 2), secs(r.sync.kv_s, 2),
             f"**{secs(r.sync.total_s, 2)}**", f"{r.sync.kv_tokens_invalidated:,.0f}", f"{r.sync.kv_pages_invalidated:,.0f}"]
            for r in plan.sync_variants]
    dec = [r for r in plan.sync_variants if r.in_flight]
    by_mode = {r.mode: r.sync for r in dec}
    r = (plan.best_decoupled_async.estimate if plan.best_decoupled_async else est).rollout
    free = r.memory_cap_bytes - r.memory_bytes_per_gpu
    text = [
        "## Follow-up C: paged attention and weight-sync latency", "",
        md_table(["placement", "KV of in-flight sequences", "in flight", "transfer", "KV handling", "pause",
                  "tokens invalidated", "pages invalidated"], rows), "",
        _img("weight_sync", "weight sync"), "",
        f"A weight update moves {est.weight_sync.bytes_total / 1e9:.1f} GB of bf16 weights. Each inference GPU receives "
        f"its TP shard, {est.weight_sync.bytes_per_receiver / 1e9:.1f} GB, and the transfer is bound by the per-GPU "
        f"network ({cfg.cluster.inter_node_bandwidth_bytes_per_s / 1e9:.0f} GB/s). Paged attention does not change the "
        "transfer. It changes what the update does to the KV cache:", "",
        "- Every cached page was computed by the old weights. Freeing pages is a page-table edit (microseconds), not a "
        "copy, so invalidation is cheap. The prompt-prefix cache must be flushed on every update.",
    ]
    if by_mode:
        text += [
            "- Sequences in flight at the update (asynchronous rollout) have "
            f"{next(iter(by_mode.values())).kv_tokens_invalidated:,.0f} "
            f"tokens of KV per engine. Re-prefilling them costs {secs(by_mode['recompute'].kv_s)}, waiting for them to "
            f"drain {secs(by_mode['drain'].kv_s)}, and continuing on the stale pages 0 s.",
            "- **Keep** is sound when the behaviour log-probs are the sampler's own (`behav_logp`). Tokens generated on "
            "stale KV are then off-policy by a known ratio, which TIS corrects (Section 4). That makes the pause "
            f"just the transfer, {secs(by_mode['keep'].total_s, 2)}.",
        ]
    need = est.weight_sync.bytes_per_receiver
    if free >= need:
        buffer = (f"- Double-buffering the weights so decode continues during the transfer needs another {gib(need)} "
                  f"per GPU. The decoupled engine has {gib(free)} free under the cap with its live KV, so it fits: "
                  "receive into the spare buffer while decoding, then swap between two decode steps. The pause "
                  "shrinks to the swap plus the KV handling above.")
    else:
        buffer = (f"- Double-buffering the weights so decode continues during the transfer needs another {gib(need)} "
                  f"per GPU, but the engine has only {gib(max(free, 0.0))} free under the cap with its live KV. "
                  "The update is therefore in place, with a pause of the transfer time, unless the KV budget is cut "
                  "by that much.")
    text += [buffer, ""]
    return "\n".join(text)


def search_section(plan: Plan) -> str:
    if plan.search is None:
        return "## Layout search\n\nDisabled (search.enabled=false).\n"
    cfg, res = plan.config, plan.search
    cap = cfg.cluster.memory_cap_bytes
    rows = [[i + 1, f"`{c.label}`", secs(c.step_s), secs(c.step_s_sync), secs(c.step_s_async),
             f"{c.estimate.step.tokens_per_s:,.0f}", gib(c.estimate.peak_training_bytes),
             gib(cap - c.estimate.peak_training_bytes)] for i, c in enumerate(res.top(cfg.search.top_k))]
    decoupled = sorted((c for c in res.feasible if c.config.rollout.placement == "decoupled"),
                       key=lambda c: c.step_s_async)[:_ASYNC_SHOWN]
    async_rows = [[i + 1, f"`{c.label}`", secs(c.step_s_async), secs(c.step_s_sync),
                   gib(c.estimate.peak_training_bytes), gib(cap - c.estimate.peak_training_bytes)]
                  for i, c in enumerate(decoupled)]
    near = [[f"`{r.label}`", r.reason] for r in res.rejected if r.kind in ("memory", "rollout")][:_NEAR_MISSES_SHOWN]
    examples: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
    for kind in ("static-memory", "dominated", "constraint"):
        shown = 0
        for r in res.rejected:
            key = (kind, re.sub(r"[0-9.]+", "#", r.reason)[:48])
            if r.kind == kind and key not in examples and shown < _EXAMPLES_PER_KIND:
                examples[key] = [f"`{r.label}`", r.kind, r.reason]
                shown += 1
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(res.rejection_counts.items()))
    return "\n".join([
        "## Layout search", "",
        f"{res.evaluated:,} layouts evaluated (placement and GPU split x TP x PP x DP x schedule/v x micro-batch x "
        f"recompute, with the inference-engine TP chosen per layout), {len(res.feasible)} fit. Fastest first, at the "
        "configured staleness:", "",
        md_table(["#", "layout", "step", "step k=0", "step k=1", "tokens/s", "peak training memory", "headroom"], rows), "",
        _headroom_note(plan), "",
        "Fastest decoupled layouts with staleness 1 (rollout and training overlapped):", "",
        md_table(["#", "layout", "step k=1", "step k=0", "peak training memory", "headroom"], async_rows), "",
        f"Rejected: {counts}. Near misses, closest to fitting first:", "",
        md_table(["layout", "why it fails"], near), "",
        "Examples of the other rejection reasons:", "",
        md_table(["layout", "kind", "why it fails"], list(examples.values())), ""])


def _headroom_note(plan: Plan) -> str:
    res, cap = plan.search, plan.config.cluster.memory_cap_bytes
    margin = plan.config.search.min_headroom_fraction
    top = res.feasible[0]
    tight = cap - top.estimate.peak_training_bytes < margin * cap
    roomy = [c for c in res.feasible if cap - c.estimate.peak_training_bytes >= margin * cap]
    if not tight or not roomy:
        return f"The fastest layout keeps {gib(cap - top.estimate.peak_training_bytes)} of headroom under the cap."
    safe = roomy[0]
    return (f"The fastest layout leaves only {gib(cap - top.estimate.peak_training_bytes)} under the cap. The "
            f"recommendations use only layouts with at least {pct(margin, 0)} of the cap "
            f"({gib(margin * cap)}) spare (`search.min_headroom_fraction`), because activation memory moves with "
            f"packing and allocator fragmentation. The fastest of those here is `{safe.label}` at "
            f"{secs(safe.step_s)} ({pct(safe.step_s / top.step_s - 1)} slower, "
            f"{gib(cap - safe.estimate.peak_training_bytes)} spare).")


def assumptions_section(plan: Plan) -> str:
    cfg = plan.config
    return "\n".join([
        "## Assumptions, limits and how the numbers are checked", "",
        f"- Compute at MFU {cfg.cluster.mfu} of {cfg.cluster.peak_flops / 1e12:.0f} TFLOP/s; FLOPs 6N per token plus "
        "causal attention (PaLM App. B halved for the mask); TP collectives not overlapped with compute; pipeline "
        "transfers overlap compute (edge latency only).",
        "- Decode is a roofline: weights plus live KV read once per step at "
        f"{pct(cfg.cluster.hbm_efficiency, 0)} of HBM bandwidth, plus two latency-bound all-reduces per layer. "
        "Prefix sharing saves KV memory but decode still reads the prefix for every sample (no cascade attention).",
        "- Activation bytes follow Korthikanti et al. 2022, itemised (exact against the paper for a GPT shape). "
        "In-flight microbatches come from the schedule's own action order. W keeps its microbatch's activations "
        "until it runs, an upper bound for zero-bubble schedules.",
        "- DualPipeV is approximate: its overlapped F&B pairs run back to back, as in torch's runtime.",
        "- Staleness: one global drift model (Section 4). Larger k only absorbs step-to-step jitter, which is not "
        "modelled.",
        "- Checked against the runtime (tests in `tests/planner/`, fed by runtime measurements): "
        "`simulate_schedule(...)` with per-(stage, action) means from a training timeline predicts the step time; "
        "`estimate_activation_bytes_per_microbatch(...)` against the saved-tensor bytes; "
        "`estimate_kv_cache_bytes(...)` against the rollout engine's allocation.", ""])
