"""Config loading: defaults, YAML, overrides, and errors that name the key."""

from pathlib import Path

import pytest
import yaml

from tidal.config import ConfigError, TidalConfig, dump_config, load_config

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def test_defaults_validate():
    cfg = load_config()
    assert cfg == TidalConfig()
    assert cfg.mini_batch_size == cfg.rollout.global_batch // cfg.train.mini_batches


def test_overrides_apply():
    cfg = load_config(None, ["rollout.samples_per_prompt=4", "train.lr=0.01"])
    assert cfg.rollout.samples_per_prompt == 4
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert cfg.train.lr == pytest.approx(0.01)
    assert cfg.rollout.global_batch == cfg.rollout.prompts_per_step * 4


def test_override_beats_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": 0.5, "steps": 3}}))
    cfg = load_config(path, ["train.lr=0.25"])
    assert cfg.train.lr == pytest.approx(0.25)
    assert cfg.train.steps == 3


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("rollout: {sampels_per_prompt: 4}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "rollout.sampels_per_prompt" in str(e.value)
    assert "unknown key" in str(e.value)


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(None, ["train.lr=-1"])


@pytest.mark.parametrize("override", ["foo", "=3", "train..lr=1"])
def test_malformed_override_raises(override):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, [override])


def test_missing_config_file_is_named(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(path)


def test_mini_batches_must_divide_global_batch():
    # default global batch 32 × 8 = 256
    with pytest.raises(ConfigError, match=r"train\.mini_batches"):
        load_config(None, ["train.mini_batches=3"])
    assert load_config(None, ["train.mini_batches=4"]).mini_batch_size == 64


def test_bad_loss_agg_raises():
    with pytest.raises(ConfigError, match="loss_agg"):
        load_config(None, ["algorithm.loss_agg=mean"])


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_validate(path):
    load_config(path)


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["rollout.samples_per_prompt=4", "train.lr=0.01", "task.dataset=data/x.jsonl", "train.betas=[0.8, 0.9]"])
    path = tmp_path / "dump.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_default_example_is_the_default_job():
    """README: `tidal train` with no arguments runs examples/arith_grpo.yaml's settings."""
    example = Path(__file__).parent.parent / "examples" / "arith_grpo.yaml"
    assert load_config(example) == load_config(None)


def test_engine_settings_that_cannot_work_are_refused_at_validation():
    from tidal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="engine.replicas=2 with engine.vllm_mode=in_process"):
        load_config(None, ["engine.kind=vllm", "engine.replicas=2"])
    assert load_config(None, ["engine.kind=vllm", "engine.replicas=2", "engine.vllm_mode=server"]).engine.replicas == 2


def test_lora_settings_are_checked_and_nested_overrides_apply():
    cfg = load_config(None, ["train.lora.rank=16", "train.lora.targets=[q_proj,v_proj]"])
    assert cfg.train.lora.rank == 16 and cfg.train.lora.targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="train.lora.dropout"):
        load_config(None, ["train.lora.dropout=1.5"])


def test_the_arithmetic_settings_are_the_generated_tasks_env_args(tmp_path):
    """`task.arithmetic` (config files and run directories written before it moved) lands in
    task.env_args, where the generated task reads its problem distribution; a clash or a bad
    value is named with its key."""
    from tidal.runtime.tasks import build_task

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"task": {"arithmetic": {"min_digits": 3, "max_digits": 3, "ops": "+"}}}))
    old, new = load_config(path), load_config(None, ["task.env_args={min_digits: 3, max_digits: 3, ops: '+'}"])
    assert old.task.env_args == new.task.env_args == {"min_digits": 3, "max_digits": 3, "ops": "+"}
    rows = build_task(old.task).train_rows
    assert rows == build_task(new.task).train_rows
    assert all(len(a) == 3 and len(b) == 3 for a, b in (r["prompt"][0]["content"][8:-1].split(" + ") for r in rows[:50]))
    assert load_config(None, ["task.env=tool_arith", "task.arithmetic.max_digits=3"]).task.env_args == {}
    with pytest.raises(ConfigError, match=r"task.env_args.max_digits"):
        load_config(None, ["task.arithmetic.max_digits=3", "task.env_args.max_digits=4"])
    with pytest.raises(ConfigError, match=r"task.env_args.*min_digits"):
        build_task(load_config(None, ["task.env_args.min_digits=0"]).task)
