"""A full disk at each write of a run's directory: the run stops (a DiskError: the CLI's exit 3)
with one message naming the path, the reason and the last good checkpoint; nothing of the failed
step stays half written (no torn line, no partial checkpoint, no episode file of it); the last
good checkpoint is intact and `--resume`, once there is room again, continues from it with
each step trained once.

The disk: a small tmpfs the test mounts (root) and fills just before the write under test, so
the write meets the kernel's own ENOSPC. Where mounting is impossible (no root, a container
without the right) the same moment injects ENOSPC instead, raised by that write; each test
says which it used (`disk.kind`, in its report line and its assertion messages)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest

from tidal.cli import main
from tidal.config import load_config
from tidal.monitor.alerts import AlertEvent
from tidal.monitor.hacking import HackingEvent
from tidal.runtime.checkpoints import checkpoint_dirs, damage, latest_good
from tidal.runtime.controller import Controller, RunFailed

SMALL = ["train.steps=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "run.eval_every=0", "run.progress=false", "run.save_every=1", "run.keep_checkpoints=2", "run.threads=1"]


class SmallDisk:
    """`path`, on a 16 MB tmpfs (kind "tmpfs") or, where none can be mounted, on the test's own
    disk with ENOSPC injected by `fail(...)` (kind "injected")."""

    def __init__(self, path, kind):
        self.path, self.kind, self.full = path, kind, False

    def fill(self) -> None:
        """No free byte left (tmpfs); or, injected, the next write under test raises ENOSPC."""
        self.full = True
        if self.kind == "tmpfs":
            free = shutil.disk_usage(self.path).free
            with open(self.path / "filler", "wb") as f:
                try:
                    while free > 0:
                        f.write(b"\0" * min(free, 1 << 20))
                        free -= 1 << 20
                except OSError:
                    pass  # full: what was wanted

    def fail(self, path) -> None:
        """Injected mode: the write under test of `path` fails as a full disk's does."""
        if self.kind == "injected" and self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def free_up(self) -> None:
        self.full = False
        (self.path / "filler").unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    mounted = None
    # TIDAL_TEST_DISK=injected: the fallback even where a tmpfs could be mounted (to check it)
    if os.geteuid() == 0 and shutil.which("mount") and os.environ.get("TIDAL_TEST_DISK") != "injected":
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], capture_output=True,
                                 text=True, check=False)
    kind = "tmpfs" if mounted is not None and mounted.returncode == 0 else "injected"
    print(f"full disk: {kind}" + ("" if kind == "tmpfs" else f" (no tmpfs: {mounted.stderr.strip() if mounted else 'not root'})"))
    try:
        yield SmallDisk(root, kind)
    finally:
        if kind == "tmpfs":
            subprocess.run(["umount", "-l", str(root)], check=False)


