"""Faults at a run's start and between two runs, through the CLI as a person meets them: a
corrupt dataset ends with one message naming its file (exit 2, no traceback); SIGTERM during
start-up stops it cleanly (exit 143) and leaves the directory free; a second `tidal train`
into a live run's directory, or a `--resume` of it, is refused naming the first (exit 2)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tidal.cli import main

TIDAL = [sys.executable, "-c", "import sys; from tidal.cli import main; sys.exit(main())"]
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "run.progress=false", "run.eval_every=0", "run.save_every=1", "run.threads=1"]


def _corrupt(path, how):
    pq.write_table(pa.table({"prompt": [f"what is {i} + 1?" for i in range(200)], "answer": list(range(200))}), path,
                   compression="snappy")
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # bytes of a data page changed: the footer reads, the page does not decompress
        data[len(data) // 4: len(data) // 4 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "corrupted"])
def test_a_corrupt_parquet_dataset_is_named_in_one_message(tiny_model_dir, tmp_path, how, capsys):
    data = tmp_path / "prompts.parquet"
    _corrupt(data, how)
    code = main(["train", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", f"task.dataset={data}", *SMALL])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"dataset `{data}` is not a readable Parquet file" in err and "Traceback" not in err, err


def test_a_jsonl_dataset_that_is_not_text_is_named_by_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b'{"prompt": "1 + 1?"}\n{"prompt": "\xff\xfe"}\n')
    code = main(["train", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", f"task.dataset={data}", *SMALL])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}, line 2: not UTF-8 text" in err, err


def _wait_for(predicate, proc, seconds=240.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    return predicate()


def _holder(run):
    try:
        return json.loads((run / "run.lock").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow  # a `tidal train` process (~10 s here)
def test_sigterm_during_start_up_stops_cleanly_and_frees_the_directory(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=40",
                             *SMALL], stderr=subprocess.PIPE, text=True)
    try:
        # config.yaml is written once the inputs are checked, before the model and the roles load.
        assert _wait_for(lambda: (run / "config.yaml").exists(), proc), proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM during start-up, before any step; nothing was trained" in err, err
    assert "Traceback" not in err, err
    assert not (run / "metrics.jsonl").exists() and (run / "run.lock").read_text() == ""  # released


@pytest.mark.slow  # two `tidal train` processes and a refused resume (~25 s here)
def test_a_second_train_or_resume_into_a_live_runs_directory_is_refused_naming_it(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=400",
                              *SMALL], stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: (run / "metrics.jsonl").exists(), first), first.stderr.read()
        others = [subprocess.Popen([*TIDAL, *args], stderr=subprocess.PIPE, text=True) for args in (
            ["train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=5", "run.seed=1", *SMALL],
            ["train", "--resume", f"run.dir={run}"])]  # at once: each is a process start (seconds)
        for other in others:
            _, err = other.communicate(timeout=120)
            assert other.returncode == 2, err
            assert f"is in use by another run: pid {first.pid} on host" in err and "Traceback" not in err, err
        assert first.poll() is None  # the first run goes on, alone
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, err
    assert not (run / "resumes.jsonl").exists()  # the refused resume recorded nothing
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, in order, each once
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["seed"] == 0  # the first run's, not run.seed=1
