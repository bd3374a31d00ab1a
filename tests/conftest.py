"""Shared fixtures: a randomly initialised tiny model directory (seconds to build); two short
real runs of the default task for the dashboard's tests."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tidal.recipes.tiny import build_untrained

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return build_untrained(tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, heads=4, kv_heads=2)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`),
    restored after it: its matrices are tiny, and two threads on two cores that other processes share
    spin (a 64 x 64-token generate takes 30+ s with 2 threads instead of under 1 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from tidal.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tool_tokenizer():
    """The embedded tiny tool model's tokenizer (tidal/models/assets/tiny-tool)."""
    from tidal.models import TOOL_MODEL_DIR, load_tokenizer

    return load_tokenizer(TOOL_MODEL_DIR)


@pytest.fixture(scope="session")
def dashboard_runs(tmp_path_factory):
    """Two real runs of the default task that differ in learning rate and length (4 and 3
    steps, 8 prompts a step); the first evaluates at steps 0, 2 and 4, the second has an alert
    and a reward-hacking event in its files."""
    from tidal.config import load_config
    from tidal.runtime.controller import Controller

    tmp = tmp_path_factory.mktemp("dash")
    for name, extra in (("a", ["train.steps=4", "run.eval_every=2", "eval.n=16", "eval.at_start=true"]),
                        ("b", ["train.steps=3", "train.lr=1e-4"])):
        ctl = Controller(load_config(None, [f"run.dir={tmp / name}", "rollout.prompts_per_step=8",
                                            "run.progress=false", *extra]))
        try:
            ctl.train()
        finally:
            ctl.close()
    (tmp / "b" / "events.jsonl").write_text(json.dumps(
        {"kind": "alert", "alert": "kl_spike", "step": 2, "value": 0.5, "threshold": 0.1,
         "message": "kl 0.5 at step 2", "time": ""}) + "\n")
    (tmp / "b" / "hacking_events.jsonl").write_text(json.dumps(
        {"monitor": "part_dominance", "step": 3, "message": "format is 90% of the reward"}) + "\n")
    return tmp / "a", tmp / "b"
