"""Held-out evaluation of policy versions: its config and its metrics (the generation and the
scoring are the rollout's and the reward's own; flows/evaluate.py chains them)."""

from stages.eval.config import ANSWER_FORMATS, EvalConfig
from stages.eval.metrics import eval_metrics, final_answer, majority_correct, pass_at_k

__all__ = ["ANSWER_FORMATS", "EvalConfig", "eval_metrics", "final_answer", "majority_correct", "pass_at_k"]
