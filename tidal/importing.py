"""Import a user's object named in config: a dotted path `pkg.module:attr` (or
`pkg.module.attr`) or a file path `path/to/file.py:attr`, with errors that say what failed.

A file is imported as a module of its own (named after its resolved path, so two files
called `envs.py` do not collide), once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

# Adapters of other environment standards (tidal/envs/adapters/), each an optional extra:
# config prefix -> (the key it appears in, the import name, the extra that installs it)
EXTRAS = {
    "reasoning_gym:": ("task.dataset", "reasoning_gym", "reasoning-gym"),
    "verifiers:": ("task.env", "verifiers", "verifiers"),
    "textarena:": ("task.env", "textarena", "textarena"),
    "openenv:": ("task.env", "websockets", "openenv"),  # tidal speaks its protocol; the server has openenv
}


def adapter_of(value: str | None) -> str | None:
    """The prefix of `EXTRAS` that `value` starts with, or None."""
    if not isinstance(value, str):
        return None
    return next((p for p in EXTRAS if value.startswith(p)), None)


def check_extra(key: str, value: str | None) -> None:
    """Raise ValueError naming `key` and the pip command when `value` needs an extra that is not
    installed (or names an adapter in the wrong key)."""
    prefix = adapter_of(value)
    if prefix is None:
        return
    want_key, module, extra = EXTRAS[prefix]
    if key != want_key:
        raise ValueError(f"`{key}: {value}`: `{prefix}` names a {want_key} (set `{want_key}: {value}`)")
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"`{key}: {value}` needs the `{module}` package: pip install 'tidal[{extra}]'")


def import_object(path: str, key: str = "") -> Any:
    """The object `path` names. `key` (e.g. `task.env`) is named in the error."""
    where = f"`{key}`: " if key else ""
    target, sep, attr = path.rpartition(":")
    if not sep:
        target, _, attr = path.rpartition(".")
    if not target or not attr:
        raise ValueError(f"{where}`{path}` is not of the form `my_pkg.module:name` or `path/to/file.py:name`")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(target, where, path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"{where}cannot import module `{target}` of `{path}`: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{where}module `{target}` has no attribute `{attr}` (from `{path}`)") from None


def _import_file(target: str, where: str, path: str):
    file = Path(target).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"{where}file `{target}` of `{path}` does not exist (relative paths start at {Path.cwd()})")
    name = f"tidal_user_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{where}cannot import `{file}` as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{where}importing `{file}` raised {type(e).__name__}({e})") from e
    return module
