"""An asynchronous run (rollout.max_staleness = k) stopped right after a checkpoint and resumed
trains exactly what the uninterrupted run trained: every metric and every episode's tokens,
log-probs and per-token versions, at k=1 and k=2. The steps the rollout had generated ahead
of the learner are kept with the checkpoint (tidal/runtime/inflight.py); regenerating them
on resume used fresher weights (staleness 0 where the uninterrupted run had k), and every
metric after the resume differed. A partial rollout (a weight update that landed between two
decode steps of the step ahead) is kept whole too."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tidal.config import load_config
from tidal.runtime.controller import Controller

VOLATILE = ("time/", "tokens_per_s", "generated_tokens_per_s")
PER_STEP = 4  # optimizer steps (weight versions) per training step: 2 mini-batches x 2 epochs


def config(run: Path, steps: int, k: int, *extra: str):
    # Short generations and long training (4 updates a step): the rollout thread is always
    # as far ahead as the bound lets it (checked below), so the uninterrupted run repeats.
    return load_config(overrides=[
        f"run.dir={run}", f"train.steps={steps}", f"rollout.max_staleness={k}", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "train.mini_batches=2", "train.epochs=2",
        "algorithm.is_level=token", "task.train_size=64", "task.eval_size=8", "run.eval_every=0",
        "run.progress=false", "run.save_every=1", "run.keep_checkpoints=10", "run.threads=1", *extra])


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def episodes(run: Path, step: int) -> list[dict]:
    rows = pq.read_table(run / "episodes" / f"step_{step:06d}.parquet").to_pylist()
    return sorted(rows, key=lambda r: r["episode_id"])


def same_episodes(a: Path, b: Path, step: int) -> None:
    ea, eb = episodes(a, step), episodes(b, step)
    assert [e["episode_id"] for e in ea] == [e["episode_id"] for e in eb], step
    for x, y in zip(ea, eb):
        for key in ("tokens", "loss_mask", "logprobs", "versions", "reward"):
            assert x[key] == y[key], (step, x["episode_id"], key)


def lags(run: Path, step: int) -> set[int]:
    out = set()
    for e in episodes(run, step):
        out |= {((step - 1) * PER_STEP - v) // PER_STEP for v, m in zip(e["versions"], e["loss_mask"]) if m}
    return out


@pytest.mark.slow  # a run of 6 steps and a resume of 3 in this process (~20 s each here)
@pytest.mark.parametrize("k", [1, 2])
def test_async_resume_trains_what_the_uninterrupted_run_trained(tmp_path, k):
    full, cut = tmp_path / "full", tmp_path / "cut"
    ctl = Controller(config(full, 6, k))
    ctl.train()
    ctl.close()
    # The run directory as a driver killed right after checkpoint 3 leaves it (steps 4.. were
    # being rolled out), resumed: every step after it must be the uninterrupted run's.
    _cut_copy(full, cut, 3)
    ctl = Controller(config(cut, 6, k), resume=True)
    ctl.train()
    ctl.close()
    # The precondition of runs that repeat: every step after the cut rolled out with the
    # weights k steps old (the rollout thread as far ahead as allowed; the first steps of a run
    # may not be: at k=2 step 3 waits on step 1's learning). A loaded machine can break it (a
    # weight update landing mid-rollout): then this says so rather than a diff. (The resumed
    # run is held to it by the comparison below: main's resume rolled step 4 out at staleness 0.)
    regime = {s: lags(full, s) for s in range(4, 7)}
    assert all(v == {k} for v in regime.values()), f"the rollout did not run {k} ahead (load?): {regime}"
    assert [m["step"] for m in metrics(cut)] == list(range(1, 7))
    for a, b in zip(metrics(full)[3:], metrics(cut)[3:]):
        assert a == b, {key: (a[key], b.get(key)) for key in a if a[key] != b.get(key)}
    for step in range(4, 7):
        same_episodes(full, cut, step)
    assert (cut / "checkpoints" / "step_000003" / "ahead.pkl").is_file()  # where the steps ahead were kept


def _slow_engine(ctl: Controller, delay_s: float) -> None:
    """Each decode step of the engine sleeps: weight updates land between decode steps."""
    engine = ctl.engine
    real = engine._step

    def step(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    engine._step = step


def _cut_copy(full: Path, cut: Path, step: int) -> None:
    """The run directory as the run left it when it died right after checkpoint `step`."""
    cut.mkdir()
    shutil.copy(full / "config.yaml", cut / "config.yaml")
    (cut / "checkpoints").mkdir()
    for s in range(1, step + 1):
        src = full / "checkpoints" / f"step_{s:06d}"
        if src.is_dir():
            shutil.copytree(src, cut / "checkpoints" / src.name)
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))
    (cut / "episodes").mkdir()
    for s in range(1, step + 1):
        shutil.copy(full / "episodes" / f"step_{s:06d}.parquet", cut / "episodes")


@pytest.mark.slow  # one slowed run and a short resume (~40 s here)
def test_a_partial_rollout_in_flight_at_the_checkpoint_is_resumed_whole(tmp_path):
    k = 1
    full = tmp_path / "full"
    extra = ["train.mini_batches=1", "train.epochs=1", "rollout.max_new_tokens=24",
             "engine.partial_rollout=true"]
    ctl = Controller(config(full, 6, k, *extra))
    _slow_engine(ctl, 0.02)  # generation outlasts a training step: the update lands mid-generation
    ctl.train()
    ctl.close()
    mixed = [s for s in range(2, 6) if any(len({v for v, m in zip(e["versions"], e["loss_mask"]) if m}) > 1
                                           for e in episodes(full, s))]
    assert mixed, "no weight update landed mid-generation: partial rollouts were not exercised"
    step = mixed[0] - 1  # its checkpoint kept that step, in flight, ahead
    cut = tmp_path / "cut"
    _cut_copy(full, cut, step)
    ctl = Controller(config(cut, step + k, k, *extra), resume=True)
    ctl.train()  # the restored step only: nothing is generated
    ctl.close()
    got, want = metrics(cut)[-1], metrics(full)[step + k - 1]
    assert got["step"] == want["step"] == step + 1
    assert got == want, {key: (want[key], got.get(key)) for key in want if want[key] != got.get(key)}
    same_episodes(full, cut, step + 1)
