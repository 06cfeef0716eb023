"""The ``grpoflow`` command line: run iterations, open the MLflow UI, plan a deployment."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

__all__ = ["main"]


def _cmd_run(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.loop import format_summary, fresh_run, run, run_folder

    cfg = load_config(args.config, args.overrides)
    if args.new and run_folder(cfg).exists():
        cfg = fresh_run(cfg)
        print(f"starting over as run {cfg.run_name} in {run_folder(cfg).root}", flush=True)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flows").setLevel(logging.WARNING if args.quiet else logging.INFO)
    summary = run(cfg, progress=not args.quiet)
    print(format_summary(summary))
    print(f"summary: {run_folder(cfg).summary}")
    return 0


def _cmd_ui(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.loop import tracking_uri

    cfg = load_config(args.config, args.overrides)
    uri = tracking_uri(cfg)
    address = f"http://127.0.0.1:{args.port}"
    print(f"MLflow UI for {uri} at {address} (Ctrl-C stops it)", flush=True)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
           "--port", str(args.port)]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli import plan_command

    return plan_command(args.config, args.overrides, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run GRPO iterations of a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. iterations=5 train.schedule=gpipe")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--new", action="store_true",
                   help="start over in a fresh folder (run_name-2, -3, ...) if the run folder exists")
    p.set_defaults(fn=_cmd_run)
    p = sub.add_parser("ui", help="start the MLflow UI on a run's tracking store (127.0.0.1)")
    p.add_argument("config", nargs="?", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(fn=_cmd_ui)
    p = sub.add_parser("plan", help="memory, bubble and throughput of what a run config would do (plan: section for the cluster)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--out", default=None, help="write plan.json, report.md and plots here")
    p.set_defaults(fn=_cmd_plan)
    args = parser.parse_args(argv)
    from flows.schema import ConfigError

    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"grpoflow: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
