"""Each environment standard is an optional extra (tidal/importing.py: EXTRAS): a config naming
one whose package is missing fails when it loads, naming the key and the pip command."""

from __future__ import annotations

import importlib.util

import pytest

from tidal.config import ConfigError, load_config


@pytest.mark.parametrize(("override", "module", "extra"), [
    ("task.dataset=reasoning_gym:chain_sum", "reasoning_gym", "reasoning-gym"),
    ("task.env=verifiers:my_env", "verifiers", "verifiers"),
    ("task.env=textarena:GuessTheNumber-v0", "textarena", "textarena"),
    ("task.env=openenv:http://127.0.0.1:8000", "websockets", "openenv"),
])
def test_a_missing_extra_is_named_with_its_pip_command(monkeypatch, override, module, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=rf"`{key}: {value}` needs the `{module}` package: pip install 'tidal\[{extra}\]'"):
        load_config(None, [override])


def test_an_adapter_in_the_wrong_key_is_named():
    with pytest.raises(ConfigError, match=r"`task.env: reasoning_gym:chain_sum`: `reasoning_gym:` names a task.dataset"):
        load_config(None, ["task.env=reasoning_gym:chain_sum"])
