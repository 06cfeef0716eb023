"""Compare two run folders: every Zarr array both hold, step by step, and the sha256 of every policy
safetensors file. Used to check that rollout.max_staleness=0 reproduces the synchronous loop:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/compare_runs.py runs/a runs/b
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import zarr

__all__ = ["compare_runs"]


def _weights(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run_dir / "policy").rglob("*.safetensors"))}


def compare_runs(a: Path, b: Path) -> bool:
    """True when both runs hold the same steps, equal shared arrays and identical weight files."""
    za = zarr.open_group(str(a / "rollouts.zarr"), mode="r")
    zb = zarr.open_group(str(b / "rollouts.zarr"), mode="r")
    steps = sorted(za.group_keys())
    if steps != sorted(zb.group_keys()):
        print(f"steps differ: {steps} vs {sorted(zb.group_keys())}")
        return False
    for step in steps:
        names_a, names_b = set(za[step].array_keys()), set(zb[step].array_keys())
        for name in sorted(names_a & names_b):
            if not np.array_equal(za[step][name][:], zb[step][name][:]):
                print(f"{step}/{name} differs")
                return False
        print(f"{step}: {len(names_a & names_b)} arrays equal; in one run only: {sorted(names_a ^ names_b)}")
    wa, wb = _weights(a), _weights(b)
    print(f"safetensors files: {len(wa)} vs {len(wb)}, identical: {wa == wb}")
    return wa == wb and bool(wa)


if __name__ == "__main__":
    sys.exit(0 if compare_runs(Path(sys.argv[1]), Path(sys.argv[2])) else 1)
