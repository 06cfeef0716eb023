"""One GRPO iteration as a Dask graph.

    prompts(step) ─► rollout ─► reward + advantage ──────────────┐
                            └─► reference ─► (proximal) ─────────┴─► train ─► publish(policy v+1)

Edges carry small refs (StepRef, PolicyRef), never tensors: every stage reads its inputs from
the step's Zarr group and writes its outputs there. A stage already marked complete in the store
is not run again, so a rerun of a crashed iteration picks up after the last complete stage.

Each stage is a :class:`StageFutures`: its tasks (``work``, whose results are the stage's
measurements) and the one task that marks the stage complete once they have all written
(``gate``); downstream stages wait on the gate. A stage of one task marks itself, and so does the
output rank's task of the reference and proximal passes (the only writer: its pass ends only once
every rank has entered it and sent it its share; the mark is written in that pinned task, without
the gates' retries). A scoring task holds whole groups, so it writes their advantages too and marks
reward and advantage together; publish marks train before it publishes. The work itself is in flows/tasks.py (thin
load -> stage -> save functions) and stages/.

With rollout.max_staleness s >= 1 several steps are in flight (flows/async_schedule.py): step k
generates from the policy version the rule names, decoupled PPO anchors the clip on the trainer's
current weights (the train forward's own log-probs, or a ``proximal`` stage's stored pass with
train.off_policy.proximal = pass), and the training-rank tasks of step k wait on step k-1's train
(``prev_train``), so every rank runs the collectives of consecutive steps in the same order.
:func:`plan_step` lays one step's graph out without Dask (a :class:`StepPlan`: its tasks and
stages, one planner method per stage, in the diagram's order), :func:`submit_plan` submits it,
:func:`submit_iteration` does both for a step of the store, and :func:`finish_iteration` waits for it.

Losing a worker: stateless tasks (scoring, advantage, publish, the gates) carry no worker
restriction and Dask ``retries``, and rewrite whole chunk-aligned regions, so Dask reruns them
elsewhere when their worker dies; rollout tasks ask only for the ``rollout`` resource, so a
restarted engine takes them (it loads the policy on first use). Training and reference tasks are
pinned to the address each rank was built on: while the step runs, the iteration checks every
``_POLL_S`` that those workers are still there and ends with a :class:`WorkerLostError` as soon as
one is not; flows/run_loop.py then rebuilds the ranks and reruns the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Collection

from dask.base import tokenize
from distributed import Client, Future, wait

from flows import tasks, weight_sync
from flows.cluster import Pools, lost_workers, worker_addresses
from flows.config import GRPOConfig, config_hash
from flows.results import (ProximalResult, ReferenceResult, RolloutResult, ScoreResult, TaskResult, TrainResult,
                           result_of_stage)
from stages.reward import merge_function_stats
from storage.policies import PolicyRef
from storage.rollouts import RolloutStore, StepLayout, StepRef
from storage.run_folder import RunFolder

__all__ = ["STAGES", "IterationError", "WorkerLostError", "IterationResult", "PendingIteration", "PendingPolicy",
           "StageFutures", "Dep", "Task", "StepPlan", "plan_step", "submit_plan", "run_iteration", "prepare_step",
           "submit_iteration", "finish_iteration", "step_layout", "prompt_ranges", "step_stages", "inside_stages",
           "stage_inputs"]

STAGES = ("rollout", "reward", "reference", "advantage", "train", "publish")
# What each stage waits for; a stage's seconds are measured from the last of these finishing.
_AFTER = {"rollout": (), "reward": ("rollout",), "reference": ("rollout",), "proximal": ("reference",),
          "advantage": ("reward",), "train": ("advantage", "reference", "proximal"), "publish": ("train",)}


_POLL_S = 0.5  # how often a running step checks that its training workers are alive
_STATELESS_RETRIES = 2  # Dask reruns of a reward / advantage / publish / gate task that raised
_LOST_GRACE_S = 3.0  # a rank's peers may report its death before the scheduler has noticed it


def inside_stages(cfg: GRPOConfig, done: Collection[str] = ()) -> dict[str, str]:
    """The stages ``cfg``'s graph runs inside another stage's tasks: {stage: host}. ``done``: the
    stages a resumed step has complete; a pair one of whose stages is among them runs apart (the
    other stage alone, or neither)."""
    pairs = {**({"reward": "rollout"} if cfg.reward.in_rollout else {}),
             **({"reference": "train"} if cfg.train.reference_pass == "fused" and cfg.train.uses_reference else {})}
    return {stage: host for stage, host in pairs.items() if not {stage, host} & set(done)}


def stage_inputs(through: Collection[str]) -> dict[str, tuple[str, ...]]:
    """What each stage waits for when nothing waits on the stages ``through`` (run inside another
    stage's tasks, or beside the stages after them): a stage waits for what those waited for."""
    def inputs(stage: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x for d in _AFTER[stage] for x in (inputs(d) if d in through else (d,))))
    return {s: inputs(s) for s in _AFTER}


def step_stages(cfg: GRPOConfig) -> tuple[str, ...]:
    """The stages of every step: :data:`STAGES` less ``reference`` when nothing reads the
    reference's log-probs (train.uses_reference: kl_beta 0), plus ``proximal`` when the loss is
    decoupled PPO with a stored proximal pass (train.off_policy.proximal = pass)."""
    opc = cfg.off_policy
    stages = STAGES[:3] + (("proximal",) if opc.decoupled and opc.proximal == "pass" else ()) + STAGES[3:]
    return tuple(s for s in stages if s != "reference" or cfg.train.uses_reference)


