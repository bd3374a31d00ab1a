"""A run's saved config and what a resume may change: `dump_config` writes the config a run
directory keeps (config.yaml), `load_resume_config` reads it back with the overrides of every
resume since.

The choice: a resume's overrides are recorded (resumes.jsonl) with the keys they change, and
those that change what the resumed steps compute are named (RESUME_NEUTRAL lists the keys that
do not), so a resumed run is never mistaken for an uninterrupted one; RESUME_REFUSED keys
cannot change at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tidal.config.load import ConfigError, load_config
from tidal.config.tidal_config import TidalConfig

# Keys a resume may change without changing what the resumed steps compute: how long the run
# goes, how often it saves, evaluates and logs, and where and how fast its parts run.
RESUME_NEUTRAL = ("train.steps", "run.save_every", "run.keep_checkpoints", "run.eval_every", "run.progress",
                  "run.threads", "run.write_episodes", "eval.", "placement.", "engine.", "reward.workers",
                  "reward.isolation", "reward.max_concurrency", "gateway.")
RESUME_REFUSED = {"model.path": "the checkpoint holds the weights and the tokenizer: resuming with another model "
                                "would train a different model under this run's name",
                  "run.dir": "the run directory is the run"}


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_diff(old: TidalConfig, new: TidalConfig) -> dict[str, list[Any]]:
    """`key: [old, new]` for every leaf that differs."""
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def load_resume_config(run_dir: str | Path, overrides: list[str]) -> tuple[TidalConfig, dict[str, Any]]:
    """The config a resumed run continues with: its own saved `config.yaml` with the overrides
    of its earlier resumes (resumes.jsonl) and then `overrides` on top, validated as one.
    Returns it and the record of this resume: the overrides, what they change, and which of
    the changes alter what the resumed steps compute (they will not equal an uninterrupted
    run's). Overrides of RESUME_REFUSED keys are refused."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume: {saved} does not exist: run.dir must name the directory of an earlier run")
    earlier: list[str] = []
    log_path = Path(run_dir) / "resumes.jsonl"
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            if line.strip():
                earlier += json.loads(line).get("overrides", [])
    base = load_config(saved, earlier)
    cfg = load_config(saved, [*earlier, *overrides])
    changed = config_diff(base, cfg)
    for key, why in RESUME_REFUSED.items():
        if key in changed:
            raise ConfigError(f"--resume: `{key}` cannot change ({changed[key][0]!r} -> {changed[key][1]!r}): {why}")
    breaking = [k for k in changed if not any(k == n or (n.endswith(".") and k.startswith(n)) for n in RESUME_NEUTRAL)]
    return cfg, {"overrides": list(overrides), "changed": changed, "changes_computation": breaking}


def dump_config(cfg: TidalConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
