"""What stopped a new user, each now with a way on: a run stopped before its first checkpoint
resumes (from its start, as an uninterrupted run would have gone); `--overwrite` starts a new run
in an earlier run's directory, naming what it deletes, and refuses a directory that is not a
run's; several config files merge in order."""

from __future__ import annotations

import json

from tidal.cli import main
from tidal.config import load_config
from tidal.monitor.run_status import run_status
from tidal.runtime.controller import Controller

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
         "task.train_size=32", "task.eval_size=8", "run.progress=false", "run.eval_every=0"]


def _steps(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(model, run, *extra):
    return main(["train", f"model.path={model}", f"run.dir={run}", *SMALL, *extra])


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_its_start(tiny_model_dir, tmp_path, capsys):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _train(tiny_model_dir, full, "train.steps=2", "run.save_every=0") == 0
    # the same run stopped after its first step, before any checkpoint (run.save_every=0 saves at the end)
    ctl = Controller(load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={cut}", *SMALL, "train.steps=2",
                                        "run.save_every=0"]))
    try:
        ctl.train_step()
        assert run_status(cut)["state"] == "running"  # what the dashboard shows (tidal/monitor/run_status.py)
    finally:
        ctl.close()
    assert [m["step"] for m in _steps(cut)] == [1] and not list((cut / "checkpoints").glob("step_*"))
    capsys.readouterr()
    assert main(["train", "--resume", f"run.dir={cut}"]) == 0
    err = capsys.readouterr().err
    assert "from the start (it stopped before its first checkpoint) (step 0 of train.steps=2)" in err
    assert (run_status(cut)["state"], run_status(cut)["exit_code"]) == ("finished", 0)
    a, b = _steps(full), _steps(cut)
    assert [m["step"] for m in b] == [1, 2]  # the earlier attempt's step 1 was replaced, not kept twice
    drop = ("time/", "wall", "throughput", "tokens_per_s", "mem/")  # clocks and memory differ between runs
    same = [{k: v for k, v in m.items() if not k.startswith(drop) and "_s" not in k} for m in a]
    assert same == [{k: v for k, v in m.items() if not k.startswith(drop) and "_s" not in k} for m in b]


def test_overwrite_starts_again_and_names_what_it_deletes(tiny_model_dir, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    assert _train(tiny_model_dir, run, "train.steps=2", "run.save_every=1") == 0
    assert (run / "episodes" / "step_000002.parquet").is_file()
    capsys.readouterr()
    assert _train(tiny_model_dir, run, "train.steps=1") == 2  # refused, offering the ways on
    err = capsys.readouterr().err
    assert "already holds a run: pass --resume to continue it, --overwrite to delete it and start again" in err
    assert _train(tiny_model_dir, run, "train.steps=1", "--overwrite") == 0
    assert "--overwrite: removed the earlier run in" in caplog.text
    assert "checkpoints/ (" in caplog.text and "metrics.jsonl" in caplog.text
    assert [m["step"] for m in _steps(run)] == [1]
    assert not (run / "episodes" / "step_000002.parquet").exists()  # nothing of the earlier run is left
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000001"]
    assert (run_status(run)["state"], run_status(run)["exit_code"]) == ("finished", 0)
    assert _train(tiny_model_dir, run, "--overwrite", "--resume") == 2
    assert "give one of them" in capsys.readouterr().err


def test_overwrite_refuses_a_directory_that_is_not_a_run(tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("months of work")
    (other / "metrics.jsonl").write_text("")  # looks like a run to the plain check, but has no config.yaml
    assert _train(tiny_model_dir, other, "train.steps=1", "--overwrite") == 2
    assert "is not a run directory (it holds no config.yaml" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "months of work"


def test_several_config_files_merge_in_order(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("train:\n  steps: 7\n  lr: 0.001\nrollout:\n  samples_per_prompt: 4\n")
    b.write_text("train:\n  steps: 9\nrun:\n  name: b\n")
    cfg = load_config([a, b], ["rollout.samples_per_prompt=2"])
    assert (cfg.train.steps, cfg.train.lr, cfg.run.name) == (9, 0.001, "b")  # b wins; a's other keys stay
    assert cfg.rollout.samples_per_prompt == 2  # overrides come last
    assert load_config([b, a]).train.steps == 7
    # the command line takes several files: an error in the second names both, in order
    (tmp_path / "c.yaml").write_text("train:\n  stpes: 3\n")
    assert main(["train", str(a), str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"invalid config ({a} + {tmp_path / 'c.yaml'})" in err and "did you mean `train.steps`" in err


def test_what_is_neither_a_file_nor_an_override_is_named(capsys):
    assert main(["train", "notes.txt"]) == 2
    assert "unexpected argument `notes.txt`: expected YAML config files or `section.key=value`" in capsys.readouterr().err


def test_overwrite_never_clears_a_live_runs_directory(tiny_model_dir, tmp_path, capsys):
    from tidal.runtime.run_lock import RunLock

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  steps: 9\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    live = RunLock(run)
    live.acquire()  # as a running run holds it
    try:
        assert _train(tiny_model_dir, run, "train.steps=1", "--overwrite") == 2
    finally:
        live.release()
    assert "is in use by another run" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and (run / "config.yaml").is_file()
