"""summary.json of a run: strict JSON (RFC 8259), so any JSON reader can load it."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

__all__ = ["to_strict_json", "save_summary"]


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


def save_summary(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as strict JSON (non-finite numbers become null)."""
    Path(path).write_text(json.dumps(to_strict_json(data), indent=1, allow_nan=False))
