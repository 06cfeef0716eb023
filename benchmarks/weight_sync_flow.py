"""Weight sync inside the flow: cluster.weight_sync=disk vs memory, from the runs' own step metrics.

For each model size, one short synchronous run per mode (disk; memory with
cluster.weight_sync_content_hash verify and none; the same config otherwise, one after the other
on the same machine), then medians over steps 1.. (step 0 loads v0 from disk in every mode):

  train side    memory: weight_sync_memory_send_seconds (announce + broadcast of the pp ranks'
                shards, hashing included, the larger of the ranks) and its bytes; both modes write
                the shards (publish_write_seconds) and publish (publish_seconds), which stay the
                lineage and the resume point
  engine side   disk: weight_load_disk_seconds (read the folder, build the model, load it);
                memory: weight_sync_memory_load_seconds (take the received copy, load it into the
                held model) and, off the critical path, weight_sync_memory_receive_seconds (the
                receiving thread's broadcast + copy)
  step          iteration_seconds (submission to the step's last stage)

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync_flow.py [--iterations 4] [--reverse] [--models 0,1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from flows.config import load_config
from flows.loop import run

MODELS = {
    "tiny (configs/tiny.yaml, h64, 4 layers)": [],
    "h512, 8 layers": ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_hidden_layers=8",
                       "model.num_attention_heads=8", "model.num_key_value_heads=8"],
}
COLUMNS = ("weight_sync_memory_send_seconds", "weight_sync_memory_send_hash_seconds", "weight_sync_memory_send_bytes",
           "publish_write_seconds",
           "publish_seconds", "weight_load_disk_seconds", "weight_sync_memory_load_seconds",
           "weight_sync_memory_receive_seconds", "iteration_seconds")


MODES = {"disk": ["cluster.weight_sync=disk"],
         "memory (verify)": ["cluster.weight_sync=memory", "cluster.weight_sync_content_hash=verify"],
         "memory (none)": ["cluster.weight_sync=memory", "cluster.weight_sync_content_hash=none"]}


def _run(runs_dir: str, name: str, overrides: list[str], iterations: int, prompts: int) -> list[dict]:
    cfg = load_config("configs/tiny.yaml", [
        f"iterations={iterations}", f"run_name={name}", f"runs_dir={runs_dir}", "warmup.steps=30",
        f"task.prompts_per_step={prompts}", "train.micro_batch_size=16", *overrides])
    return run(cfg, progress=False).metrics


def _median(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics[1:] if key in m]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--reverse", action="store_true", help="run the modes in reverse order")
    parser.add_argument("--models", default=",".join(str(i) for i in range(len(MODELS))),
                        help="indices into MODELS, comma-separated")
    args = parser.parse_args()
    modes = list(MODES.items())[::-1] if args.reverse else list(MODES.items())
    chosen = {int(i) for i in args.models.split(",")}
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="weight-sync-flow-")
    print("| model | mode | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for i, (name, model) in enumerate(MODELS.items()):
        if i not in chosen:
            continue
        for j, (mode, overrides) in enumerate(modes):
            metrics = _run(runs_dir, f"m{i}-{mode.split()[0]}{j}", [*model, *overrides], args.iterations,
                           args.prompts)
            cells = []
            for key in COLUMNS:
                v = _median(metrics, key)
                cells.append(f"{v / 2**20:.2f} MiB" if key.endswith("_bytes") and v == v else f"{v:.4f}")
            print(f"| {name} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
