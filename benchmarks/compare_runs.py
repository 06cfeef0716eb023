"""Compare two run folders: every Zarr array both hold, step by step, and the sha256 of every policy
safetensors file. Used to check that rollout.max_staleness=0 reproduces the synchronous loop:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/compare_runs.py runs/a runs/b
"""
import hashlib, sys
from pathlib import Path
import numpy as np, zarr

def compare(a, b):
    a, b = Path(a), Path(b)
    za, zb = zarr.open_group(str(a / "rollouts.zarr"), mode="r"), zarr.open_group(str(b / "rollouts.zarr"), mode="r")
    steps = sorted(k for k in za.group_keys())
    assert steps == sorted(zb.group_keys()), (steps, sorted(zb.group_keys()))
    n = 0
    for st in steps:
        na, nb = set(za[st].array_keys()), set(zb[st].array_keys())
        for name in sorted(na & nb):
            x, y = za[st][name][:], zb[st][name][:]
            if not np.array_equal(x, y):
                print("DIFF", st, name); return False
            n += 1
        print(st, "arrays equal:", len(na & nb), "only in one:", sorted(na ^ nb))
    def shas(root):
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.safetensors"))}
    sa, sb = shas(a / "policy"), shas(b / "policy")
    print("safetensors files:", len(sa), "equal:", sa == sb)
    for k in sorted(sa)[-1:]:
        print(k, sa[k][:16], sb.get(k, "")[:16])
    return sa == sb and n > 0

if __name__ == "__main__":
    sys.exit(0 if compare(sys.argv[1], sys.argv[2]) else 1)
