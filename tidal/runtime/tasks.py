"""A task: train rows, held-out rows, how to make an environment for a row and its rewards.

`task.env` names the environment class (a built-in name, a dotted path or a file path); it is
built per episode as `Env(row, seed=..., **args)`. Rows come from `task.dataset`, or, without
one, from the environment's own generator (`Env.rows(split, n, seed, **args)`); the default
`single_turn` environment without a dataset is the generated arithmetic task.

`task.env_args` are split between the two by their signatures (`split_env_args`): `rows()` gets
the keys it names, and the constructor gets the keys it names plus, when it takes `**kwargs`,
every key `rows()` does not name. A key both name goes to both; a key neither takes is an error
naming it. So an environment declares each setting where it is used, and neither sees the
other's.
"""

from __future__ import annotations

import inspect
from typing import Any

from tidal.config import ConfigError, TaskConfig
from tidal.envs import BUILTIN_ENVS, GENERATED_TASK
from tidal.envs.base import optional
from tidal.envs.dataset import load_prompts
from tidal.envs.task import Task
from tidal.importing import adapter_of, import_object

REASONING_GYM_REWARD = "tidal.envs.adapters.reasoning_gym:score"


def load_env_class(cfg: TaskConfig):
    if adapter_of(cfg.env) == "verifiers:":
        from tidal.envs.adapters.verifiers import env_class  # the extra: imported only when named

        return env_class(cfg.env.removeprefix("verifiers:"))
    if adapter_of(cfg.env) == "textarena:":
        from tidal.envs.adapters.textarena import env_class as game_class  # the extra: imported only when named

        return game_class(cfg.env.removeprefix("textarena:"))
    if adapter_of(cfg.env) == "openenv:":
        from tidal.envs.adapters.openenv import env_class as server_class  # the extra: imported only when named

        return server_class(cfg.env.removeprefix("openenv:"))
    if cfg.env == "single_turn" and cfg.dataset is None:
        path = GENERATED_TASK  # the generated default task
    else:
        path = BUILTIN_ENVS.get(cfg.env, cfg.env)
    try:
        cls = import_object(path, "task.env")
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    if not callable(cls):
        raise ConfigError(f"invalid config: `task.env`: `{cfg.env}` is not a class or factory")
    return cls


def build_task(cfg: TaskConfig) -> Task:
    """Everything is loaded and checked here, before any model or worker starts: the env class
    (built once on the first row, so a bad `task.env_args` is named now), the rows, the rewards."""
    env_cls = load_env_class(cfg)
    env_args = dict(cfg.env_args)  # with a dataset, all of them are the constructor's
    if cfg.dataset is None:
        rows_of = optional(env_cls, "rows")
        if rows_of is None:
            raise ConfigError(f"invalid config: `task.dataset`: env `{cfg.env}` generates no rows of its own; name a dataset")
        gen_args, env_args = split_env_args(env_cls, rows_of, env_args, cfg.env)
        try:
            train = rows_of("train", cfg.train_size, cfg.seed, **gen_args)
            held_out = rows_of("test", cfg.eval_size, cfg.seed, **gen_args)
        except (TypeError, ValueError) as e:  # e.g. the arithmetic task's min_digits=0
            raise ConfigError(f"invalid config: `task.env_args`: env `{cfg.env}` cannot generate rows with "
                              f"{gen_args}: {e}") from None
    elif adapter_of(cfg.dataset) == "reasoning_gym:":
        train, held_out = _reasoning_gym_rows(cfg)
    else:
        train = load_prompts(cfg.dataset)
        held_out = load_prompts(cfg.eval_dataset) if cfg.eval_dataset else []
    if cfg.agent:  # an agent environment (task.env=openai_agent) runs task.agent
        env_args = {**env_args, "agent": cfg.agent, "agent_args": dict(cfg.agent_args)}
    name = cfg.name or (cfg.dataset if adapter_of(cfg.dataset) else None) or getattr(env_cls, "name", None) or cfg.env
    task = Task(name if isinstance(name, str) else cfg.env, train, held_out, env_cls, env_args)
    try:
        task.make_env(train[0], 0)
    except TypeError as e:
        raise ConfigError(f"invalid config: `task.env_args`: env `{cfg.env}` cannot be built with {env_args}: {e}") from None
    except ValueError as e:  # e.g. task.agent names nothing importable
        raise ConfigError(f"invalid config: {e}") from None
    default_reward = optional(env_cls, "default_reward")
    if adapter_of(cfg.dataset) == "reasoning_gym:":
        default_reward = REASONING_GYM_REWARD
    task.rewards = cfg.reward_specs(default_reward)
    if not task.rewards and optional(env_cls, "default_reward", "none") is None and cfg.env == "single_turn":
        raise ConfigError("invalid config: `task.reward`: a dataset task needs a reward function (task.reward or task.rewards)")
    return task


def _reasoning_gym_rows(cfg: TaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A reasoning-gym task's train and held-out rows (tidal/envs/adapters/reasoning_gym.py)."""
    from tidal.envs.adapters import reasoning_gym  # the extra: imported only when named

    if cfg.eval_dataset:
        raise ConfigError("invalid config: `task.eval_dataset`: a reasoning_gym task draws its own held-out rows "
                          "(task.eval_size of them, from a seed distinct from task.seed)")
    try:
        return tuple(reasoning_gym.rows(cfg.dataset, split, size, cfg.seed, dict(cfg.dataset_args), cfg.prompt_template)
                     for split, size in (("train", cfg.train_size), ("test", cfg.eval_size)))
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None


def _keywords(fn) -> tuple[set[str], bool]:
    """The keyword parameters `fn` names, and whether it takes **kwargs (unknown: all)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): it takes what it is given
        return set(), True
    named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def split_env_args(env_cls, rows_of, env_args: dict[str, Any], env: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """`task.env_args` split into the row generator's and the constructor's (module docstring);
    ConfigError for a key neither takes."""
    rows_named, rows_any = _keywords(rows_of)
    init_named, init_any = _keywords(env_cls)
    rows_named -= {"split", "n", "seed"}
    init_named -= {"row", "seed"}
    gen = {k: v for k, v in env_args.items() if rows_any or k in rows_named}
    init = {k: v for k, v in env_args.items() if k in init_named or (init_any and k not in rows_named)}
    lost = [k for k in env_args if k not in gen and k not in init]
    if lost:
        raise ConfigError(f"invalid config: `task.env_args.{lost[0]}`: env `{env}` takes it neither in its constructor "
                          f"({', '.join(sorted(init_named)) or 'no keyword arguments'}) nor in rows() "
                          f"({', '.join(sorted(rows_named)) or 'no keyword arguments'})")
    return gen, init
