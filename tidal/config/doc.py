"""Every config key with its type, default and description, read from the pydantic models of
this package: `tidal config` prints it, docs/config.md is it as Markdown, and "did you mean"
suggestions for an unknown key come from the same walk.

The choice: the models are the only source. docs/config.md is generated from them (`tidal config
--markdown > docs/config.md`) and tests/test_config_doc.py fails when it differs from what the
models say, so a key added without regenerating the page is caught, not forgotten.
"""

from __future__ import annotations

import json
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tidal.config.load import did_you_mean
from tidal.config.tidal_config import TidalConfig


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, as an override names it; `[]` marks the items of a list of sections
    type: str
    default: str
    description: str
    section: bool = False  # a section (its keys follow), not a value


def _model_of(ann: Any) -> type[BaseModel] | None:
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _item_model(ann: Any) -> type[BaseModel] | None:
    """The section type of a `list[Section]` field."""
    return _model_of(get_args(ann)[0]) if get_origin(ann) is list and get_args(ann) else None


def type_name(ann: Any) -> str:
    """A reader's name for an annotation: `int`, `str or null`, `one of "a", "b"`, `list[str]`."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    if ann is Any:
        return "any"
    return getattr(ann, "__name__", str(ann))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def key_docs(model: type[BaseModel] = TidalConfig, prefix: str = "") -> Iterator[KeyDoc]:
    """Every key of `model` in the models' own order, a section's values before its sections."""
    fields = list(model.model_fields.items())
    for name, field in sorted(fields, key=lambda nf: _model_of(nf[1].annotation) is not None):
        key, ann = prefix + name, field.annotation
        sub, item = _model_of(ann), _item_model(ann)
        description = " ".join((field.description or (sub.__doc__ if sub else "") or "").split())
        if sub is not None:
            yield KeyDoc(key, "section", "", description, section=True)
            yield from key_docs(sub, key + ".")
        elif item is not None:
            yield KeyDoc(key, f"list[{item.__name__}]", _default(field), description)
            yield from key_docs(item, key + "[].")
        else:
            yield KeyDoc(key, type_name(ann), _default(field), description)


def select(prefixes: list[str]) -> list[KeyDoc]:
    """The keys under any of `prefixes` (a section or a key); a ValueError for one that names nothing."""
    docs = list(key_docs())
    if not prefixes:
        return docs
    out = []
    for p in prefixes:
        p = p.rstrip(".")
        hit = [d for d in docs if d.key == p or d.key.startswith(p + ".") or d.key.startswith(p + "[]")]
        if not hit:
            raise ValueError(f"no config key or section `{p}`{did_you_mean(p, [d.key for d in docs])}")
        out += [d for d in hit if d not in out]
    return out


def render_text(docs: list[KeyDoc], width: int = 100) -> str:
    lines = []
    for d in docs:
        if d.section:
            lines += ["", f"[{d.key}]"] + ([textwrap.fill(d.description, width, initial_indent="    ",
                                                        subsequent_indent="    ")] if d.description else [])
            continue
        lines.append(f"{d.key}: {d.type} = {d.default}")
        if d.description:
            lines.append(textwrap.fill(d.description, width, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines).lstrip("\n") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """docs/config.md."""
    out = ["# Configuration reference", "",
           "Every key of a tidal config, with its type, default and description. Generated from the pydantic",
           "models of `tidal/config/` by `tidal config --markdown > docs/config.md` (do not edit by hand;",
           "tests/test_config_doc.py fails when this page and the models differ). `tidal config [SECTION]`",
           "prints the same in the terminal.", "",
           "A key is set in a YAML file (`section:` then `key: value`) or on the command line as",
           "`section.key=value`; several YAML files are merged in order, later files winning, and",
           "overrides come last (`tidal train base.yaml small.yaml train.steps=5`). `[]` marks the keys",
           "of each item of a list of sections (`task.rewards`)."]
    header = "| key | type | default | description |\n|---|---|---|---|"
    for d in key_docs():
        top = "." not in d.key
        if d.section:
            out += ["", f"{'##' if top else '###'} `{d.key}`", ""]
            if d.description:
                out += [d.description, ""]
            out.append(header)
            continue
        out.append(f"| `{d.key}` | {_cell(d.type)} | `{_cell(d.default)}` | {_cell(d.description)} |")
    return "\n".join(out) + "\n"


