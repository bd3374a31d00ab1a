"""`tidal launch slurm`: the sbatch script's parts (fast), and a real job on a one-node Slurm
cluster started on this machine (slow): Ray comes up on loopback, the default job (shortened,
2 trainer ranks) trains to the end, and the job's Ray processes are gone afterwards."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_limits import TRAIN_TIMEOUT_S
from slurm_support import is_loopback, job_processes, listening, require_slurm

from tidal.cli import main
from tidal.config import ConfigError, load_config
from tidal.launch.slurm import node_resources, plan_nodes

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["train.steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "run.eval_every=0",
         "run.progress=false", "placement.trainer_ranks=2",
         # the node offers 2 CPUs: 2 trainer ranks and 1 engine replica share them
         "placement.trainer.num_cpus=0.5", "placement.engine.num_cpus=0.5"]


def dry_run(capsys, *args: str) -> str:
    assert main(["launch", "slurm", "--dry-run", *args]) == 0
    return capsys.readouterr().out


def test_dry_run_prints_a_script_that_runs_ray_and_the_driver(tmp_path, capsys):
    run = tmp_path / "run"
    script = dry_run(capsys, *SHORT, f"run.dir={run}", "--partition", "gpu", "--time", "01:00:00")
    assert not run.exists()  # a dry run writes nothing
    lines = script.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    for directive in ["--nodes=1", "--ntasks-per-node=1", "--partition=gpu", "--time=01:00:00", "--signal=B:TERM@120",
                      f"--output={run}/slurm-%j.out"]:
        assert f"#SBATCH {directive}" in lines
    assert "RAY_TMP=/tmp/tidal-ray-$SLURM_JOB_ID" in lines  # temp dir and port per job
    assert "PORT=$(free_port $((20000 + SLURM_JOB_ID % 10000)))" in lines
    assert "trap cleanup EXIT" in lines and "trap 'exit 143' TERM INT" in lines
    assert 'srun --overlap --nodes=1 --ntasks=1 -w "${NODES[$i]}" "$RAY" start --block' in script
    assert "ray_node 0 --head" in script and 'ray_node "$i" --address="$RAY_ADDRESS"' in script
    assert "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in script  # one node: loopback
    assert "HEALTH_TIMEOUT_S=300" in lines
    driver = next(line for line in lines if " -m tidal.cli train " in line)
    for part in ["placement.trainer_ranks=2", f"run.dir={run}", "placement.mode=ray",
                 'placement.address="$RAY_ADDRESS"']:
        assert part in driver
    path = tmp_path / "s.sbatch"
    path.write_text(script)
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert checked.returncode == 0, checked.stderr


def test_bash_n_catches_a_broken_script(tmp_path, capsys):
    """Positive control for the syntax check above: the script with its last `fi` dropped."""
    script = dry_run(capsys, *SHORT, f"run.dir={tmp_path / 'run'}")
    broken = tmp_path / "b.sbatch"
    broken.write_text(script.replace("\nfi\n", "\n", 1))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True, timeout=30, check=False).returncode != 0


def test_nodes_and_roles_come_from_the_config():
    """examples/ray/gpu_cluster.yaml: 8 trainer ranks and 8 engines of 1 GPU each, pinned to
    `trainer_node` / `engine_node`: at 8 GPUs per node, one trainer node and one engine node."""
    cfg = load_config(str(ROOT / "examples/ray/gpu_cluster.yaml"))
    assert plan_nodes(cfg, 8) == (1, 1)
    assert plan_nodes(cfg, 4) == (2, 2)
    assert node_resources(cfg, 2, 1) == [{"trainer_node": 8.0}, {"engine_node": 8.0}]
    assert node_resources(cfg, 1, 1) == [{"trainer_node": 8.0, "engine_node": 8.0}]  # too few nodes: shared
    unpinned = load_config(str(ROOT / "examples/ray/gpu_cluster.yaml"))
    unpinned.placement.trainer.resources, unpinned.placement.engine.resources = {}, {}
    assert plan_nodes(unpinned, 8) == (2, 0)  # 16 GPUs, nodes shared by both roles
    with pytest.raises(ConfigError, match="--gpus-per-node"):
        plan_nodes(cfg, 0)
    assert plan_nodes(load_config(overrides=[*SHORT, "placement.mode=ray"]), 0) == (1, 0)  # a CPU job: one node


def test_dry_run_sizes_the_job_from_the_config(capsys):
    script = dry_run(capsys, str(ROOT / "examples/ray/gpu_cluster.yaml"), "--gpus-per-node", "8")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert """RESOURCES=('{"trainer_node": 8.0}' '{"engine_node": 8.0}')""" in script


def test_a_job_too_small_for_the_roles_is_refused(capsys):
    args = ["launch", "slurm", "--dry-run", str(ROOT / "examples/ray/gpu_cluster.yaml"), "--gpus-per-node", "8"]
    assert main([*args, "--nodes", "1"]) == 2
    assert "reserve 16" in capsys.readouterr().err
    assert main([*args, "--nodes", "2"]) == 0  # the control: enough nodes


def test_without_sbatch_the_error_names_it_and_the_script_stays(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no Slurm client commands
    run = tmp_path / "run"
    assert main(["launch", "slurm", *SHORT, f"run.dir={run}"]) == 2
    assert "`sbatch` is not on PATH" in capsys.readouterr().err
    assert (run / "launch.sbatch").is_file()  # written: it can be submitted by hand


def test_bad_override_is_refused_before_anything_is_written(tmp_path, capsys):
    assert main(["launch", "slurm", "placement.trainer_ranks=0", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "trainer_ranks" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _job_state(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=False)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def _submit(run: Path, *overrides: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "launch", "slurm", *SHORT, *overrides, f"run.dir={run}"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.splitlines()[-1])["job_id"]


def _wait_gone(marker: str, timeout_s: float = 45.0) -> dict[int, str]:
    """The job's processes still alive after up to `timeout_s` (Slurm ends a step's processes
    after its KillWait, 30 s in scripts/setup_slurm.sh)."""
    deadline = time.monotonic() + timeout_s
    while (left := job_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_slurm_job_trains_and_leaves_no_ray_behind(tmp_path):
    require_slurm()
    run = tmp_path / "run"
    job_id = _submit(run)
    marker = f"/tmp/tidal-ray-{job_id}"
    seen, addresses = {}, set()
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    try:
        while (state := _job_state(job_id))["JobState"] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            assert time.monotonic() < deadline, f"job {job_id} still {state['JobState']} after {TRAIN_TIMEOUT_S}s"
            procs = job_processes(marker)
            seen.update(procs)
            addresses |= listening(procs)
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)  # nothing if it has ended
    log = (run / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log[-3000:]
    assert "Ray cluster of 1 node(s) up" in log
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["episodes"] == 16 for r in rows)
    # The job's Ray cluster ran (the positive control for the search below) and listened on loopback only.
    # srun is Slurm's: its I/O ports bind every interface (Slurm's SrunPortRange), whatever Ray does.
    assert {"gcs_server", "raylet"} <= set(seen.values()), seen
    ray_addresses = {(name, ip) for name, ip in addresses if name != "srun"}
    assert {"gcs_server", "raylet"} <= {name for name, _ in ray_addresses}, addresses
    assert all(is_loopback(ip) for _, ip in ray_addresses), addresses
    assert _wait_gone(marker) == {}
    assert not Path(marker).exists()


@pytest.mark.slow
def test_scancel_takes_the_ray_cluster_down(tmp_path):
    """A job cancelled while its driver runs: the trap stops the driver and the Ray steps."""
    require_slurm()
    run = tmp_path / "run"
    job_id = _submit(run, "train.steps=1000")
    marker, log = f"/tmp/tidal-ray-{job_id}", run / f"slurm-{job_id}.out"
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    try:
        while not (log.exists() and "starting the driver" in log.read_text()):
            state = _job_state(job_id)["JobState"]
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state} before its driver started"
            assert time.monotonic() < deadline, f"job {job_id}: no driver after {TRAIN_TIMEOUT_S}s"
            time.sleep(1)
        seen = job_processes(marker)
        assert {"gcs_server", "raylet"} <= set(seen.values()), seen  # the control: the cluster is there
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    while _job_state(job_id)["JobState"] in ("RUNNING", "COMPLETING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job_id} not ended after scancel"
        time.sleep(1)
    assert _job_state(job_id)["JobState"] == "CANCELLED"
    assert _wait_gone(marker) == {}
    assert not Path(marker).exists()
    assert re.search(r"Ray cluster stopped in \d+ s \(exit 143\)", log.read_text())  # the trap ran to its end
