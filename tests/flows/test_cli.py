"""The grpoflow command line: errors, the UI and the planner entry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stages.tcp_store import free_port

GRPOFLOW = [sys.executable, "-m", "flows.cli"]


def test_bad_override_is_one_line_and_exit_2():
    proc = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", "train.schedule=zigzag"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.schedule" in lines[0]


def test_ui_serves_the_run_store_on_loopback(tmp_path):
    port = free_port()
    proc = subprocess.Popen(GRPOFLOW + ["ui", "configs/tiny.yaml", f"runs_dir={tmp_path}", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in first and "sqlite:///" in first
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and status is None:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
            except OSError:
                time.sleep(1.0)
        assert status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_plan_writes_the_report(tmp_path):
    proc = subprocess.run(GRPOFLOW + ["plan", "configs/seed-70b.yaml", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plan.json").exists() and (tmp_path / "report.md").exists()
    assert list(tmp_path.glob("*.png"))


def test_help_texts_are_clean_and_overrides_optional():
    for args in (["--help"], ["run", "--help"], ["config", "--help"], ["ui", "--help"], ["workers", "--help"]):
        proc = subprocess.run(GRPOFLOW + args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "`" not in proc.stdout, args
    run_help = subprocess.run(GRPOFLOW + ["run", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "[KEY=VALUE ...]" in run_help and "optional" in run_help


def test_config_prints_documented_yaml_that_loads_back(tmp_path):
    from flows.config import load_config

    proc = subprocess.run(GRPOFLOW + ["config", "configs/tiny.yaml", "iterations=7", "train.schedule=gpipe"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # The docstring under ClusterConfig.scheduler_address in stages/config.py, right above its key.
    i = lines.index("  scheduler_address: null")
    assert lines[i - 1] == "  # Connect to this Dask scheduler instead of starting an embedded local cluster."
    assert "iterations: 7" in lines and "  schedule: gpipe" in lines
    out = tmp_path / "resolved.yaml"
    out.write_text(proc.stdout)
    assert load_config(out) == load_config("configs/tiny.yaml", ["iterations=7", "train.schedule=gpipe"])


def test_config_says_the_built_in_model_keys_are_not_in_effect_with_a_model_folder(tmp_path):
    """With model.path set the listing says which folder sets the model, with its sizes; the
    built-in keys stay (the YAML still loads back) under that note. Comments wrap without one-word lines."""
    import json

    from flows.describe import describe_config
    from stages.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576,
                                                      "num_hidden_layers": 30}))
    shown = describe_config(ModelConfig(path=str(tmp_path)))
    assert (f"NOT IN EFFECT from here to the end of model: (the built-in model's keys): {tmp_path / 'config.json'} "
            "sets the model: model_type llama, hidden_size 576, num_hidden_layers 30.") in " ".join(
                line.removeprefix("# ") for line in shown.splitlines())
    assert shown.index("NOT IN EFFECT") < shown.index("model_type: llama") and "hidden_size: 64" in shown
    assert "NOT IN EFFECT" not in describe_config(ModelConfig())
    from flows.config import load_config

    # rollout.max_num_seqs's docstring has source lines longer than the listing's: joined, then wrapped.
    lines = describe_config(load_config("configs/tiny.yaml")).splitlines()
    i = lines.index("  max_num_seqs: 256")
    doc = [line.strip().removeprefix("# ") for line in lines[i - 4: i]]
    assert all(len(line) > 40 for line in doc[:-1]), doc  # no line cut short but the paragraph's last
    assert "so hold an engine's whole share there" in " ".join(doc)


def test_config_into_a_reader_that_leaves_early_is_quiet():
    """``grpoflow config | head`` closes the pipe after a few lines: no BrokenPipeError traceback."""
    proc = subprocess.Popen(GRPOFLOW + ["config", "configs/tiny.yaml"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the listing is written (the imports take a second)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err.decode() == ""


def test_config_keys_lists_every_override_key():
    proc = subprocess.run(GRPOFLOW + ["config", "configs/tiny.yaml", "--keys"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    keys = [line.split("=", 1)[0] for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert "train.pipeline_model_parallel_size" in keys and "mlflow.experiment" in keys
    assert "rollout.group_size=8" in proc.stdout.splitlines()
    assert "    G: completions per prompt." in proc.stdout.splitlines()


def test_ui_refuses_a_folder_without_a_tracking_store(tmp_path):
    proc = subprocess.run(GRPOFLOW + ["ui", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "holds no mlflow.db" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_reward_module_in_the_working_folder_is_found(tmp_path):
    """reward.functions: [mytask.rewards:score] beside the config, grpoflow run from that folder:
    the driver imports it, and PYTHONPATH carries the folder to the workers' reward processes."""
    package = tmp_path / "mytask"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text("def score(prompt, completion, answer=None):\n    return 1.0\n")
    config = Path("configs/tiny.yaml").resolve()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The installed command, as a user types it (python -m would put the working folder on the path itself).
    command = [str(Path(sys.executable).parent / "grpoflow"), "config", str(config),
               "reward.functions=[mytask.rewards:score]"]
    found = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert found.returncode == 0, found.stderr
    assert "mytask.rewards:score" in found.stdout
    elsewhere = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path / "mytask",
                               env=env)
    assert elsewhere.returncode == 2 and "PYTHONPATH" in elsewhere.stderr and "\n" not in elsewhere.stderr.strip()


