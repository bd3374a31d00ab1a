"""SIGTERM and SIGINT to the driver of a run (`tidal train` in a process of its own): it stops
cleanly (exit 143 / 130) naming its last complete checkpoint; SIGKILL ends it where it is
(nothing of it runs: a checkpoint or a step's episodes may be half written). Either way
`--resume` finishes the run with every step trained once and every episode of every step in
the store once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from tidal.runtime.checkpoints import latest_good

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "task.train_size=64", "task.eval_size=8", "run.progress=false", "run.eval_every=0", "run.save_every=1",
         "run.threads=1"]
TIDAL = [sys.executable, "-c", "import sys; from tidal.cli import main; sys.exit(main())"]


def _steps(run):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # two training processes and a resume each (~20 s apiece here)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_a_signalled_driver_stops_cleanly_and_resumes_exactly(tiny_model_dir, tmp_path, sig, code):
    run = tmp_path / "run"
    proc = subprocess.Popen([*TIDAL, "train", f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=40",
                             *SMALL], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(_steps(run)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(_steps(run)) >= 2, proc.stderr.read() if proc.poll() is not None else "no step in 240 s"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    ckpt = latest_good(run / "checkpoints")
    assert ckpt is not None
    if sig != signal.SIGKILL:  # a killed process says nothing
        assert f"the last complete checkpoint is {ckpt}" in err
    done = json.loads((ckpt / "controller.json").read_text())["step"]
    out = subprocess.run([*TIDAL, "train", "--resume", f"run.dir={run}", f"train.steps={done + 2}"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    steps = [m["step"] for m in _steps(run)]
    assert steps == list(range(1, done + 3))  # each step once: the interrupted one was redone, not doubled
    files = sorted(p.name for p in (run / "episodes").glob("step_*.parquet"))
    assert files == [f"step_{s:06d}.parquet" for s in steps]  # no file of a step that does not count
    for s in steps:  # every step's episodes, once each
        rows = pq.read_table(run / "episodes" / f"step_{s:06d}.parquet", columns=["episode_id"]).to_pylist()
        ids = [r["episode_id"] for r in rows]
        assert len(ids) == len(set(ids)) == 4, (s, ids)
