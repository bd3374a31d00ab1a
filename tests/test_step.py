"""The step's structure: at k=0 `train()` is `train_step()` in a plain loop on the calling thread
(no producer thread, no queue), and a step runs its learning stages in their order; at k>0 a
producer thread rolls out ahead (the positive control of how the threads are watched)."""

from __future__ import annotations

import threading

from tidal.config import load_config
from tidal.runtime.controller import Controller

STAGES = ["prepare", "update", "publish", "observe", "health", "checkpoint"]


def _cfg(model_dir, run_dir, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"run.dir={run_dir}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6", "task.train_size=32", "task.eval_size=4", "run.progress=false", "run.eval_every=0",
        "run.save_every=0", "train.steps=2", *extra])


def _watch(ctl: Controller):
    """Record the thread of each call of `_produce` and of each learning stage, the stage order,
    and the names of the threads alive meanwhile."""
    seen: dict[str, list] = {"produce": [], "order": [], "threads": set()}

    def wrap(name, fn, key="order"):
        def call(*args, **kwargs):
            seen[key].append(name if key == "order" else threading.current_thread())
            seen["threads"].update(t.name for t in threading.enumerate())
            return fn(*args, **kwargs)
        return call

    ctl._produce = wrap("produce", ctl._produce, key="produce")
    for name, owner, attr in [("prepare", ctl, "_prepare"), ("update", ctl, "_update"), ("publish", ctl, "_publish"),
                              ("observe", ctl, "_observe"), ("health", ctl.health, "enforce"),
                              ("checkpoint", ctl, "_checkpoint")]:
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    return seen


def test_k0_trains_on_the_calling_thread_in_stage_order(tiny_model_dir, tmp_path):
    ctl = Controller(_cfg(tiny_model_dir, tmp_path / "run"))
    seen = _watch(ctl)
    try:
        ctl.train()
    finally:
        ctl.close()
    assert seen["order"] == STAGES * 2
    assert seen["produce"] == [threading.main_thread()] * 2  # the rollout runs on the calling thread
    assert "tidal-rollout" not in seen["threads"]  # no producer thread at k=0


def test_k1_rolls_out_on_a_producer_thread(tiny_model_dir, tmp_path):
    ctl = Controller(_cfg(tiny_model_dir, tmp_path / "run", "rollout.max_staleness=1"))
    seen = _watch(ctl)
    try:
        ctl.train()
    finally:
        ctl.close()
    assert seen["order"] == STAGES * 2
    assert [t.name for t in seen["produce"]] == ["tidal-rollout"] * 2
