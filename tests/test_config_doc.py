"""`tidal config` and docs/config.md: every key of the config with its type, default and
description, from the models themselves (tidal/config/doc.py); "did you mean" for unknown keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from tidal.cli import main as cli_main
from tidal.config import ConfigError, RolloutConfig, TidalConfig, load_config
from tidal.config import doc as config_doc
from tidal.config.resume import _flat

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_what_the_models_say():
    assert DOC.read_text() == config_doc.render_markdown(), \
        "docs/config.md is stale: regenerate it with `tidal config --markdown > docs/config.md`"


def test_a_key_added_without_regenerating_is_caught(monkeypatch):
    """Positive control of the test above: a new field of a section changes the page."""
    before = config_doc.render_markdown()

    class Wider(RolloutConfig):
        new_knob: int = Field(3, description="A key someone added.")

    monkeypatch.setitem(TidalConfig.model_fields, "rollout", TidalConfig.model_fields["rollout"]._copy())
    TidalConfig.model_fields["rollout"].annotation = Wider
    after = config_doc.render_markdown()
    assert after != before and "| `rollout.new_knob` | int | `3` | A key someone added. |" in after


def test_every_value_of_the_config_is_listed_with_a_description():
    listed = {d.key: d for d in config_doc.key_docs()}
    # every leaf of a dumped default config (lists of sections are empty there: their keys are `[]` ones)
    for key in _flat(TidalConfig().model_dump(mode="json")):
        assert key in listed, key
        assert listed[key].description, f"{key} has no description"
    assert listed["train.steps"].type == "int" and listed["train.steps"].default == "60"
    assert listed["model.dtype"].type == 'one of "float32", "bfloat16", "float16"'
    assert listed["task.rewards[].fn"].default == "required"
    assert listed["run.dir"].type == "str or null" and listed["run.dir"].default == "null"


def test_tidal_config_prints_a_section_and_names_an_unknown_one(capsys):
    assert cli_main(["config", "train.lora"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[train.lora]") and "train.lora.rank: int = 0" in out and "train.steps" not in out
    assert cli_main(["config", "rolout"]) == 2
    assert "no config key or section `rolout` (did you mean `rollout`?)" in capsys.readouterr().err
    assert cli_main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == DOC.read_text()


@pytest.mark.parametrize(("overrides", "hint"), [
    (["train.stpes=3"], "`train.stpes`: unknown key (did you mean `train.steps`?)"),
    (["trian.steps=3"], "`trian`: unknown key (did you mean `train`?)"),
    (["train.lora.rnak=4"], "`train.lora.rnak`: unknown key (did you mean `train.lora.rank`?)"),
    (["task.rewards=[{fn: 'a:b', wieght: 2}]"], "`task.rewards.0.wieght`: unknown key (did you mean `task.rewards.0.weight`?)"),
    # the right name in the wrong section, rather than a near spelling of this one (run.log_samples_every)
    (["run.samples_per_prompt=4"], "`run.samples_per_prompt`: unknown key (did you mean `rollout.samples_per_prompt`?)"),
])
def test_an_unknown_key_gets_the_closest_known_one(overrides, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert hint in str(e.value)


def test_an_unknown_key_in_a_file_gets_one_too(tmp_path):
    (tmp_path / "a.yaml").write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "a.yaml")
    assert "`rollout.temprature`: unknown key (did you mean `rollout.temperature`?)" in str(e.value)
    with pytest.raises(ConfigError) as e:  # nothing close: no guess
        load_config(None, ["rollout.zzzz=1"])
    assert "unknown key (`tidal config` lists every key)" in str(e.value)
