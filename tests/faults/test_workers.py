"""kill -9 or SIGSTOP of an env worker (Ray placement): the worker is replaced (run.max_restarts) and the
run goes on; an episode that had not started on it yet is started on the replacement, so a
worker killed between steps loses no episode."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

import pytest

from tidal.config import load_config
from tidal.runtime.controller import Controller


@pytest.mark.slow  # starts Ray and its actors (tens of seconds here)
def test_a_killed_env_worker_is_replaced_and_no_episode_is_lost(tmp_path, caplog):
    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=3",
        "run.eval_every=0", "run.progress=false", "run.save_every=0", "placement.mode=ray", "placement.colocate=true",
        "placement.env_workers=1", "placement.env.num_cpus=0.25", "placement.trainer.num_cpus=0.5",
        "placement.call_timeout_s=120", "run.max_restarts=1"])
    ctl = Controller(cfg)
    try:
        first = ctl.train_step()
        assert first["episodes/ok"] + first.get("episodes/truncated", 0) == 16
        pid = ctl.roles.env_handles[0].call("pid")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="tidal"):
            second = ctl.train_step()
        assert ctl.roles.envs.restarts == 1 and "env worker 0 died; replaced (restart 1" in caplog.text
        assert second["episodes/ok"] + second.get("episodes/truncated", 0) == 16  # every episode ran
        assert ctl.roles.env_handles[0].call("pid") != pid  # the slot holds the replacement
        events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
        assert [(e["kind"], e["role"], e["step"], e["restart"]) for e in events] == [("restart", "env worker 0", 2, 1)]
        # past run.max_restarts a dead worker stays dead: its episodes end env_error, typed
        os.kill(ctl.roles.env_handles[0].call("pid"), signal.SIGKILL)
        time.sleep(1.0)
        third = ctl.train_step()
        assert third["episodes/env_error"] == 16 and ctl.roles.envs.restarts == 1
    finally:
        ctl.close()


@pytest.mark.slow  # starts Ray and its actors (tens of seconds here)
def test_a_stopped_env_worker_is_found_by_its_ping_killed_and_replaced(tmp_path, caplog):
    """SIGSTOP (a hung worker: alive, answering nothing) between two steps: the next step's
    first calls wait placement.ping_s, the ping goes unanswered, the worker is killed and
    replaced, and the episodes start on the replacement: none is lost."""
    cfg = load_config(overrides=[
        f"run.dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.steps=3",
        "run.eval_every=0", "run.progress=false", "run.save_every=0", "placement.mode=ray", "placement.colocate=true",
        "placement.env_workers=1", "placement.env.num_cpus=0.25", "placement.trainer.num_cpus=0.5",
        "placement.call_timeout_s=120", "placement.ping_s=3", "run.max_restarts=1"])
    ctl = Controller(cfg)
    pid = None
    try:
        ctl.train_step()
        pid = ctl.roles.env_handles[0].call("pid")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tidal"):
            second = ctl.train_step()
        took = time.monotonic() - t0
        assert "env worker 0 did not answer a ping within 3 s" in caplog.text
        assert ctl.roles.envs.restarts == 1 and "env worker 0 died; replaced (restart 1" in caplog.text
        assert second["episodes/ok"] + second.get("episodes/truncated", 0) == 16  # every episode ran
        assert ctl.roles.env_handles[0].call("pid") != pid
        # ping (3 s) + its answer's wait (3 s) + a new actor's start: well under the 120 s call bound.
        assert took < 90, took
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a stopped process that was not killed must not outlive the test
        ctl.close()