class IterationError(RuntimeError):
    """A stage of an iteration failed or timed out; the message names the step and the stage."""


class WorkerLostError(IterationError):
    """A training worker of the step died or was restarted: its rank's state is gone."""

    def __init__(self, message: str, workers: list[str]):
        super().__init__(message)
        self.workers = tuple(workers)


@dataclass
class IterationResult:
    step: int
    policy: PolicyRef
    metrics: dict[str, float]
    stage_seconds: dict[str, float]
    trace_events: list[dict] = field(default_factory=list)
    skipped: frozenset[str] = frozenset()
    """Stages found complete in the store and not run again."""
    busy: list[tuple[str, float, float]] = field(default_factory=list)
    """(pool, start, end) wall-clock seconds (time.time) of the step's rollout and training-rank tasks."""
    reward_first_error: str = ""
    """Why the step's first failed reward failed ("" when none did, or the step was scored earlier)."""
    reward_function_errors: dict[str, str] = field(default_factory=dict)
    """Per reward function label, why its first failed sample failed (functions that failed only)."""


@dataclass(frozen=True)
class StageFutures:
    """One stage's futures in the step's graph (in a :class:`StepPlan`, the :class:`Dep` s of its
    tasks in their place)."""

    stage: str
    work: tuple[Future, ...] = ()
    """The stage's tasks; their results are its measurements (publish: the new PolicyRef)."""
    gate: Future | None = None
    """The task that marks the stage complete in the store once every work task has written: a gate
    task after them, the stage's own task (a one-task stage; the output rank's task of a
    forward-only pass), a scoring task or gate (reward and advantage together), or the next
    stage's task (``marked_by_next``); None when the stage was skipped."""
    marked_by_next: bool = False
    """The gate is the next stage's task (publish marks train before it publishes) or a task that
    runs beside the next stage (reward.in_rollout's gate, the advantage stage's): the stage ends
    when its work does."""
    beside: bool = False
    """The stage's task runs beside the stages after it, which wait for the stages before it
    (reward.in_rollout's gate: it sums up and marks what the rollout tasks wrote while the train
    tasks read it; publish waits for it, so no later stage is marked first)."""
    inside: str = ""
    """The stage whose tasks run this one (train.reference_pass = fused: the reference inside
    train; reward.in_rollout: the scoring inside rollout): ``work`` is those tasks, whose results
    carry this stage's ``<stage>_seconds``; empty: the stage has tasks of its own."""

    @property
    def deps(self) -> tuple[Future, ...]:
        """What a downstream stage waits on: the gate, i.e. the stage's outputs are in the store."""
        return () if self.gate is None else (self.gate,)

    @property
    def futures(self) -> tuple[Future, ...]:
        """The futures the stage ends with, once each: its work and, unless the next stage's task
        marks it, its gate (a one-task stage's task is its own gate)."""
        return tuple(dict.fromkeys(self.work if self.marked_by_next else self.work + self.deps))


@dataclass(frozen=True)
class PendingPolicy:
    """A policy version a step in flight will publish: the step that generates from it is submitted
    before that step ends, and its tasks take the publish task's future in its place (Dask hands
    them the PolicyRef), so its rollout starts when the version is published, with no round trip
    through the loop between the two steps."""

    version: int
    path: str
    publish: Future
    """The publish task of step ``version - 1``; its result is the version's PolicyRef."""
    done_at: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    """That step's record of when its tasks ended (PendingIteration.done_at): the version is out
    at ``done_at[publish.key]``."""


Policy = PolicyRef | PendingPolicy


_CHUNK_SAMPLES = 2048  # the most samples in one Zarr chunk of a step's per-sample arrays


