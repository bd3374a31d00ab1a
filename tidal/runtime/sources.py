"""A run directory that stands on its own: what a run's config names by a path is recorded so
that `tidal eval` and `tidal replay` of the run work from any directory and measure what the
run ran, after the files it named were edited, moved or deleted.

- `RUN/config.yaml` holds absolute paths (`absolute`): a model directory, a dataset, a file of
  code, the run's own directories, each resolved against the directory `tidal train` ran in.
- Every file of code the config names (an environment, reward, agent, loss, advantage estimator
  or engine builder given as `path/to/file.py:name`; CODE_KEYS) is copied into `RUN/sources/`,
  its SHA-256 and original path in `RUN/sources.json` (`keep_sources`).
- `tidal eval` of a run's checkpoint and `tidal replay` import those copies (`use_kept`) and say
  (a warning) when the original file has changed since, or is gone. A resume goes on with the
  file as it is now (a resume is how a fix to a reward reaches a run) and says so when it differs
  from the copy. The dashboard's config diff shows each copy's hash (`sources.<key>`), so two
  runs of one path but other code differ there.

The choice: only the named file is copied, not what it imports (a module beside it, a package);
those are code of their own, named in the log of the run that imported them. Datasets and
models are not copied (they can be large): their paths are made absolute only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from tidal.config import TidalConfig
from tidal.importing import adapter_of

log = logging.getLogger("tidal")

SOURCES_DIR, SOURCES_FILE = "sources", "sources.json"
# Keys whose value may name code as `path/to/file.py:name` (task.rewards[i].fn and eval.sets are
# expanded per item). engine.kind and algorithm.advantage also take built-in names: left as they are.
CODE_KEYS = ("task.env", "task.agent", "task.reward", "task.rewards[].fn", "eval.reward", "algorithm.advantage",
             "algorithm.loss", "engine.kind")
# Keys whose value is a path of a file or directory (made absolute when it exists there).
PATH_KEYS = ("model.path", "task.dataset", "task.eval_dataset", "algorithm.critic.path", "eval.sets.*")
# Directories a run writes (made absolute whether or not they exist yet).
DIR_KEYS = ("run.dir", "run.tensorboard_dir", "placement.weight_sync_dir", "placement.ray_temp_dir")


def _leaves(data: dict[str, Any], pattern: str) -> list[tuple[list[Any], Any]]:
    """(path into `data`, value) of every leaf `pattern` names (`[]`: each item of a list,
    `*`: each value of a mapping); absent or null leaves are left out."""
    found: list[tuple[list[Any], Any]] = [([], data)]
    for part in pattern.split("."):
        nxt = []
        for path, node in found:
            name, each = part.removesuffix("[]"), part.endswith("[]")
            if part == "*" and isinstance(node, dict):
                nxt += [([*path, k], v) for k, v in node.items()]
            elif isinstance(node, dict) and node.get(name) is not None:
                child = node[name]
                nxt += [([*path, name, i], v) for i, v in enumerate(child)] if each else [([*path, name], child)]
        found = nxt
    return [(p, v) for p, v in found if isinstance(v, str)]


def _set(data: dict[str, Any], path: list[Any], value: Any) -> None:
    node = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def code_file(value: str) -> tuple[str, str] | None:
    """(file, attribute) when `value` names code in a file (`path/to/file.py:name`, as
    tidal/importing.py reads it); None for a dotted module path or a built-in name."""
    target, sep, attr = value.rpartition(":")
    if not sep or not target or adapter_of(value) is not None:
        return None
    return (target, attr) if target.endswith(".py") or "/" in target or "\\" in target else None


def absolute(cfg: TidalConfig, base: Path | None = None) -> TidalConfig:
    """`cfg` with every path it names absolute, resolved against `base` (default: the current
    directory): a copy; what names no existing file (a Hub model id, `default`) is left."""
    base = Path(base or Path.cwd())
    data = cfg.model_dump(mode="json")

    def resolved(p: str) -> Path:
        return (base / Path(p).expanduser()).resolve()

    for pattern in CODE_KEYS:
        for path, value in _leaves(data, pattern):
            found = code_file(value)
            if found and resolved(found[0]).is_file():
                _set(data, path, f"{resolved(found[0])}:{found[1]}")
    for pattern in PATH_KEYS:
        for path, value in _leaves(data, pattern):
            if adapter_of(value) is None and value != "default" and resolved(value).exists():
                _set(data, path, str(resolved(value)))
    for pattern in DIR_KEYS:
        for path, value in _leaves(data, pattern):
            _set(data, path, str(resolved(value)))
    return TidalConfig.model_validate(data)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_files(cfg: TidalConfig) -> dict[str, str]:
    """`key: file` of every file of code `cfg` names (key as in the config: task.rewards.0.fn)."""
    data = cfg.model_dump(mode="json")
    out = {}
    for pattern in CODE_KEYS:
        for path, value in _leaves(data, pattern):
            found = code_file(value)
            if found:
                out[".".join(str(p) for p in path)] = found[0]
    return out


def keep_sources(cfg: TidalConfig, run_dir: Path) -> dict[str, dict[str, str]]:
    """Copy every file of code `cfg` names (absolute: see `absolute`) into RUN/sources/ and
    record it in RUN/sources.json: `key: {file, copy, sha256}` (copy relative to the run)."""
    kept: dict[str, dict[str, str]] = {}
    for key, file in code_files(cfg).items():
        src = Path(file)
        if not src.is_file():
            continue  # a file that cannot be read was refused when the run's parts were built
        digest = sha256(src)
        copy = Path(SOURCES_DIR) / f"{src.stem}-{digest[:12]}{src.suffix}"
        (run_dir / SOURCES_DIR).mkdir(parents=True, exist_ok=True)
        if not (run_dir / copy).is_file():
            shutil.copy2(src, run_dir / copy)
        kept[key] = {"file": str(src), "copy": str(copy), "sha256": digest}
    if kept:
        (run_dir / SOURCES_FILE).write_text(json.dumps(kept, indent=1) + "\n")
    return kept


def read_kept(run_dir: Path) -> dict[str, dict[str, str]]:
    path = Path(run_dir) / SOURCES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def changes(run_dir: Path) -> dict[str, str]:
    """`key: what happened` for each kept file whose original changed since the run copied it, or is gone."""
    out = {}
    for key, rec in read_kept(run_dir).items():
        original = Path(rec["file"])
        if not original.is_file():
            out[key] = f"{original} is gone"
        elif (now := sha256(original)) != rec["sha256"]:
            out[key] = f"{original} has changed since the run copied it (sha256 {rec['sha256'][:12]} -> {now[:12]})"
    return out


def use_kept(cfg: TidalConfig, run_dir: Path, why: str) -> TidalConfig:
    """`cfg` (the run's own) importing the run's copies of its files of code, where its keys
    still name the files the run copied (an override that names other code is left); each
    original that changed since, or is gone, is said in a warning. `why`: the command, for it."""
    run_dir = Path(run_dir)
    data = cfg.model_dump(mode="json")
    changed = changes(run_dir)
    for key, rec in read_kept(run_dir).items():
        path = [int(p) if p.isdigit() else p for p in key.split(".")]
        node: Any = data
        try:
            for p in path:
                node = node[p]
        except (KeyError, IndexError, TypeError):
            continue
        found = code_file(node) if isinstance(node, str) else None
        if found is None or Path(found[0]).expanduser().resolve() != Path(rec["file"]).resolve():
            continue
        copy = run_dir.resolve() / rec["copy"]
        if not copy.is_file():
            log.warning("%s: the run's copy %s of %s is missing: importing the file itself", why, copy, key)
            continue
        _set(data, path, f"{copy}:{found[1]}")
        if key in changed:
            log.warning("%s: %s: %s; using the run's copy %s", why, key, changed[key], copy)
    return TidalConfig.model_validate(data)


def warn_changed(run_dir: Path, why: str) -> None:
    """A warning per kept file whose original differs from the run's copy (`why` goes on on the original)."""
    for key, what in changes(run_dir).items():
        log.warning("%s: %s: %s; this run goes on with the file as it is now (the run's first copy: %s)",
                    why, key, what, Path(run_dir) / read_kept(run_dir)[key]["copy"])
