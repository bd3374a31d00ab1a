"""RL through the browser environment: `tidal train examples/browser.yaml` for 2 steps with the
embedded tiny-browser model (torch engine, one process), and the warm-start builder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from browser_support import require_chromium

from tidal.envs.browser.pool import _descendants
from tidal.models import BROWSER_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _chromium():
    require_chromium()


def test_tidal_train_two_steps_in_the_browser(tmp_path):
    """The model's clicks reach Chromium, the pages' accessibility trees come back as masked
    observation tokens, the verifier's reward trains two steps; the turns, their tool calls and
    the browser metrics reach the Parquet store and metrics.jsonl, and no browser is left."""
    from tidal.config import load_config
    from tidal.envs import loop_scoped
    from tidal.models import load_tokenizer
    from tidal.runtime.controller import Controller

    cfg = load_config(ROOT / "examples" / "browser.yaml", [
        "train.steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "task.train_size=8",
        "task.eval_size=4", "eval.n=4", "run.eval_every=0", f"run.dir={tmp_path / 'run'}", "run.progress=false"])
    ctl = Controller(cfg)
    try:
        m = ctl.train()
    finally:
        ctl.close()
    assert m["episodes"] == 8
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_step = [r for r in metrics if "browser/actions" in r]
    assert [r["step"] for r in per_step] == [1, 2]
    assert all(r["browser/blocked_requests"] == 0 for r in per_step)
    tok = load_tokenizer(BROWSER_MODEL_DIR)
    rows = [r for s in (1, 2) for r in pq.read_table(tmp_path / "run" / "episodes" / f"step_{s:06d}.parquet").to_pylist()]
    clicks = 0
    for r in rows:
        assert r["env"] == "browser" and r["status"] in ("ok", "truncated"), (r["status"], r.get("error"))
        assert r["reward"] in (0.0, 1.0)
        for t in r["turns"]:
            assert all(r["loss_mask"][t["start"]:t["end"]]) and not any(r["loss_mask"][t["end"]:t["obs_end"]])
            assert tok.decode(r["tokens"][t["start"]:t["end"]], skip_special_tokens=True) == t["text"]
            for c in t["tool_calls"]:
                if c["status"] == "ok" and c["name"] == "click":
                    clicks += 1
                    # after a click on a submit button the observation is the page it led to
                    assert "Page: " in tok.decode(r["tokens"][t["end"]:t["obs_end"]])
    assert clicks >= 4  # the warm start clicks in nearly every sample
    # each step's loop closed its pool: no pool is left, no Chromium nor Playwright driver under this process
    assert not loop_scoped.OBJECTS
    assert not [p for p in _descendants(os.getpid()) if "chromium" in _cmdline(p) or "playwright" in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow  # two builds, each recording episodes in Chromium: ~40 s
def test_builder_is_deterministic_and_the_shipped_model_matches_its_defaults(tmp_path):
    """`tidal build-browser-model` on a small budget twice: the same demonstrations (recorded in
    Chromium, several episodes at once), tokenizer and weights; the shipped model's record has
    the builder's defaults, and its teacher's habits scored as designed."""
    import inspect

    from safetensors.torch import load_file

    from tidal.recipes.browser_model import DEFAULT_HABITS, build_browser_model, held_out_success

    def quick(model, tok, rows):
        return held_out_success(model, tok, rows[:2], k=1)

    kw = {"steps": 2, "batch_size": 4, "train_size": 24, "eval_n": 4, "concurrency": 4, "evaluate": quick,
          "per_episode": 2, "copy_steps": 2, "lookup_steps": 2}
    a, b = build_browser_model(tmp_path / "a", **kw), build_browser_model(tmp_path / "b", **kw)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert a["history"][0]["loss"] == b["history"][0]["loss"] and a["history"][0]["step"] == 2
    assert a["teacher_success"] == b["teacher_success"]
    shipped = json.loads((BROWSER_MODEL_DIR / "tidal_build.json").read_text())
    defaults = {k: p.default for k, p in inspect.signature(build_browser_model).parameters.items()}
    for key in ("seed", "steps", "batch_size", "lr", "train_size", "per_episode", "form"):
        assert shipped[key] == defaults[key], key
    assert {name: c["steps"] for name, c in shipped["curricula"].items()} == {
        "copy": defaults["copy_steps"], "lookup": defaults["lookup_steps"]}
    assert shipped["habits"] == DEFAULT_HABITS and shipped["threads"] == 2  # `tidal build-browser-model`'s default
    # the right habit always succeeds; clicking the first button does by chance (3-8 buttons)
    assert shipped["teacher_success"]["right"] == 1.0 and shipped["teacher_success"]["first"] < 0.35


@pytest.mark.slow  # records episodes in Chromium: ~20 s
def test_builder_on_a_small_budget_relabels_and_runs_both_curricula(tmp_path):
    """`per_episode`, `copy_steps`, `lookup_steps` and `form="quote"` on a small budget: every
    recorded episode has its relabelled copies, both curricula ran on the builder's own
    tokenizer, and the right habit's recorded turn, which names the line, clicks the button."""
    from tidal.recipes.browser_model import build_browser_model, held_out_success

    def quick(model, tok, rows):
        return held_out_success(model, tok, rows[:2], k=1)

    s = build_browser_model(tmp_path / "m", steps=2, batch_size=4, train_size=16, eval_n=4, concurrency=4,
                            evaluate=quick, per_episode=3, copy_steps=2, lookup_steps=2, form="quote",
                            habits={"right": 1.0})
    assert s["demonstrations"] == 3 * 12 and s["form"] == "quote"
    assert s["curricula"]["copy"]["steps"] == 2 and s["curricula"]["lookup"]["levels"] == 4
    assert s["teacher_success"] == {"right": 1.0}  # the quote form clicks the instructed button


@pytest.mark.slow  # 64 greedy episodes in Chromium: ~30 s
def test_the_shipped_model_clicks_the_instructed_button_on_held_out_pages():
    """The warm start points: on the held-out tasks `examples/browser.yaml` evaluates on, greedy
    decoding clicks the instructed button far more often than the page's first button is the
    target (the first models' ceiling); RL then has a habit to sharpen (docs/browser.md)."""
    import re

    from tidal.envs.browser.tasks import make_tasks
    from tidal.models import load_model, load_tokenizer
    from tidal.recipes.browser_model import FAMILIES, held_out_success, instructed_label

    rows = make_tasks("test", 64, seed=0, families=FAMILIES)
    first = sum(re.search(r"<button[^>]*>([^<]+)</button>", json.loads(r["pages"])["/"]).group(1) == instructed_label(r)
                for r in rows) / len(rows)
    res = held_out_success(load_model(BROWSER_MODEL_DIR), load_tokenizer(BROWSER_MODEL_DIR), rows, k=1)
    assert res["n"] == 64 and res["failed"] == 0
    # measured 0.609 (docs/browser.md); the bound leaves 10 of the 64 tasks to argmax ties that
    # another CPU's kernels may break otherwise, and is still 3× the first-button share (0.156)
    assert first < 0.2 and res["accuracy"] >= 0.45, (first, res)