def step_layout(cfg: GRPOConfig) -> StepLayout:
    """A step's Zarr layout. A chunk holds whole groups, as many as one writer's share of the step
    (the engines write the rollout, the scoring tasks the rewards, or the engines both with
    reward.in_rollout: each writer its own chunk-aligned range) up to ~2048 samples: every chunk is
    a file to open and a task in the advantage graph, so a step has as few as its writers allow."""
    G, prompts = cfg.rollout.group_size, cfg.task.prompts_per_step
    writers = max(cfg.rollout.num_engines, 1 if cfg.reward.in_rollout else cfg.reward.num_tasks)
    groups_per_chunk = max(1, min(-(-prompts // writers), _CHUNK_SAMPLES // G))
    return StepLayout(prompts, G, cfg.prompt_width, cfg.rollout.max_new_tokens, groups_per_chunk)


def prompt_ranges(num_groups: int, groups_per_chunk: int, parts: int) -> list[tuple[int, int]]:
    """Split groups [0, num_groups) into at most ``parts`` chunk-aligned contiguous ranges: the
    prompts of each rollout task (one per engine) and of each scoring task."""
    chunks = -(-num_groups // groups_per_chunk)
    parts = max(1, min(parts, chunks))
    bounds = [round(i * chunks / parts) * groups_per_chunk for i in range(parts + 1)]
    return [(lo, min(hi, num_groups)) for lo, hi in zip(bounds, bounds[1:]) if lo < min(hi, num_groups)]


@dataclass(frozen=True)
class Dep:
    """In a :class:`StepPlan`, the future of the plan's task with this key."""

    key: str


@dataclass(frozen=True)
class Task:
    """One task of a step's plan: ``client.submit(fn, *args, **options)``, each :class:`Dep` among
    ``args`` (or in a tuple or list there) replaced by the future of that task. ``options`` are what
    ``client.submit`` takes: Dask's (key, workers, resources, retries, ...) and the function's own
    keywords (``attrs``, ``rollout``), which never hold a :class:`Dep`."""

    fn: Callable
    args: tuple
    options: dict

    @property
    def key(self) -> str:
        return self.options["key"]


@dataclass(frozen=True)
class StepPlan:
    """A step's graph before anything is submitted: its tasks in submission order, and each stage
    as a :class:`StageFutures` whose handles are :class:`Dep` s. :func:`plan_step` makes it without
    Dask; :func:`submit_plan` submits it."""

    tasks: tuple[Task, ...]
    stages: dict[str, StageFutures]


class _StepPlanner:
    """Builds a :class:`StepPlan` stage by stage; each stage's method returns what the stages after
    it wait on."""

    def __init__(self, cfg: GRPOConfig, pools: Pools, folder: RunFolder, ref: StepRef, layout: StepLayout,
                 policy: Policy, done: Collection[str], prev_train: tuple, attempt: int):
        self.cfg, self.pools, self.folder, self.ref, self.layout = cfg, pools, folder, ref, layout
        self.done, self.prev_train = set(done), tuple(prev_train)
        self.G = cfg.rollout.group_size
        self.gpc = layout.chunk_samples // self.G
        # What tasks take for the policy: the version's PolicyRef, or the future of the task publishing it.
        pending = isinstance(policy, PendingPolicy)
        self.policy_arg = policy.publish if pending else policy
        self.policy_path = policy.path
        # A rerun of the step gets new keys: a task of the abandoned attempt may still be running.
        self.tok = tokenize(ref, policy.publish.key if pending else policy.sha256, config_hash(cfg), attempt)
        self.world = len(pools.train)  # training ranks: one reference and one train task each
        self.train_pin = [dict(workers=[pools.train_addresses[r]], resources={"train": 1}, pure=False)
                          for r in range(self.world)]
        self.new_version = ref.step + 1  # the trainer holds version ref.step (flows/async_schedule.py)
        # Short tasks go to the plain workers (any worker if none is left): Dask would otherwise put them
        # beside their inputs' results, behind a rank's next pass or another step's rollout.
        self.io = dict(workers=list(pools.plain), allow_other_workers=True) if pools.plain else {}
        self.io["retries"] = _STATELESS_RETRIES  # stateless: rerun elsewhere if their worker dies
        self.inside = inside_stages(cfg, done)
        self.tasks: list[Task] = []
        self.stages: dict[str, StageFutures] = {}

    # -- the stages, in the order of the diagram in this module's docstring ------------------------

    def rollout(self) -> tuple[tuple[Dep, ...], tuple[Dep, ...]]:
        """(what reads the rollout's rows waits on, the gate of the scores the rollout tasks wrote:
        reward.in_rollout, else none)."""
        ref, tok = self.ref, self.tok
        if "rollout" in self.done:
            return self.skip("rollout"), ()
        # Any engine may take any range (rows are seeded by step and prompt): no address pin, so an
        # engine restarted at a new address picks up the range its predecessor lost. (Dask spreads the
        # ranges over the engines as none of them holds the publish task's result, a plain worker's.)
        scored = "reward" in self.inside
        engines = self.pools.rollout
        calls = [(tasks.rollout_task, (self.cfg, ref, self.policy_arg, lo, hi, engine, scored),
                  dict(key=f"rollout-{ref.step}-{i}-{tok}", resources={"rollout": 1}, pure=False))
                 for i, (lo, hi) in enumerate(prompt_ranges(self.layout.num_prompts, self.gpc, len(engines)))
                 for engine in [engines[i % len(engines)]]]
        if not scored:
            return self.add("rollout", calls), ()
        # One gate marks rollout, reward and advantage with the step's statistics. The tasks after it
        # read only the arrays the rollout tasks wrote, so they wait on those tasks and the gate runs
        # beside them; publish waits on the gate, so no later stage is marked before these three.
        work = tuple(self.task(fn, *args, **kw) for fn, args, kw in calls)
        gate = self.task(tasks.mark_scored, self.cfg, ref, *work, rollout=True, key=f"rollout-scored-{ref.step}-{tok}",
                         **self.io)
        self.stages["rollout"] = StageFutures("rollout", work, gate, marked_by_next=True)
        self.stages["reward"] = StageFutures("reward", work, inside="rollout")
        self.stages["advantage"] = StageFutures("advantage", (gate,), gate, beside=True)  # the reward statistics
        return work, (gate,)

    def scoring(self, rollout: tuple[Dep, ...]) -> tuple[Dep, ...]:
        """Reward and advantage: what the train tasks wait on for the advantages."""
        cfg, ref, tok, G = self.cfg, self.ref, self.tok, self.G
        if "reward" in self.inside:
            return ()  # the rollout tasks score, their gate marks the scores
        if "reward" in self.done:
            self.skip("reward")
            if "advantage" in self.done:
                return self.skip("advantage")
            # rewards stored without their advantages
            return self.add("advantage", [(tasks.advantage_task, (cfg, ref), dict(key=f"advantage-{ref.step}-{tok}",
                                                                                   **self.io))])
        # each scoring task writes rewards and advantages of whole groups
        scoring = [(tasks.score_task, (cfg, ref, self.policy_path, lo * G, hi * G, *rollout),
                    dict(key=f"score-{ref.step}-{i}-{tok}", **self.io))
                   for i, (lo, hi) in enumerate(prompt_ranges(self.layout.num_prompts, self.gpc, cfg.reward.num_tasks))]
        if len(scoring) == 1:
            fn, args, kw = scoring[0]
            work = (self.task(tasks.run_and_mark, fn, ref, tasks.SCORED, {}, *args, **kw),)
            gate = work[0]
        else:
            work = tuple(self.task(fn, *args, **kw) for fn, args, kw in scoring)
            gate = self.task(tasks.mark_scored, cfg, ref, *work, key=f"score-done-{ref.step}-{tok}", **self.io)
        self.stages["reward"] = StageFutures("reward", work, gate)
        self.stages["advantage"] = StageFutures("advantage", (gate,), gate)  # the step's reward statistics
        return (gate,)

    def reference(self, rollout: tuple[Dep, ...], scored_gate: tuple[Dep, ...]) -> tuple[Dep, ...]:
        """The reference pass, one task per rank (none with kl_beta 0, or inside train when fused)."""
        cfg, ref, tok = self.cfg, self.ref, self.tok
        if "reference" not in step_stages(cfg):
            return ()  # kl_beta 0: no pass; the train tasks read zeros for ref_logp
        if "reference" in self.done:
            return self.skip("reference")
        if "reference" in self.inside:
            return ()  # train.reference_pass = fused: the train tasks run it
        # A task that marks its own stage waits for the rollout's mark (reward.in_rollout: the
        # gate's), so a resumed step never holds a pass over rows it then generates again.
        return self.add_ranked("reference", [(tasks.reference_task, (cfg, ref, *rollout, *scored_gate, *self.prev_train),
                                              dict(key=f"reference-{ref.step}-{r}-{tok}", **self.train_pin[r]))
                                             for r in range(self.world)])

    def proximal(self, rollout: tuple[Dep, ...], scored_gate: tuple[Dep, ...],
                 reference: tuple[Dep, ...]) -> tuple[Dep, ...]:
        """The proximal pass (train.off_policy.proximal = pass): the trainer's current weights, after
        the previous step's train, before this one's."""
        cfg, ref, tok = self.cfg, self.ref, self.tok
        if "proximal" not in step_stages(cfg):
            return ()
        if "proximal" in self.done:
            return self.skip("proximal")
        return self.add_ranked("proximal", [(tasks.proximal_task, (cfg, ref, *rollout, *scored_gate, *reference,
                                                                   *self.own(r, "reference"), *self.prev_train),
                                             dict(key=f"proximal-{ref.step}-{r}-{tok}", **self.train_pin[r]))
                                            for r in range(self.world)])

    def train(self, rollout: tuple[Dep, ...], advantage: tuple[Dep, ...], reference: tuple[Dep, ...],
              proximal: tuple[Dep, ...]) -> tuple[Dep, ...]:
        """One train task per rank (none when every rank's shard of the new version is on disk)."""
        if "train" in self.done:
            return ()
        fused = "reference" in self.inside
        trains = tuple(self.task(tasks.train_task, self.cfg, self.ref, self.folder, self.new_version, fused, *rollout,
                                 *advantage, *reference, *proximal, *self.own(r, "reference", "proximal"),
                                 *self.prev_train, key=f"train-{self.ref.step}-{r}-{self.tok}", **self.train_pin[r])
                       for r in range(self.world))
        if fused:
            self.stages["reference"] = StageFutures("reference", trains, inside="train")
        return trains

    def publish(self, trains: tuple[Dep, ...], scored_gate: tuple[Dep, ...]) -> None:
        """Publish always runs: it is idempotent, and a step whose publish is complete is not rerun.
        It marks train complete first (with the ranks' results), so no gate task stands between them."""
        ref = self.ref
        publish = self.task(tasks.run_and_mark, tasks.publish_task, ref, "publish",
                            {"next_policy_version": self.new_version}, self.folder, ref, self.new_version,
                            self.policy_arg, self.cfg.train.pipeline_model_parallel_size,
                            {"trainer_version": ref.step} if trains else None, trains, *scored_gate,
                            key=f"publish-{ref.step}-{self.tok}", **self.io)
        self.stages["train"] = (StageFutures("train", trains, publish, marked_by_next=True) if trains
                                else StageFutures("train"))
        self.stages["publish"] = StageFutures("publish", (publish,), publish)

    # -- building blocks ---------------------------------------------------------------------------

    def task(self, fn: Callable, *args, **options) -> Dep:
        self.tasks.append(Task(fn, args, options))
        return Dep(options["key"])

    def add(self, stage: str, calls: list[tuple], **attrs) -> tuple[Dep, ...]:
        """The stage's tasks, ``calls`` = [(function, args, submit keywords)], and what marks it
        complete in the store once all of them have written: a gate task after them or, for a stage
        of one task, that task itself (one scheduler hop fewer on the step's path)."""
        ref = self.ref
        if len(calls) == 1:
            fn, args, kw = calls[0]
            work = self.task(tasks.run_and_mark, fn, ref, stage, attrs, *args, **kw)
            self.stages[stage] = StageFutures(stage, (work,), work)
        else:
            work = tuple(self.task(fn, *args, **kw) for fn, args, kw in calls)
            gate = self.task(tasks.mark_stage_complete, ref, stage, *work, attrs=attrs,
                             key=f"{stage}-done-{ref.step}-{self.tok}", **self.io)
            self.stages[stage] = StageFutures(stage, work, gate)
        return self.stages[stage].deps

    def add_ranked(self, stage: str, calls: list[tuple], **attrs) -> tuple[Dep, ...]:
        """A forward-only stage of one task per training rank (``calls`` in rank order), whose only
        output the output rank writes: that rank's task marks the stage complete itself, after its
        write. Its pass ends only once every rank has done its share (a pipeline or a reduction onto
        it), so downstream stages wait on it alone, with no gate task between; each rank's next
        task also waits on its own task of the stage (:meth:`own`)."""
        out = self.cfg.train.layout.output_rank
        work = tuple(self.task(tasks.run_and_mark, fn, self.ref, stage, attrs, *args, **kw) if r == out
                     else self.task(fn, *args, **kw) for r, (fn, args, kw) in enumerate(calls))
        self.stages[stage] = StageFutures(stage, work, work[out])
        return self.stages[stage].deps

    def own(self, rank: int, *names: str) -> tuple[Dep, ...]:
        """Rank ``rank``'s tasks of the ranked stages ``names`` (those not skipped)."""
        return tuple(self.stages[n].work[rank] for n in names if n in self.stages and self.stages[n].work)

    def skip(self, stage: str) -> tuple[Dep, ...]:
        self.stages[stage] = StageFutures(stage)
        return ()


def plan_step(cfg: GRPOConfig, pools: Pools, folder: RunFolder, ref: StepRef, layout: StepLayout, policy: Policy,
              done: Collection[str] = (), prev_train: tuple = (), attempt: int = 0) -> StepPlan:
    """Step ``ref.step``'s graph as a :class:`StepPlan`, without Dask: its stored ``layout``, the
    stages ``done`` already (a resumed step), the previous step's train gate ``prev_train`` (passed
    through to the training-rank tasks as given) and the rerun number ``attempt`` (new task keys)."""
    plan = _StepPlanner(cfg, pools, folder, ref, layout, policy, done, prev_train, attempt)
    rollout, scored_gate = plan.rollout()
    advantage = plan.scoring(rollout)
    reference = plan.reference(rollout, scored_gate)
    proximal = plan.proximal(rollout, scored_gate, reference)
    trains = plan.train(rollout, advantage, reference, proximal)
    plan.publish(trains, scored_gate)
    return StepPlan(tuple(plan.tasks), {name: plan.stages[name] for name in step_stages(cfg)})


def submit_plan(client: Client, plan: StepPlan) -> dict[str, StageFutures]:
    """Submit a plan's tasks in order; returns its stages with their futures."""
    futures: dict[str, Future] = {}

    def resolve(x):
        if isinstance(x, Dep):
            return futures[x.key]
        if type(x) in (tuple, list):  # exactly: a NamedTuple (StepRef) is an argument, not a container
            return type(x)(resolve(v) for v in x)
        return x

    for t in plan.tasks:
        futures[t.key] = client.submit(t.fn, *resolve(t.args), **t.options)

    def handles(stage: StageFutures) -> StageFutures:
        return replace(stage, work=tuple(futures[d.key] for d in stage.work),
                       gate=None if stage.gate is None else futures[stage.gate.key])

    return {name: handles(stage) for name, stage in plan.stages.items()}


@dataclass
class PendingIteration:
    """One submitted step: its stage futures, the completion time of each future (recorded by a done
    callback, so it does not depend on when the loop looks), and the submission time."""

    step: int
    stages: dict[str, StageFutures]
    names: tuple[str, ...]
    start: float
    done_at: dict[str, float]
    client: Client
    pools: Pools
    ref: StepRef
    policy: Policy
    """The version the step generates from (pending: a step in flight publishes it)."""

    def cancel(self) -> None:
        """Cancel every task of the step that has not finished (a rerun resubmits it)."""
        for s in self.stages.values():
            for f in s.futures:
                if f.status == "pending":
                    f.cancel()

    @property
    def train_gate(self) -> tuple[Future, ...]:
        """What the next step's training-rank tasks wait on."""
        return self.stages["train"].deps


def prepare_step(cfg: GRPOConfig, folder: RunFolder, step: int, policy_version: int) -> bool:
    """Create step ``step``'s empty Zarr group ahead of its submission (the loop does it while the
    step before runs: creating a step's arrays takes tens of milliseconds). A step the folder holds
    already (a resumed run) is left as it is. True when created: submit the step with
    ``prepared=True`` then, and nothing may write to it before."""
    store = folder.rollout_store()
    if store.has_step(step):
        return False
    store.create_step(step, step_layout(cfg), policy_version, config_hash(cfg), tasks.data_stamp(cfg))
    return True


def submit_iteration(client: Client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, step: int,
                     policy: Policy, prev_train: tuple[Future, ...] = (), attempt: int = 0,
                     prepared: bool = False) -> PendingIteration:
    """Submit step ``step``'s graph, generating from ``policy`` (the version the rule names, or a
    :class:`PendingPolicy` of a step in flight: the step's stages then start once it is published);
    ``prev_train``: the previous step's train gate while that step is still in flight; ``attempt``
    numbers reruns of the step (new task keys); ``prepared``: :func:`prepare_step` created the
    step's group for ``policy``'s version and nothing has written to it since. Raises
    :class:`WorkerLostError` when a training worker of ``pools`` is already gone."""
    lost = lost_workers(client, pools)
    if lost:
        raise WorkerLostError(f"step {step}: training worker {', '.join(lost)} was lost before the step started", lost)
    store = folder.rollout_store()
    done = set() if prepared else store.completed(step)
    if not prepared and ("rollout" not in done or store.attrs(step).get("policy_version") != policy.version):
        # A partial rollout, or one from another version, is regenerated whole.
        store.create_step(step, step_layout(cfg), policy.version, config_hash(cfg), tasks.data_stamp(cfg))
        done = set()
    ref = store.ref(step)
    start = time.perf_counter()
    plan = plan_step(cfg, pools, folder, ref, store.layout(step), policy, done, prev_train, attempt)
    stages = submit_plan(client, plan)
    done_at: dict[str, float] = {}
    for s in stages.values():
        for f in s.futures:
            f.add_done_callback(lambda fut: done_at.setdefault(fut.key, time.perf_counter()))
    return PendingIteration(step, stages, step_stages(cfg), start, done_at, client, pools, ref, policy)


def finish_iteration(pending: PendingIteration, on_stage: Callable[[str], None] = lambda stage: None,
                     timeout_s: float = 900.0) -> IterationResult:
    """Wait for a submitted step; returns its new policy version and metrics."""
    step, stages, start = pending.step, pending.stages, pending.start
    if isinstance(pending.policy, PendingPolicy):  # submitted ahead: it starts once its version is out
        start = max(start, pending.policy.done_at.get(pending.policy.publish.key, start))
    # A future may end several stages (a scoring task writes rewards and advantages), in stage order;
    # a stage run inside another's tasks comes after it (a failure there names the host stage).
    stages_of: dict[str, list[str]] = {}
    for s in sorted(stages.values(), key=lambda s: bool(s.inside)):
        for f in s.futures:
            stages_of.setdefault(f.key, []).append(s.stage)
    work_keys = {s.stage: {f.key for f in s.work} for s in stages.values()}
    pending_n = {stage: len(stages[stage].futures) for stage in pending.names}
    finished_at = {stage: start for stage, n in pending_n.items() if n == 0}
    for stage in finished_at:
        on_stage(stage)
    results: dict[str, list] = {stage: [] for stage in pending.names}
    client, pools = pending.client, pending.pools
    remaining = {f for s in stages.values() for f in s.futures}
    deadline = start + timeout_s
    checked = time.perf_counter()  # the last look at the training workers (a scheduler round trip)
    try:
        while remaining:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise IterationError(_late_message(client, step, stages, remaining, timeout_s))
            try:
                finished, _ = wait(list(remaining), timeout=min(_POLL_S, left), return_when="FIRST_COMPLETED")
            except TimeoutError:
                finished = set()
            lost = []
            if not finished or time.perf_counter() - checked >= _POLL_S:
                lost, checked = lost_workers(client, pools), time.perf_counter()
            if lost:
                late = ", ".join(s for s, n in pending_n.items() if n)
                raise WorkerLostError(f"step {step}: training worker {', '.join(lost)} was lost during stages {late}",
                                      lost)
            # In stage order: a failed task fails its dependents too, and the error names the first stage.
            for future in sorted(finished, key=lambda f: pending.names.index(stages_of[f.key][0])):
                names = stages_of[future.key]
                if future.status == "error":
                    raise _failure(client, pools, step, names[0], future.exception(), stages[names[0]].work)
                if future.status == "cancelled":
                    raise _failure(client, pools, step, names[0], RuntimeError(f"task {future.key} was cancelled"))
                if any(future.key in work_keys[n] for n in names):
                    try:  # the result's worker may die before it is fetched: then the next poll sees it
                        value = future.result(timeout=4 * _POLL_S)
                    except TimeoutError:
                        continue
                    for n in names:
                        if future.key in work_keys[n]:
                            results[n].append(value)
                remaining.discard(future)
                for n in names:
                    pending_n[n] -= 1
                    if pending_n[n] == 0:
                        finished_at[n] = max(pending.done_at.get(f.key, time.perf_counter())
                                             for f in stages[n].futures)
                        on_stage(n)
    finally:
        for s in stages.values():
            for f in s.futures:
                if f.status == "pending":
                    f.cancel()

    inside = {s.stage: s.inside for s in stages.values() if s.inside}
    # A stage the step does not have (kl_beta 0: reference) passes its inputs' times through.
    after = stage_inputs({*inside, *(s.stage for s in stages.values() if s.beside), *(set(_AFTER) - set(stages))})
    stage_seconds = {s: finished_at[s] - max((finished_at[d] for d in after[s] if d in finished_at), default=start)
                     for s in pending.names}
    for s, host in inside.items():  # its own seconds in the host's tasks (the slowest one's), out of the host's
        stage_seconds[s] = max(_INSIDE_SECONDS[s](r) for r in results[host])
        stage_seconds[host] -= stage_seconds[s]
    iteration_s = max(finished_at.values(), default=start) - start  # submission to the last stage's end
    skipped = frozenset(s.stage for s in stages.values() if s.gate is None and not s.inside)
    if skipped:  # a resumed step: the skipped stages' measurements were stored with their marks
        attrs = RolloutStore(pending.ref.root).attrs(step)
        for s in skipped:
            results[s] = [result_of_stage(s, r) for r in attrs.get(f"results_{s}", [])]
    result = _collect(step, results, stage_seconds, skipped, frozenset(inside))
    result.metrics["iteration_seconds"] = iteration_s
    return result


def run_iteration(client: Client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, step: int,
                  policy: PolicyRef, on_stage: Callable[[str], None] = lambda stage: None,
                  timeout_s: float = 900.0, attempt: int = 0) -> IterationResult:
    """Run step ``step`` from ``policy``; returns the new policy version and the step's metrics."""
    return finish_iteration(submit_iteration(client, cfg, pools, folder, step, policy, attempt=attempt),
                            on_stage, timeout_s)


# A stage run inside another stage's tasks: its seconds in one of them.
_INSIDE_SECONDS: dict[str, Callable[[TaskResult], float]] = {"reward": lambda r: r.reward_seconds,
                                                              "reference": lambda r: r.reference_seconds}
# LossStats.metrics (stages/train/loss.py) that reach the step's metrics.
_LOSS_METRICS = ("loss", "kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
                 "kl_behav", "is_weight_mean", "is_weight_max", "is_truncated_fraction", "is_masked_fraction")


def _collect(step: int, values: dict[str, list], stage_seconds: dict[str, float],
             skipped: frozenset[str], inside: frozenset[str] = frozenset()) -> IterationResult:
    """Fold the tasks' own measurements (flows/results.py) into the step's metrics; ``inside``: the
    stages run inside another stage's tasks (their values are those tasks' results)."""
    m: dict[str, float] = {}
    roll: list[RolloutResult] = values["rollout"]
    if roll:
        m["rollout_tokens"] = sum(r.rollout_tokens for r in roll)
        m["rollout_tokens_per_s"] = m["rollout_tokens"] / max(max(r.rollout_seconds for r in roll), 1e-9)
        m["kv_cache_bytes"] = sum(r.kv_cache_bytes for r in roll)
        m["weight_load_seconds"] = max(r.weight_load_seconds for r in roll)
        m["rollout_compute_seconds"] = max(r.rollout_seconds for r in roll)  # generate() alone
        if all(r.speculative_acceptance is not None for r in roll):  # rollout.draft_*: the engines' mean
            m["speculative_acceptance"] = sum(r.speculative_acceptance for r in roll) / len(roll)
            m["speculative_tokens_per_forward"] = sum(r.speculative_tokens_per_forward for r in roll) / len(roll)
        if any(r.engine_starts is not None for r in roll):  # rollout.engine=vllm: server processes (re)started
            m["engine_starts"] = sum(r.engine_starts or 0 for r in roll)
            m["engine_start_seconds"] = max(r.engine_start_seconds or 0.0 for r in roll)
        if all(r.groups_generated is not None for r in roll):  # rollout.dynamic_sampling, summed over the engines
            m["groups_generated"] = sum(r.groups_generated for r in roll)
            m["groups_dropped"] = sum(r.groups_dropped for r in roll)
            m["groups_unfilled"] = sum(r.groups_unfilled for r in roll)
            m["sampling_rounds"] = max(r.sampling_rounds for r in roll)
            m["generated_length_mean"] = m["rollout_tokens"] / max(sum(r.generated_samples for r in roll), 1)
    if values.get("reference"):
        m["reference_compute_seconds"] = max(r.reference_seconds for r in values["reference"])
    first_error, function_errors = "", {}
    # reward.in_rollout: the reward stage's results are the rollout tasks'
    scores: list[ScoreResult] = [r.scores() if isinstance(r, RolloutResult) else r for r in values["reward"]]
    if scores:
        m["reward_failed"] = sum(r.reward_failed for r in scores)
        first_error = next((r.reward_first_error for r in scores if r.reward_first_error), "")
        by_function: dict[str, dict] = {}
        for r in scores:
            merge_function_stats(by_function, r.reward_functions)
        for label, f in by_function.items():  # each function's mean over the samples it scored
            m[f"reward/{label}"] = f["sum"] / f["scored"] if f["scored"] else float("nan")
            m[f"reward_failed/{label}"] = float(f["failed"])
            if f["first_error"]:
                function_errors[label] = f["first_error"]
    for r in values["advantage"]:
        m.update(r.statistics)
    trains: list[TrainResult] = sorted(values["train"], key=lambda r: r.rank)
    events: list[dict] = []
    if trains:
        for r in trains:
            m[f"bubble_fraction_rank{r.rank}"] = r.metrics["bubble_fraction"]
            events.extend(r.events)
        # Loss metrics come from ranks holding the last stage (reduced over DP there): with a
        # V-shaped schedule that is pipeline rank 0, not the highest rank.
        loss_rank = next((r.metrics for r in trains if "loss" in r.metrics), {})
        m.update({k: loss_rank[k] for k in _LOSS_METRICS if k in loss_rank})
        m["grad_norm"] = trains[0].metrics.get("grad_norm", float("nan"))
        for r in trains:  # activation stash per stage (identical across DP / TP copies)
            m.update({k: v for k, v in r.metrics.items() if k.startswith(("activation_bytes", "peak_inflight"))})
        m["bubble_fraction"] = sum(r.metrics["bubble_fraction"] for r in trains) / len(trains)
        m["train_step_seconds"] = max(r.metrics["step_seconds"] for r in trains)
        # Pipeline passes of the step and token slots processed per real token (length buckets).
        m.update({k: trains[0].metrics[k] for k in ("lr", "train_passes", "train_token_slots_per_real_token")
                  if k in trains[0].metrics})
        # Schedules whose first step this was and whose shapes torch inferred (a microbatch's
        # forward and backward more on every stage): a new length bucket's first pass.
        m["pipeline_shape_inferences"] = max(r.metrics.get("pipeline_shape_inferences", 0.0) for r in trains)
        m["publish_bytes"] = sum(r.shard_bytes for r in trains)
        # Activations and gradients between pipeline ranks in the train step, every rank's sends.
        m["pipeline_p2p_bytes"] = sum(r.metrics.get("p2p_send_bytes", 0.0) for r in trains)
        if any("reference_fill_microbatches" in r.metrics for r in trains):  # train.reference_fill
            # reference microbatches the ranks computed inside the step's P2P waits
            m["reference_fill_microbatches"] = sum(r.metrics["reference_fill_microbatches"] for r in trains)
        m["publish_write_seconds"] = max(r.shard_seconds for r in trains)
        origin = min((e["ts"] for e in events if "ts" in e), default=0)
        for e in events:
            if "ts" in e:
                e["ts"] -= origin
    passes: list[ReferenceResult | ProximalResult] = [r for s in ("reference", "proximal") if s not in inside
                                                      for r in values.get(s, [])]
    forward: dict[int, float] = {}  # rank -> the end of its last forward-only task of the step
    for r in passes:  # results stored before the rank was recorded (rank -1) match no train task
        forward[r.rank] = max(forward.get(r.rank, r.task_end), r.task_end)
    waits = [t.task_start - forward[t.rank] for t in trains if t.rank in forward]
    if waits:
        # A rank's wait between its forward-only passes and its train task: the dispatch hop (and
        # the advantages or the output rank's mark, when they come later); the planner's per-hop cost.
        m["train_handoff_seconds"] = min(waits)
    m.update(weight_sync.step_metrics(roll, trains))
    m.update({f"{s}_seconds": v for s, v in stage_seconds.items()})
    busy = [("rollout", r.task_start, r.task_end) for r in roll]
    busy += [("train", r.task_start, r.task_end) for r in (*passes, *trains)]
    return IterationResult(step, values["publish"][0], m, stage_seconds, events, skipped, busy, first_error,
                           function_errors)


def _failure(client: Client, pools: Pools, step: int, stage: str, exc: BaseException,
             work: Collection[Future] = ()) -> IterationError:
    """The error of a failed task: a :class:`WorkerLostError` when a training worker is gone
    (its peers may report its death a moment before the scheduler does) or frozen. A training
    stage's failure is judged once every rank's task of it (``work``) has ended: a frozen rank's
    task never ends while its peers' end at train.timeout_s, and the rank counts as lost once it has
    been silent for ``pools.silence_s``."""
    ranks = stage in ("reference", "train")
    grace = _LOST_GRACE_S if ranks else 0.0
    limit = time.monotonic() + (pools.silence_s + grace if ranks else 0.0)
    settled = None  # when every rank's task had ended
    while True:
        lost = lost_workers(client, pools)
        if lost:
            error = WorkerLostError(f"step {step}: stage {stage} failed after training worker {', '.join(lost)} "
                                    f"was lost: {type(exc).__name__}: {exc}", lost)
            error.__cause__ = exc
            return error
        now = time.monotonic()
        if settled is None and all(f.done() for f in work):
            settled = now
        if now >= limit or (settled is not None and now - settled >= grace):
            error = IterationError(f"step {step}: stage {stage} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            return error
        time.sleep(0.2)


def _whereabouts(dask_scheduler, keys: list[str]) -> dict[str, tuple]:
    """On the scheduler: (state, worker running it, worker restrictions, resources) of each task."""
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            out[key] = ("released", None, [], [])
        else:
            out[key] = (ts.state, ts.processing_on.address if ts.processing_on else None,
                        sorted(ts.worker_restrictions or ()), sorted(ts.resource_restrictions or ()))
    return out


def _late_message(client: Client, step: int, stages: dict[str, StageFutures], remaining: set[Future],
                  timeout_s: float) -> str:
    """Which stages did not finish in time, and which worker (or kind of worker) each waited for."""
    late = [s for s in stages if any(f in remaining for f in stages[s].futures)]
    first = late[0]  # the earliest late stage holds up the rest
    keys = [f.key for f in stages[first].futures if f in remaining]
    try:
        where = client.run_on_scheduler(_whereabouts, keys=keys)
        names = {a: n for n, a in worker_addresses(client).items()}
    except Exception as exc:  # the scheduler itself is unreachable: say so rather than guess
        where, names = {}, {}
        waited = [f"the scheduler did not answer ({type(exc).__name__})"]
    else:
        waited = []
        for key in keys:
            state, on, pinned, resources = where[key]
            if on is not None:
                waited.append(f"worker {names.get(on, on)} ({on}) running {key}")
            elif pinned:
                waited.append(f"worker {', '.join(names.get(a, a) for a in pinned)} ({', '.join(pinned)}) "
                              f"for {key} ({state})")
            elif resources:
                waited.append(f"a worker with resource {', '.join(resources)} for {key} ({state})")
            else:
                waited.append(f"any worker for {key} ({state})")
    return (f"step {step}: stages {', '.join(late)} did not finish within cluster.iteration_timeout_s="
            f"{timeout_s:.0f} s; stage {first} waited for {'; '.join(waited)}")