def test_the_working_folder_reaches_the_workers_through_pythonpath(monkeypatch, tmp_path):
    from flows.cli import _working_folder_importable

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setattr("sys.path", list(sys.path))
    _working_folder_importable()
    assert os.environ["PYTHONPATH"].split(os.pathsep) == ["/somewhere", str(tmp_path)]
    assert sys.path[-1] == str(tmp_path)  # last: a stray numpy.py there shadows nothing


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        out += children
        frontier = children
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_ctrl_c_stops_a_run_in_one_line_and_leaves_no_process(tmp_path):
    from flows.config import load_config
    from flows.loop import run_folder

    overrides = ["iterations=50", f"runs_dir={tmp_path}", "run_name=ctrl-c", "warmup.steps=5"]
    # As at a terminal: a shell's background job (CI's, say) starts with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler.
    proc = subprocess.Popen([*GRPOFLOW, "run", "--quiet", "configs/tiny.yaml", *overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    folder = run_folder(load_config("configs/tiny.yaml", overrides))
    deadline = time.monotonic() + 300
    while not (Path(folder.rollouts) / "step_1").exists():  # step 0 is published: the run is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    workers = _descendants(proc.pid)
    assert workers
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "grpoflow: interrupted; the same command resumes it from the stages it completed")
    deadline = time.monotonic() + 20
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in workers if _alive(p)] == []
    with folder.lock():  # the driver's lock went with it
        pass


def test_disk_full_is_found_anywhere_in_the_chain():
    import errno

    from flows.cli import _disk_full

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/r/policy/v3/shard0.safetensors")
        except OSError as exc:
            raise RuntimeError("step 2: stage train failed") from exc
    except RuntimeError as wrapped:
        assert _disk_full(wrapped) == "[Errno 28] No space left on device: '/runs/r/policy/v3/shard0.safetensors'"
    # a worker's error re-raised on the driver keeps only its text
    assert _disk_full(RuntimeError("(sqlite3.OperationalError) database or disk is full\n[SQL: ...]")) == \
        "(sqlite3.OperationalError) database or disk is full"
    assert _disk_full(ValueError("loss is nan")) is None


def test_overrides_may_follow_an_option_and_strays_are_refused():
    # parsed the same as before the option: the override reaches the config (and its error names it)
    proc = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", "--quiet", "train.schedule=zigzag"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.schedule" in proc.stderr.strip().splitlines()[-1], proc.stderr
    proc = subprocess.run(GRPOFLOW + ["config", "configs/tiny.yaml", "--keys", "iterations=7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "\niterations=7\n" in f"\n{proc.stdout}", proc.stderr
    proc = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", "--quiet", "stray"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: stray" in proc.stderr
