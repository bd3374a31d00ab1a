"""kill -9 of a trainer rank in a 2-rank Ray run (FSDP2 over gloo): the run restarts its roles
from its last checkpoint (tidal/runtime/recovery.py), logs the restart, and ends with the same
numbers as an uninterrupted run of the same seed, each step trained once and each episode
stored once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest

from tidal.config import load_config
from tidal.runtime.checkpoints import latest_good
from tidal.runtime.controller import Controller, RunFailed
from tidal.runtime.recovery import Recovering

BASE = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "train.steps=4",
        "run.eval_every=0", "run.progress=false", "run.save_every=1", "run.threads=1", "placement.mode=ray",
        "placement.trainer_ranks=2", "placement.trainer.num_cpus=0.5", "placement.engine.num_cpus=0.5",
        "placement.call_timeout_s=120", "run.max_restarts=1"]
TIMING = ("time/", "engines/", "tokens_per_s", "generated_tokens_per_s")


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def numbers(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMING) and not k.endswith("per_s")}


def train(cfg, kill_rank_after_step=None, sig=signal.SIGKILL):
    ctl = Controller(cfg)
    killed = []
    if kill_rank_after_step is not None:
        pid = ctl.trainer.ranks[1].call("pid")

        def killer():
            run = ctl.paths.root
            while not (run / "metrics.jsonl").exists() or len(rows(run)) < kill_rank_after_step:
                time.sleep(0.02)
            os.kill(pid, sig)
            killed.append(pid)
        threading.Thread(target=killer, daemon=True).start()
    runner = Recovering(ctl, lambda rec: Controller(cfg, resume=True, resume_record=rec))
    try:
        runner.train()
    finally:
        if runner.ctl is not None:
            runner.ctl.close()
        for pid in killed:  # a stopped rank's process is killed with its actor; make sure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return runner, killed


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uninterrupted run the recovered ones must equal."""
    run = tmp_path_factory.mktemp("plain") / "run"
    runner, _ = train(load_config(overrides=[*BASE, f"run.dir={run}"]))
    assert runner.restarts == 0
    return run


@pytest.mark.slow  # 2-rank Ray runs and a restart (about a minute each here)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "stop"])
def test_a_lost_trainer_rank_is_recovered_and_the_run_ends_as_an_uninterrupted_one(tmp_path, plain, sig):
    """kill -9: the rank's actor dies. SIGSTOP: it hangs, answering nothing; its call (or its
    peer's, waiting in a collective) passes placement.call_timeout_s, the ping finds it silent."""
    run = tmp_path / "lost"
    extra = ["placement.call_timeout_s=30"] if sig == signal.SIGSTOP else []
    runner, killed = train(load_config(overrides=[*BASE, f"run.dir={run}", *extra]), kill_rank_after_step=2, sig=sig)
    assert killed and runner.restarts == 1
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["kind"] == "restart"]
    assert len(restart) == 1 and "trainer rank 1" in restart[0]["role"] and restart[0]["restart"] == 1
    assert restart[0]["checkpoint"].endswith(f"step_{restart[0]['step'] - 1:06d}")
    resumes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert [r.get("restart") for r in resumes] == [1]
    # Each step once, and the same numbers as the uninterrupted run: the restart resumed the
    # checkpoint's weights, optimizer, data position and RNG states, so steps after it are the
    # same computation on the same inputs.
    got, want = rows(run), rows(plain)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert numbers(a) == numbers(b), a["step"]
    for s in range(1, 5):  # every step's episodes in the store once each
        ids = pq.read_table(run / "episodes" / f"step_{s:06d}.parquet", columns=["episode_id"]).column(0).to_pylist()
        assert len(ids) == len(set(ids)) == 16, (s, ids)


@pytest.mark.slow
def test_past_max_restarts_a_lost_rank_stops_the_run_with_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(overrides=[*BASE, f"run.dir={run}", "run.max_restarts=0"])
    with pytest.raises(RunFailed, match=r"trainer rank \d.*not restarted: run.max_restarts=0 restarts were used\. "
                       r"The last good checkpoint is .*step_00000[12]"):
        train(cfg, kill_rank_after_step=2)
    assert not (run / "events.jsonl").exists() or "restart" not in (run / "events.jsonl").read_text()
    assert latest_good(run / "checkpoints").name in ("step_000001", "step_000002")  # intact, and found


@pytest.mark.slow
def test_a_rank_lost_before_the_first_checkpoint_stops_the_run_in_one_message(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(overrides=[*BASE, f"run.dir={run}", "run.save_every=0"])  # no checkpoint before the end
    with pytest.raises(RunFailed, match=r"trainer rank \d.*not restarted: the run has no checkpoint to restart from "
                       r"yet \(run.save_every\)\. No step was saved: start the run again"):
        train(cfg, kill_rank_after_step=1)
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
