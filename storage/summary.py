"""Strict JSON (RFC 8259) for the run's JSON files (summary.json, traces): any JSON reader loads them."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["to_strict_json"]


def to_strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None: JSON has no NaN, and
    Python's ``json`` would otherwise write a bare ``NaN`` that strict readers reject."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):  # float, np.float32
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: to_strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_strict_json(v) for v in value]
    return value
