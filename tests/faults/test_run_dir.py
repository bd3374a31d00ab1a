"""One run per directory (RUN/run.lock), and a directory an interrupted attempt left behind:
a second run into a live run's directory, or a `--resume` of a live run, is refused naming the
holder (pid, host, start time) and writes nothing; a lock left by a killed run is taken over,
said in the log; a torn last line of metrics.jsonl (a process killed while writing it) neither
stops the resume nor adds a phantom resumes.jsonl line; the episode files of an abandoned
attempt's steps past the checkpoint are removed by the resume; appends are whole lines or
nothing on a real short write."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tidal.config import load_config
from tidal.runtime.controller import Controller

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "run.eval_every=0",
         "run.progress=false", "run.save_every=1", "run.threads=1"]


def _cfg(tiny_model_dir, run, steps=2):
    return load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={run}", f"train.steps={steps}", *SMALL])


def test_a_second_run_or_a_resume_of_a_live_run_is_refused_by_name(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    first = Controller(_cfg(tiny_model_dir, run))
    try:
        first.train_step()
        config_before = (run / "config.yaml").read_text()
        for resume in (False, True):
            with pytest.raises(FileExistsError) as refused:  # the CLI's exit 2, one line
                Controller(_cfg(tiny_model_dir, run, steps=5), resume=resume)
            message = str(refused.value)
            assert f"pid {os.getpid()} on host {socket.gethostname()}, started 20" in message, message
            assert "in use by another run" in message
        # the refused ones wrote nothing: no resume recorded, the config the first run's
        assert not (run / "resumes.jsonl").exists() and (run / "config.yaml").read_text() == config_before
        first.train_step()
    finally:
        first.close()
    resumed = Controller(_cfg(tiny_model_dir, run, steps=3), resume=True)  # released: the resume goes on
    try:
        resumed.train()
    finally:
        resumed.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_the_stale_lock_of_a_killed_run_is_taken_over_and_said(tmp_path, caplog):
    from tidal.runtime.run_lock import RunLock

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tidal.runtime.run_lock import RunLock
        lock = RunLock({str(run)!r})
        lock.acquire()
        print("held", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FileExistsError, match=f"pid {holder.pid} on host"):
            RunLock(run).acquire()  # alive: refused
    finally:
        holder.kill()  # kill -9: it releases nothing itself
        holder.wait(timeout=30)
    lock = RunLock(run)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        lock.acquire()
    try:
        assert f"a stale lock of pid {holder.pid} on host" in caplog.text
        assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_torn_metrics_line_and_an_abandoned_attempt_do_not_stop_the_resume(tiny_model_dir, tmp_path, caplog):
    run = tmp_path / "run"
    ctl = Controller(_cfg(tiny_model_dir, run, steps=4))
    try:
        for _ in range(3):
            ctl.train_step()
    finally:
        ctl.close()
    # What an attempt killed in step 4 leaves: half of its metrics line, and its episode file
    # (a run that went further than the resume will go).
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward": 0.5, "lo')
    (run / "episodes" / "step_000003.parquet").rename(run / "episodes" / "step_000009.parquet")
    (run / "episodes" / ".step_000010.parquet.tmp").write_bytes(b"PAR1")
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000003")  # the resume goes back to step 2
    with caplog.at_level(logging.WARNING, logger="tidal"):
        resumed = Controller(_cfg(tiny_model_dir, run, steps=3), resume=True)
        try:
            assert resumed.step == 2
            resumed.train()
        finally:
            resumed.close()
    assert "did not read as JSON" in caplog.text and "step_000009.parquet" in caplog.text
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert len((run / "resumes.jsonl").read_text().splitlines()) == 1  # one resume, one line
    assert sorted(p.name for p in (run / "episodes").iterdir() if p.is_file()) == [
        f"step_{s:06d}.parquet" for s in (1, 2, 3)]


_SHORT_WRITE = textwrap.dedent("""
    import os, resource, signal, sys
    path, mode = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG) instead of killing us
    size = os.path.getsize(path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))  # room for 10 more bytes
    line = '{"step": 2, "reward": 0.123456789, "loss": 1.5}\\n'
    try:
        if mode == "durable":
            from tidal.durable import append_lines
            append_lines(path, [line])
        else:
            with open(path, "a") as f:
                f.write(line)
    except OSError as e:
        print(e.errno)
""")


@pytest.mark.parametrize("mode", ["durable", "plain"])
def test_an_append_is_a_whole_line_or_nothing_on_a_real_short_write(tmp_path, mode):
    """RLIMIT_FSIZE makes the kernel take only 10 bytes of the line, then refuse (EFBIG), as a
    filling disk does; the plain append (the positive control) leaves the torn line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    out = subprocess.run([sys.executable, "-c", _SHORT_WRITE, str(path), mode], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=True)
    assert out.stdout.strip() == "27", out  # EFBIG
    if mode == "durable":
        assert path.read_text() == '{"step": 1}\n'
    else:
        assert path.read_text().startswith('{"step": 1}\n{"step": 2') and not path.read_text().endswith("\n")


def test_the_lock_file_masks_secret_looking_overrides(monkeypatch):
    from tidal.runtime.run_lock import _command

    monkeypatch.setattr(sys, "argv", ["tidal", "train", "gateway.token=s3cr3t", "run.seed=1", "MY_API_KEY=abc"])
    assert _command() == "tidal train gateway.token=*** run.seed=1 MY_API_KEY=***"
