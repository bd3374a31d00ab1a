"""Loading a config: YAML files merged in order, then `a.b=c` overrides, validated as one; an
error names the key and, for an unknown one, the key most likely meant.

The choice: overrides are parsed as YAML values (`train.steps=5` is an int, `x=[a, b]` a list),
and files and overrides merge section by section before a single validation, so a check that
spans sections sees the final values.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tidal.config.tidal_config import TidalConfig


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override `{key}`: `{p}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override `{item}` is not of the form `section.key=value`")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    """` (did you mean `PREFIXx`?)` for the closest of `choices` to `word` (difflib's ratio, at
    least its default 0.6), or ""."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean `{prefix}{close[0]}`?)" if close else ""


def _section_model(ann: Any) -> Any:
    """The section model of a field's annotation (`Section` or `list[Section]`), or None."""
    if typing.get_origin(ann) is list and typing.get_args(ann):
        ann = typing.get_args(ann)[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def all_keys(model: Any = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config (`[]` for the items of a list of sections), sections too."""
    out = []
    for name, field in (model or TidalConfig).model_fields.items():
        out.append(prefix + name)
        sub = _section_model(field.annotation)
        if sub is not None:
            brackets = "[]" if typing.get_origin(field.annotation) is list else ""
            out += all_keys(sub, f"{prefix}{name}{brackets}.")
    return out


def section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section at `loc` (a validation error's location up to its last part; list
    indices included) accepts; [] when `loc` names no section."""
    model: Any = TidalConfig
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list of sections: its model was taken at the list
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        model = _section_model(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _explain(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            loc = tuple(err["loc"])
            prefix = "".join(f"{p}." for p in loc[:-1])
            # the right name in the wrong section first (`run.samples_per_prompt`), then a near spelling
            same = [k for k in all_keys() if k.rsplit(".", 1)[-1] == str(loc[-1])] if loc else []
            hint = f" (did you mean `{same[0]}`?)" if len(same) == 1 else \
                did_you_mean(str(loc[-1]), section_keys(loc[:-1]), prefix) if loc else ""
            lines.append(f"`{key}`: unknown key{hint} (`tidal config` lists every key)")
        else:
            got = err.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"`{key}`: {err['msg']}{got_s}")
    return f"invalid config ({source}):\n  " + "\n  ".join(lines)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file `{path}` does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file `{path}` is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file `{path}` must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None) -> TidalConfig:
    """Defaults ← YAML file(s) ← overrides, validated as one. Several files merge in order, a
    later file's keys winning over an earlier one's, section by section (a mapping merges into
    a mapping; any other value, a list included, replaces)."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for p in paths:
        data = _merge(data, _read_yaml(p))
    source = " + ".join(str(p) for p in paths) or "defaults"
    if overrides:
        data = _merge(data, parse_overrides(overrides))
        source += " + overrides"
    try:
        return TidalConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None