def _jsonl(path):
    """Every line of a JSONL file, parsed (a torn line fails here)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wrap(monkeypatch, obj, name, before):
    """Call `before(*args)` ahead of obj.name(*args): the moment the disk fills."""
    real = getattr(obj, name)

    def wrapped(*args, **kw):
        before(*args, **kw)
        return real(*args, **kw)
    monkeypatch.setattr(obj, name, wrapped)


def _fill_before_torch_save(disk, monkeypatch, ctl):
    import tidal.trainer.trainer_state as state_module  # where the trainer's checkpoint is written

    real = state_module.torch.save

    def save(obj, path, *a, **kw):
        disk.fill()
        if disk.kind == "injected":  # what torch.save's zip writer raises on a short write, with no errno
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real(obj, path, *a, **kw)
    monkeypatch.setattr(state_module.torch, "save", save)
    return "trainer_state.pt"


def _fill_before_metrics(disk, monkeypatch, ctl):
    sink = next(s for s in ctl.metrics.sinks if s.name == "jsonl")

    def before(step, metrics):
        # A line longer than a page: it cannot fit in the slack of the file's last page, so the
        # full tmpfs takes part of it and refuses the rest (where a plain write tears the line).
        metrics["pad"] = "x" * 9000
        disk.fill()
        disk.fail(sink.path)
    _wrap(monkeypatch, sink, "log", before)
    return "metrics.jsonl"


def _fill_before_episodes(disk, monkeypatch, ctl):
    w = ctl.episode_writer
    _wrap(monkeypatch, w, "_close_step", lambda f: (disk.fill(), disk.fail(w.dir / f".step_{f.step:06d}.parquet.tmp")))
    return ".step_000003.parquet.tmp"


def _fill_before_train_log(disk, monkeypatch, ctl):
    def before(step, metrics):
        disk.fill()
        if disk.kind == "injected":  # the next line of train.log fails
            monkeypatch.setattr(ctl.run_log.handler.stream, "write",
                                lambda s: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        # a message longer than a page (a reward's traceback, say): more than the file's slack
        logging.getLogger("tidal").warning("a long message %s", "y" * 9000)
    _wrap(monkeypatch, ctl.metrics, "log", before)
    return "train.log"


def _fill_before_events(disk, monkeypatch, ctl):
    import tidal.runtime.health as health_module  # the step's health checks write events.jsonl

    real = getattr(health_module, "append_lines", None)

    def append(path, lines):
        if path.name == "events.jsonl":
            disk.fill()
            disk.fail(path)
        return real(path, lines)
    if disk.kind == "injected":
        monkeypatch.setattr(health_module, "append_lines", append)
    else:
        _wrap(monkeypatch, ctl.health, "watch", lambda *a: disk.fill())
    # an alert fires at this step (a long message: more than the file's slack), so events.jsonl is written
    monkeypatch.setattr(ctl.health.alerts, "update", lambda step, *a: [AlertEvent("kl_spike", step, "k" * 9000, 1.0, 0.5)])
    return "events.jsonl"


def _fill_before_hacking_events(disk, monkeypatch, ctl):
    import tidal.runtime.health as health_module  # the step's monitors write hacking_events.jsonl

    real = health_module.append_lines

    def append(path, lines):
        if path.name == "hacking_events.jsonl":
            disk.fill()
            disk.fail(path)
        return real(path, lines)
    monkeypatch.setattr(health_module, "append_lines", append)
    # a monitor fires at this step, with a message longer than a page (more than the file's slack)
    event = HackingEvent("length_correlation", 3, "h" * 9000, [], 0.9, 0.5)
    monkeypatch.setattr(ctl.health.monitor, "update", lambda step, *a: [event])
    return "hacking_events.jsonl"


def _fill_before_tensorboard(disk, monkeypatch, ctl):
    # TensorBoard's writer thread meets the full disk; its error comes back at the sink's flush.
    sink = next(s for s in ctl.metrics.sinks if s.name == "tensorboard")

    def before(step, metrics):
        disk.fill()
        if disk.kind == "injected":  # what TensorBoard's writer thread hands back: an OSError without a file name
            monkeypatch.setattr(sink.writer, "flush",
                                lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        metrics.update({f"pad/{i}": float(i) for i in range(600)})  # more than the event file's slack
    _wrap(monkeypatch, sink, "log", before)
    return "tensorboard"


def _fill_before_trace(disk, monkeypatch, ctl):
    import tidal.monitor.trace as trace_module

    real = trace_module.append

    def append(path, events):
        disk.fill()
        disk.fail(path)
        return real(path, [*events, {"name": "pad", "ph": "i", "ts": 0, "pid": 0, "tid": 0, "args": {"p": "z" * 9000}}])
    monkeypatch.setattr(trace_module, "append", append)
    return "trace.jsonl"


WRITES = {"optimizer_state": _fill_before_torch_save, "metrics_jsonl": _fill_before_metrics,
          "episodes": _fill_before_episodes, "train_log": _fill_before_train_log, "events_jsonl": _fill_before_events,
          "hacking_events_jsonl": _fill_before_hacking_events, "tensorboard": _fill_before_tensorboard,
          "trace_jsonl": _fill_before_trace}
FAST = {"optimizer_state", "metrics_jsonl"}  # in `make test`; the others are slow (~8 s each here)


@pytest.mark.parametrize("write", [w if w in FAST else pytest.param(w, marks=pytest.mark.slow) for w in WRITES])
def test_a_full_disk_at_each_write_stops_the_run_cleanly_and_the_resume_finishes_it(disk, tiny_model_dir, write,
                                                                                     monkeypatch, capfd):
    run = disk.path / "run"
    overrides = [f"model.path={tiny_model_dir}", f"run.dir={run}", *SMALL]
    if write == "trace_jsonl":
        overrides.append("run.trace=true")
    if write == "tensorboard":
        pytest.importorskip("tensorboard")
        overrides.append("run.loggers=[console,jsonl,tensorboard]")
    ctl = Controller(load_config(None, overrides))
    try:
        ctl.train_step()
        ctl.train_step()
        with monkeypatch.context() as mp:
            target = WRITES[write](disk, mp, ctl)
            with pytest.raises(RunFailed) as stopped:
                ctl.train_step()
    finally:
        ctl.close()
    message = str(stopped.value)
    why = f"({disk.kind} disk) {message}"
    # The trace is appended after the step's checkpoint: that step is saved whole before it.
    good = 3 if write == "trace_jsonl" else 2
    assert type(stopped.value).__name__ == "DiskError", why
    assert message.startswith("step 3: ") and target in message, why
    assert "No space left on device" in message or "torch.save wrote short" in message, why
    last = run / "checkpoints" / f"step_{good:06d}"
    assert f"the last good checkpoint is {last}" in message and "--resume" in message, why
    assert "Logging error" not in capfd.readouterr().err, why  # one message, not a traceback per log line
    # Nothing of step 3 half written: no partial checkpoint, no torn line, no episode file of it
    # unless the step's episodes were whole before its checkpoint failed.
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == [f"step_{s:06d}" for s in (good - 1, good)], why
    assert not list((run / "checkpoints").glob("*.tmp")), why
    assert damage(last) is None and latest_good(run / "checkpoints") == last, why
    for name in ("metrics.jsonl", "events.jsonl", "hacking_events.jsonl", "trace.jsonl"):
        _jsonl(run / name)  # every line whole
    assert not list((run / "episodes").glob(".*.tmp")), why
    episode_steps = sorted(p.name for p in (run / "episodes").glob("step_*.parquet"))
    assert episode_steps[:2] == ["step_000001.parquet", "step_000002.parquet"], why
    # Room again: the resume continues from the last good step and trains the rest once each.
    disk.free_up()
    resumed = Controller(load_config(None, overrides), resume=True)
    try:
        assert resumed.step == good
        resumed.train()
    finally:
        resumed.close()
    assert [m["step"] for m in _jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4], why
    assert len(_jsonl(run / "resumes.jsonl")) == 1, why
    for s in (1, 2, 3, 4):
        ids = pq.read_table(run / "episodes" / f"step_{s:06d}.parquet", columns=["episode_id"]).column(0).to_pylist()
        assert len(ids) == len(set(ids)) == 4, (s, ids, why)


def test_a_full_disk_during_a_checkpoint_stops_the_run_with_the_last_good_one_intact(disk, tiny_model_dir):
    run = disk.path / "run"
    overrides = [f"model.path={tiny_model_dir}", f"run.dir={run}", *SMALL]
    ctl = Controller(load_config(None, overrides))
    try:
        ctl.train_step()
        ctl.train_step()
        if disk.kind == "tmpfs":
            size = sum(f.stat().st_size for f in ctl.paths.checkpoint(2).rglob("*") if f.is_file())
            free = shutil.disk_usage(disk.path).free
            # Leave room for the step's metrics and episodes, not for a checkpoint (measured: size ~ 1.3 MB).
            (disk.path / "filler").write_bytes(b"\0" * max(0, free - size // 4))
        else:
            disk.full = True
            real = ctl.trainer.save
            ctl.trainer.save = lambda path, *a, **kw: (disk.fail(path / "model" / "model.safetensors"), real(path))
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
    disk.free_up()
    resumed = Controller(load_config(None, overrides), resume=True)
    try:
        assert resumed.step == 2
        resumed.train()
    finally:
        resumed.close()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow  # two short runs, ~11 s here
def test_a_full_disk_at_start_up_stops_with_exit_3_naming_the_file_and_a_new_start_works(disk, tiny_model_dir,
                                                                                          monkeypatch, capsys):
    """The first writes of a run (its lock, config.yaml, train.log): exit 3 naming the file, and
    nothing left that stops a fresh start once there is room (no half-written config, the lock free)."""
    import tidal.runtime.controller as controller_module

    run = disk.path / "run"
    args = ["train", f"model.path={tiny_model_dir}", f"run.dir={run}", *SMALL]
    disk.fill()
    if disk.kind == "injected":  # config.yaml, the first file of the run's own
        real = controller_module.write_atomic
        monkeypatch.setattr(controller_module, "write_atomic", lambda path, text: (disk.fail(path), real(path, text)))
    assert main(args) == 3
    err = capsys.readouterr().err
    why = f"({disk.kind} disk) {err}"
    assert f"could not write {run}/" in err and "No space left on device" in err and "nothing was trained" in err, why
    assert not (run / "config.yaml").exists() and not list(run.glob(".*.tmp")), why
    disk.free_up()
    assert main(args) == 0, capsys.readouterr().err
    assert [m["step"] for m in _jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow  # a run and two resumes, ~11 s here
def test_a_full_disk_at_the_resume_record_stops_cleanly_and_the_next_resume_counts_once(disk, tiny_model_dir,
                                                                                         monkeypatch, capsys):
    """resumes.jsonl, written once a resume has started: exit 3 naming it, the roles closed and the
    lock released (the next resume in this process takes it), no line for the failed attempt."""
    import tidal.runtime.controller as controller_module

    run = disk.path / "run"
    args = ["train", f"model.path={tiny_model_dir}", f"run.dir={run}", *SMALL]
    assert main([*args, "train.steps=2"]) == 0
    real = controller_module.append_lines

    def append(path, lines):
        if path.name == "resumes.jsonl":
            disk.fill()
            disk.fail(path)
        return real(path, lines)
    with monkeypatch.context() as mp:
        mp.setattr(controller_module, "append_lines", append)
        assert main([*args, "--resume"]) == 3
    err = capsys.readouterr().err
    why = f"({disk.kind} disk) {err}"
    assert f"{run}/resumes.jsonl" in err and "No space left on device" in err, why
    assert _jsonl(run / "resumes.jsonl") == [], why
    disk.free_up()
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    assert [m["step"] for m in _jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4], why
    assert len(_jsonl(run / "resumes.jsonl")) == 1, why
