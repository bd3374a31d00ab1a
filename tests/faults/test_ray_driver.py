"""The local Ray instance of a run and its driver's end: a driver killed with kill -9 leaves no
Ray process behind for long (the raylet's agents lingered 62 s, waiting on the dead GCS:
tidal/runtime/ray_watchdog.py ends them); a run whose Ray GCS died after its last step closes
promptly with exit 0 (it waited 60 s, then Ray ended the process with exit 1). Each in a
process of its own, with its own Ray temp dir (other tests may run Ray at the same time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

TIDAL = [sys.executable, "-c", "import sys; from tidal.cli import main; sys.exit(main())"]
RAY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "run.eval_every=0",
       "run.progress=false", "run.save_every=0", "run.threads=1", "placement.mode=ray", "placement.colocate=true",
       "placement.trainer.num_cpus=0.5"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {cmd}")  # whole: a cut line missed `gcs_server` under a longer checkout path
        except OSError:
            continue
    return out


@pytest.mark.slow  # a Ray run in a process of its own (~40 s here)
def test_no_ray_process_outlives_a_killed_driver_for_long(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    driver = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=400",
                               *RAY, f"placement.ray_temp_dir=/tmp/rdw{os.getpid()}"],
                              stderr=(tmp_path / "stderr").open("w"), env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert (run / "metrics.jsonl").exists(), "the run made no step"
        time.sleep(2.0)  # the raylet's agents are up (they start beside the first actors)
        ray_processes = _descendants(driver.pid)
        assert any("Agent" in p for p in _alive(ray_processes)), _alive(ray_processes)  # the agents were there
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _alive(ray_processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        gone_after = 60 - (deadline - time.monotonic())
    finally:
        if driver.poll() is None:
            driver.kill()
    left = _alive(ray_processes)
    for p in left:  # never leave them to the next test
        os.kill(int(p.split()[0]), signal.SIGKILL)
    # Ray's own path for the agents takes 60 s (a fixed publish timeout); 20 s is a bound that
    # the watchdog (gone in ~4 s here) meets with room on a loaded machine, and Ray's path does not.
    assert not left and gone_after < 20, (gone_after, left, (tmp_path / "stderr").read_text()[-2000:])


_GCS_DIES = textwrap.dedent("""
    import os, signal, sys, time
    from tidal.config import load_config
    from tidal.runtime.controller import Controller
    import ray
    ctl = Controller(load_config(None, sys.argv[1:]))
    ctl.train()
    gcs = ray._private.worker._global_node.all_processes["gcs_server"][0].process
    os.kill(gcs.pid, signal.SIGKILL)
    gcs.wait()
    t0 = time.monotonic()
    ctl.close()
    print(f"closed in {time.monotonic() - t0:.1f} s", flush=True)
""")


@pytest.mark.slow  # a Ray run in a process of its own (~40 s here)
def test_a_finished_run_whose_gcs_died_closes_promptly_with_exit_0(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-c", _GCS_DIES, f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}",
                          "train.steps=1", *RAY, f"placement.ray_temp_dir=/tmp/rdg{os.getpid()}"],
                         capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    took = float(out.stdout.split("closed in ")[1].split()[0])
    # Ray ends a process that waits 60 s on a dead GCS; closing without waiting on it takes a
    # few seconds (ray.shutdown of the local instance): 30 s leaves room on a loaded machine.
    assert took < 30, out.stdout


@pytest.mark.slow  # a Ray run in a process of its own (~30 s here)
def test_sigterm_while_ray_roles_start_stops_cleanly(tiny_model_dir, tmp_path):
    """ray.init sets its own SIGTERM handler (sys.exit); the run's is put back after it, so a
    SIGTERM while the actors start ends the run as any other (exit 143, one line)."""
    run = tmp_path / "run"
    driver = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=400",
                               *RAY, f"placement.ray_temp_dir=/tmp/rds{os.getpid()}"],
                              stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        # The watchdog starts right after ray.init returns, before any actor: Ray is up, the roles are not.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and driver.poll() is None and not any(
                "ray_watchdog" in p for p in _alive(_descendants(driver.pid))):
            time.sleep(0.01)
        assert not (run / "metrics.jsonl").exists()
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM during start-up, before any step; nothing was trained" in err, err[-3000:]


@pytest.mark.slow  # a Ray start in a process of its own (~15 s here)
def test_sigterm_inside_ray_init_stops_cleanly_and_leaves_no_ray_process(tiny_model_dir, tmp_path):
    """A SIGTERM while ray.init itself runs meets Ray's own handler (`sys.exit(15)`): the run still
    ends as after any SIGTERM at start-up (exit 143, one line) and Ray's processes end with it."""
    run = tmp_path / "run"
    driver = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=400",
                               *RAY, f"placement.ray_temp_dir=/tmp/rdi{os.getpid()}"],
                              stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        # Ray's GCS is up and ray.init has not returned (the watchdog starts right after it does).
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and driver.poll() is None:
            alive = _alive(_descendants(driver.pid))
            if any("gcs_server" in p for p in alive) and not any("ray_watchdog" in p for p in alive):
                break
            time.sleep(0.005)
        assert driver.poll() is None and not any("ray_watchdog" in p for p in _alive(_descendants(driver.pid)))
        descendants = _descendants(driver.pid)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM during start-up, before any step; nothing was trained" in err, err[-3000:]
    deadline = time.monotonic() + 30  # Ray's processes notice their GCS is gone within seconds
    while time.monotonic() < deadline and _alive(descendants):
        time.sleep(0.5)
    assert _alive(descendants) == [], err[-3000:]
