"""The rule of the asynchronous loop, and a pure event model of it.

Versions: policy v0 is the base; step k trains the trainer's version k into k + 1 (published by
step k's publish). With ``rollout.max_staleness`` s, step k generates from version
``max(0, k - s)``: the rule, never a race. Step k's rollout starts once step k - s - 1 has published
that version: the loop (flows/run_loop.py) submits step k's graph while step k - s - 1 is still in
flight (once step k - s - 2 has finished), its rollout waiting on that step's publish task, so at
most s + 2 steps are in flight; steps finish in order. Training-rank tasks of different steps are chained
(reference(k) and proximal(k) after train(k-1), train(k) after both), so every rank runs its
collectives in the same order. s = 0 is the synchronous loop: one step in flight, staleness 0.

:func:`simulate` replays these rules over given stage durations (no Dask, no clock): when each
stage of each step starts and ends, and which versions it uses. Tests check the staleness bound on
it over random durations, and the planner's step-time prediction (planner/async_steptime.py) is the
same arithmetic in closed form.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["behaviour_version", "trainer_version", "released_by", "staleness", "StepDurations", "StepEvents",
           "simulate"]


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version step ``step`` generates from: max(0, step - s)."""
    if step < 0 or max_staleness < 0:
        raise ValueError(f"step={step} and max_staleness={max_staleness} must be >= 0")
    return max(0, step - max_staleness)


def trainer_version(step: int) -> int:
    """The trainer's version when step ``step`` trains (it publishes step + 1)."""
    return step


def staleness(step: int, max_staleness: int) -> int:
    """Versions between the trainer and the samples it consumes at step ``step`` (<= s)."""
    return trainer_version(step) - behaviour_version(step, max_staleness)


def released_by(step: int, max_staleness: int) -> int | None:
    """The step whose finish releases step ``step``'s submission (it publishes the version step
    asks for): step - s - 1, or None when the step may start at once."""
    prev = step - max_staleness - 1
    return prev if prev >= 0 else None


@dataclass(frozen=True)
class StepDurations:
    """Seconds of one step's stages (the rollout pool runs rollout; the training ranks reference,
    proximal and train; plain workers reward and advantage; publish is a plain task after train)."""

    rollout: float
    reward: float = 0.0
    reference: float = 0.0
    proximal: float = 0.0
    advantage: float = 0.0
    train: float = 0.0
    publish: float = 0.0


@dataclass(frozen=True)
class StepEvents:
    """When one step's stages ran (start, end) in the model, and the versions it used."""

    step: int
    behaviour_version: int
    trainer_version: int
    submitted: float
    spans: dict[str, tuple[float, float]]
    published_at: dict[int, float]
    """Publish end of every version published before this step's rollout started (v0 at 0.0)."""
    finished: float
    """When the loop finishes the step: its publish end, but never before the previous step's
    finish (steps finish, and are logged, in order)."""


def simulate(durations: list[StepDurations], max_staleness: int, colocated: bool = False,
             reward_in_rollout: bool = False, reference_in_train: bool = False) -> list[StepEvents]:
    """Replay the loop's rules over ``durations`` (one entry per step, from step 0).

    One rollout engine and one training pipeline, each running one task at a time; reward and
    advantage run on their own workers. colocated: the engine is a training worker, so rollout and
    the training-rank tasks share one queue. The proximal stage runs only when s >= 1.
    reward_in_rollout (reward.in_rollout): the engine's task scores its rows after its generation,
    and the advantage stage (the gate marking the scores) runs beside the fused train task, while
    a reference or proximal task waits for it, and publish always does. reference_in_train
    (train.reference_pass = fused): the train task runs the reference pass, once the advantages
    are in, before its step."""
    s = max_staleness
    events: list[StepEvents] = []
    rollout_free = train_free = 0.0
    published = {0: 0.0}
    for k, d in enumerate(durations):
        prev = released_by(k, s)  # publishes version v; the loop submits step k once the step before it finished
        submitted = events[prev - 1].finished if prev is not None and prev >= 1 else 0.0
        v = behaviour_version(k, s)
        spans: dict[str, tuple[float, float]] = {}

        def run(stage: str, ready: float, seconds: float) -> float:
            spans[stage] = (ready, ready + seconds)
            return ready + seconds

        # Rollouts of later steps queue behind earlier ones on the engine (Dask priority by submission).
        r_end = run("rollout", max(submitted, published[v], rollout_free), d.rollout)
        reward_end = run("reward", r_end, d.reward)
        if reward_in_rollout:  # the engine's own task: the rows are out once they are scored
            r_end = reward_end
        adv_end = run("advantage", reward_end, d.advantage)
        scored = r_end if reward_in_rollout else adv_end  # what the passes wait for
        rollout_free = r_end
        if colocated:
            train_free = max(train_free, r_end)
        prev_train = events[k - 1].spans["train"][1] if k else 0.0
        proximal = d.proximal if s >= 1 else 0.0
        # A pass that marks its own stage starts once the rollout is marked (the gate, when the
        # engine scores); the fused train task marks nothing itself.
        marked = adv_end if reward_in_rollout else r_end
        if reference_in_train:
            prox_end = run("proximal", max(marked if proximal > 0 else r_end, prev_train, train_free), proximal)
            ref_end = run("reference", max(prox_end, scored), d.reference)
            t_end = run("train", ref_end, d.train)
        else:
            ref_end = run("reference", max(marked, prev_train, train_free), d.reference)
            prox_end = run("proximal", ref_end, proximal)
            t_end = run("train", max(prox_end, scored), d.train)
        train_free = t_end
        if colocated:
            rollout_free = max(rollout_free, t_end)
        p_end = run("publish", max(t_end, adv_end), d.publish)
        published[k + 1] = p_end
        finished = max(p_end, events[k - 1].finished if k else 0.0)
        events.append(StepEvents(k, v, trainer_version(k), submitted, spans,
                                 {u: t for u, t in published.items() if t <= spans["rollout"][0]}, finished))
    return events
