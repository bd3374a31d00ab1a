"""A full disk while a checkpoint is written: the run stops (RunFailed: the CLI's exit 3) naming
the step, the path and the reason; nothing of the partial checkpoint stays; the last good one
is intact and `--resume`, once there is room again, continues from it with each step trained
once. The disk is a small tmpfs the test mounts (root only) and removes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tidal.config import load_config
from tidal.runtime.checkpoints import checkpoint_dirs, damage, latest_good
from tidal.runtime.controller import Controller, RunFailed

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="mounting the small tmpfs this test fills needs root")


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:  # root without the right to mount (a container): nothing to fill
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_during_a_checkpoint_stops_the_run_with_the_last_good_one_intact(small_disk, tiny_model_dir):
    run = small_disk / "run"
    overrides = [f"model.path={tiny_model_dir}", f"run.dir={run}", "train.steps=4", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "run.eval_every=0", "run.progress=false",
                 "run.save_every=1", "run.keep_checkpoints=2"]
    ctl = Controller(load_config(None, overrides))
    try:
        ctl.train_step()
        ctl.train_step()
        size = sum(f.stat().st_size for f in ctl.paths.checkpoint(2).rglob("*") if f.is_file())
        free = shutil.disk_usage(small_disk).free
        # Leave room for the step's metrics and episodes, not for a checkpoint (measured: size ~ 1.3 MB).
        (small_disk / "filler").write_bytes(b"\0" * max(0, free - size // 4))
        with pytest.raises(RunFailed) as stopped:
            ctl.train_step()
    finally:
        ctl.close()
    message = str(stopped.value)
    assert f"step 3: the checkpoint could not be written to {ctl.paths.checkpoint(3)}" in message
    assert "No space left on device" in message
    assert f"the last good checkpoint is {ctl.paths.checkpoint(2)}" in message and "--resume" in message
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == ["step_000001", "step_000002"]
    assert not list((run / "checkpoints").glob("*.tmp"))  # nothing of the partial one
    assert damage(ctl.paths.checkpoint(2)) is None and latest_good(run / "checkpoints") == ctl.paths.checkpoint(2)
    # Room again: the resume continues from step 2 and trains steps 3 and 4 once each.
    (small_disk / "filler").unlink()
    resumed = Controller(load_config(None, overrides), resume=True)
    try:
        assert resumed.step == 2
        resumed.train()
    finally:
        resumed.close()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
