"""Step time of the asynchronous loop from a synchronous run's measured stage seconds.

The loop's rules (flows/async_schedule.py) in closed form, for one rollout engine and one training
pipeline. With per-step stage seconds R (rollout), W (reward + advantage, on plain workers), F
(reference), P (proximal: a forward pass like the reference, so P = F when not measured, with
train.off_policy.proximal = pass; 0 by default, where pi_prox is the train forward's own log-prob), T (train),
U (publish) and L (the loop's own seconds per step: lineage, submission; measured as the sync run's
seconds per step minus its critical path):

    sync (s = 0):        R + max(W, F) + T + U + L                      (one step in flight)
    async, decoupled:    max(R, F + P + T + 2 H, (R + max(W, F + P) + T + U + L) / (s + 1), C / n)
    async, colocated:    R + max(W, F + P) + T + 2 H  (+ the cycle and host bounds as above)

Where the graph runs a stage inside another's tasks the terms move: with reward.in_rollout the
engine's task scores and normalises (R + W, W the reward stage alone), and the advantage stage A is
the gate that sums up and marks the scores: the fused train task runs beside it (publish waits for
it: max(A, F + T) where F + T stood), a reference or proximal task after it (A + F + P). With
train.reference_pass = fused the train task runs F after the advantages are in (max(W, P) + F
where max(W, F + P) stood), and the training chain loses the reference task's hand-off (one H a
step, two with a proximal pass).

Decoupled, the engine and the ranks each run their own chain; a step's rollout also waits for the
publish of step k - s - 1, a cycle through s + 1 steps, hence the third term. Colocated, one worker
queue holds rollout and the ranks' tasks, so asynchrony hides only reward, advantage and publish.

Two terms price the host the sync run measured on. H (``handoff``) is what the ranks wait between
two of their tasks, a dispatch through the scheduler (the sync run's train_handoff_seconds, from a
rank's reference pass to its train task): the synchronous path pays it inside L, but in the
asynchronous steady state the training chain runs back to back, two hand-offs a step (train -> next
reference -> train, each waiting on the tasks before it, with no gate task between them). C
(``host_cpu``) is the CPU seconds a step costs every process of the run on the host (workers,
driver, scheduler, reward processes: the sync run's host_cpu_seconds) and n the host's cores: no
schedule runs a step in less than C / n. Without them (None / 0) the model is the pure overlap of
the stages, the limit of a host with cores to spare.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageSeconds", "sync_step_seconds", "async_step_seconds"]


@dataclass(frozen=True, slots=True)
class StageSeconds:
    """Measured seconds per step of each stage, from a synchronous run on the same cores."""

    rollout: float
    reward: float
    reference: float
    advantage: float
    train: float
    publish: float
    loop: float = 0.0
    """Seconds per step outside the stages (lineage logging, submission)."""
    proximal: float | None = None
    """Forward pass of the trainer's weights; None: taken equal to the reference pass."""
    handoff: float = 0.0
    """Seconds the training ranks wait between two of their tasks (a dispatch hop)."""
    host_cpu: float | None = None
    """CPU seconds per step of every process of the run on the host; None: no host bound."""
    cores: int | None = None
    """The host's cores, for host_cpu."""
    reward_in_rollout: bool = False
    """The engines score their own rows (reward.in_rollout): the reward stage follows R on the
    engine, and the advantage stage (the gate marking the scores) runs beside the passes."""
    reference_in_train: bool = False
    """The train tasks run the reference pass (train.reference_pass = fused)."""

    def __post_init__(self) -> None:
        for name in ("rollout", "reward", "reference", "advantage", "train", "publish", "loop", "handoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"StageSeconds.{name}={getattr(self, name)} must be >= 0 (seconds)")
        if self.host_cpu is not None and (self.host_cpu < 0 or not self.cores or self.cores < 1):
            raise ValueError(f"StageSeconds.host_cpu={self.host_cpu} needs >= 0 CPU seconds and cores >= 1 "
                             f"(got cores={self.cores})")

    @property
    def host_floor(self) -> float:
        """C / n: the step time the host's cores allow (0 without host_cpu)."""
        return 0.0 if self.host_cpu is None else self.host_cpu / self.cores

    @property
    def prox(self) -> float:
        return self.reference if self.proximal is None else self.proximal

    @property
    def engine(self) -> float:
        """The rollout task's seconds: R, plus the reward stage when the engine scores."""
        return self.rollout + (self.reward if self.reward_in_rollout else 0.0)

    def between(self, proximal: float) -> float:
        """From the rollout task's end to the train step's start (``proximal``: the proximal pass
        on the training ranks, 0 when there is none). With the engines scoring, a pass that marks
        its own stage (a reference or proximal task) starts after the gate that marks the scores."""
        scoring = 0.0 if self.reward_in_rollout else self.reward + self.advantage
        gate = self.advantage if self.reward_in_rollout else 0.0
        if self.reference_in_train:
            return max(scoring, gate + proximal if proximal > 0 else 0.0) + self.reference
        return max(scoring, gate + self.reference + proximal)

    def to_publish(self, proximal: float) -> float:
        """From the rollout task's end to the publish task's start: the passes and the train step,
        or the gate beside them when it takes longer (reward.in_rollout)."""
        passes = self.between(proximal) + self.train
        return max(self.advantage, passes) if self.reward_in_rollout else passes


def sync_step_seconds(t: StageSeconds) -> float:
    """Seconds per step of the synchronous loop: the critical path plus the loop's own seconds."""
    return t.engine + t.to_publish(0.0) + t.publish + t.loop


def async_step_seconds(t: StageSeconds, max_staleness: int, colocated: bool = False) -> float:
    """Steady-state seconds per step with rollout.max_staleness s (s = 0: :func:`sync_step_seconds`)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0")
    if max_staleness == 0:
        return sync_step_seconds(t)
    cycle = (t.engine + t.to_publish(t.prox) + t.publish + t.loop) / (max_staleness + 1)
    # The ranks' tasks of a step, each a hand-off after the one before: reference (unless inside
    # train), proximal (a pass of its own), train.
    handoffs = 2 if not t.reference_in_train or t.prox > 0 else 1
    chain = t.reference + t.prox + t.train + handoffs * t.handoff
    if colocated:  # one queue: the rollout task, then the ranks' tasks once their inputs are in
        return max(t.engine + t.between(t.prox) + t.train + handoffs * t.handoff, cycle, t.host_floor)
    return max(t.engine, chain, cycle, t.host_floor)
