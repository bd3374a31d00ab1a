"""The reward forms: how each calling convention is called, what its answer must be, and
how several rewards combine into one outcome per episode.

The form is chosen by config (`task.reward_form`, `task.rewards[i].form`), never guessed
from a signature. Everything here is plain code over plain data, shared by the worker
processes, the Ray reward actors and the inline scorer, so the three type failures the same
way. A call of user code produces, per input, either `Scored` (its value, unweighted parts
and metrics) or `Failed` (what went wrong, worded as what it is, and the traceback); the
driver turns those into `RewardOutcome`s with `combine` and logs every failure's traceback
on the `tidal.rewards` logger (the run directory's log keeps it).

Combination rule (docs/rewards.md): the episode's reward is sum(weight * value) over the
rewards. Parts are stored weighted, so they always sum to the reward. One reward: its dict's
keys are the parts (a float is one part named after the reward). Several: a float is the
part `name`, a dict entry the part `name/key`. Accuracy reads the part `correct`, else the
first part ending in `/correct`; `metrics["correct"]` holds that part's unweighted value.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
import threading
import traceback as tb_module
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tidal.rewards.contract import RewardInput, RewardOutcome, RewardParts
from tidal.rewards.loading import load_reward

log = logging.getLogger("tidal.rewards")

# The keyword arguments a `tidal`-form reward may take besides the row's columns.
SAMPLE_EXTRAS = ("prompt", "prompt_messages", "completion_ids", "messages", "turns", "episode_id", "task_id")


@dataclass
class Scored:
    """One input scored by one reward: `value` is its unweighted reward; `parts` its dict's
    entries (empty for a float); `metrics` numbers to log that are not reward (veRL's extras)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Failed:
    """One input that a reward could not score. `what` completes "reward function `f` ...",
    e.g. "raised KeyError('answer')"; `hint` (may be empty) says what to do about it."""

    status: str  # "reward_error" | "timeout"
    what: str
    traceback: str = ""
    hint: str = ""


Result = Scored | Failed


@dataclass
class LoadedReward:
    """A reward ready to call: the callable, its form and how it is named."""

    fn: Any
    form: str  # "tidal" | "trl" | "verl"
    label: str  # as written in config (`pkg.mod:score`): names the function in errors
    name: str  # its part name
    weight: float
    key: str  # the config key it came from (`task.reward`, `task.rewards[1].fn`)
    is_async: bool
    accepted: frozenset[str] | None  # keyword names its signature takes; None: any (**kwargs)


# A tidal-form reward as `check_sample` needs it, for callers outside the pool (call_reward).
TIDAL_FORM = LoadedReward(None, "tidal", "", "", 1.0, "", False, None)


def spec_data(spec: Any, key: str) -> dict[str, Any]:
    """A RewardSpec as plain data for a worker (which need not import the config models)."""
    return {"fn": spec.fn, "form": spec.form, "weight": float(spec.weight), "name": spec.name,
            "args": dict(spec.args or {}), "key": key}


def default_keys(n: int) -> list[str]:
    return ["task.reward"] if n == 1 else [f"task.rewards[{i}].fn" for i in range(n)]


def reward_meta(specs: list[dict[str, Any]]) -> list[LoadedReward]:
    """How each reward is named and weighted, without importing it (the driver of a worker
    pool needs only this); raises ValueError when two share a part name."""
    out = []
    for d in specs:
        name = d.get("name") or d["fn"].rpartition(":")[2].rpartition(".")[2] or d["fn"]
        out.append(LoadedReward(None, d.get("form", "tidal"), d["fn"], name, float(d.get("weight", 1.0)), d["key"],
                                False, None))
    seen: dict[str, str] = {}
    for r in out:
        if r.name in seen:
            raise ValueError(f"`{r.key}`: its part name `{r.name}` is also that of `{seen[r.name]}`; "
                             f"give one of them a `name`")
        seen[r.name] = r.key
    return out


def load_rewards(specs: list[dict[str, Any]]) -> list[LoadedReward]:
    """Import every reward (a ValueError names the key of the first that fails)."""
    out = reward_meta(specs)
    for r, d in zip(out, specs):
        r.fn = load_reward(SimpleNamespace(fn=d["fn"], args=d.get("args") or {}), key=d["key"])
        r.is_async, r.accepted = is_async_callable(r.fn), accepted_keywords(r.fn)
    return out


def is_async_callable(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)  # an instance with `async def __call__`


def accepted_keywords(fn: Any) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def _only_accepted(reward: LoadedReward, kwargs: dict[str, Any]) -> dict[str, Any]:
    if reward.accepted is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in reward.accepted}


# -- arguments ---------------------------------------------------------------------------------
class BadInput(ValueError):
    """The episode lacks what the form needs (e.g. veRL's `reward_model.ground_truth`)."""


def is_text_prompt(inp: RewardInput) -> bool:
    """A row whose prompt was text reaches the reward as one user message (the env turns
    text into messages); TRL then expects the text, not messages."""
    pm = inp.prompt_messages
    return len(pm) == 1 and pm[0].get("role") == "user" and set(pm[0]) <= {"role", "content"} \
        and isinstance(pm[0].get("content"), str)


def arguments(reward: LoadedReward, inputs: list[RewardInput]) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of one call: one input for the per-sample forms, a group for `trl`."""
    if reward.form == "trl":
        text = all(is_text_prompt(i) for i in inputs)
        kw: dict[str, Any] = {
            "prompts": [i.prompt_messages[0]["content"] if text else i.prompt_messages for i in inputs],
            "completions": [i.completion if text else [{"role": "assistant", "content": i.completion}] for i in inputs],
            "completion_ids": [i.completion_ids for i in inputs],
        }
        for k in dict.fromkeys(k for i in inputs for k in i.columns):
            kw.setdefault(k, [i.columns.get(k) for i in inputs])
        return (), _only_accepted(reward, kw)
    (inp,) = inputs
    if reward.form == "verl":
        cols = inp.columns
        rm = cols.get("reward_model")
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise BadInput(f"needs the row's `reward_model.ground_truth` (veRL's format), and the row has "
                           f"{'`reward_model` = ' + _short(rm) if 'reward_model' in cols else 'no `reward_model`'} "
                           f"(columns: {_columns(inp)})")
        if "data_source" not in cols:
            raise BadInput(f"needs the row's `data_source` column (veRL's format) (columns: {_columns(inp)})")
        kw = {"data_source": cols["data_source"], "solution_str": inp.completion, "ground_truth": rm["ground_truth"],
              "extra_info": cols.get("extra_info")}
        return (), _only_accepted(reward, kw)
    extras = {"prompt": inp.prompt, "prompt_messages": inp.prompt_messages, "completion_ids": inp.completion_ids,
              "messages": inp.messages, "turns": inp.turns, "episode_id": inp.episode_id, "task_id": inp.task_id}
    return (inp.completion,), _only_accepted(reward, {**extras, **inp.columns})  # a column wins over an extra


# -- answers -----------------------------------------------------------------------------------
class BadReturn(ValueError):
    """The reward returned something that is not a reward; the message says what it was."""


def _short(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _what(x: Any) -> str:
    return f"a {type(x).__name__} ({_short(x)})"


def _columns(inp: RewardInput) -> str:
    return ", ".join(sorted(inp.columns)) or "none"


def _number(x: Any, where: str = "") -> float:
    """A finite float from a number the reward returned, or BadReturn saying what it was."""
    if isinstance(x, numbers.Real) or (hasattr(x, "__float__") and not isinstance(x, str | bytes)):
        try:
            v = float(x)
        except (TypeError, ValueError):
            raise BadReturn(f"returned {_what(x)}{where}, which is not a single number") from None
        if not math.isfinite(v):
            raise BadReturn(f"returned a non-finite reward {v!r}{where}")
        return v
    raise BadReturn(f"returned {_what(x)}{where}, expected a float or a dict of floats")


def check_sample(reward: LoadedReward, out: Any) -> Scored:
    """The answer of a per-sample call (`tidal`, `verl`) as a Scored, or BadReturn."""
    if out is None:
        raise BadReturn("returned None, expected a float or a dict of floats")
    if isinstance(out, RewardParts) and out:
        # Parts with metrics (e.g. the judge's): the parts are the reward, the metrics (how it
        # was reached: an injection flag, a cache hit) reach the episode's metrics.
        checked = {str(k): _number(v, f" for `{k}`") for k, v in out.items()}
        extra = {str(k): float(v) for k, v in out.metrics.items()
                 if isinstance(v, numbers.Real) and math.isfinite(float(v))}
        return Scored(sum(checked.values()), checked, extra)
    if isinstance(out, dict):
        if not out:
            raise BadReturn("returned an empty dict, expected a float or a dict of floats")
        if reward.form == "verl":
            if "score" not in out:
                raise BadReturn(f"returned a dict without `score` (keys: {', '.join(map(str, out))}), expected a "
                                f"float or veRL's dict with `score`")
            value = _number(out["score"], " for `score`")
            metrics = {}
            for k, v in out.items():  # veRL's extras: numbers become metrics, the rest (a parsed answer) is skipped
                if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v)):
                    metrics[str(k)] = float(v)
            return Scored(value, {}, metrics)
        parts = {str(k): _number(v, f" for `{k}`") for k, v in out.items()}
        return Scored(sum(parts.values()), parts)
    return Scored(_number(out))


def check_group(reward: LoadedReward, out: Any, n: int) -> list[Result]:
    """The answer of a batched (`trl`) call: one float or None per completion."""
    if hasattr(out, "tolist") and not isinstance(out, list | tuple):
        out = out.tolist()  # a numpy array or a tensor
    if not isinstance(out, list | tuple):
        raise BadReturn(f"returned {_what(out)}, expected a list of {n} floats or None (one per completion)")
    if len(out) != n:
        raise BadReturn(f"returned {len(out)} rewards for a group of {n} completions")
    results: list[Result] = []
    for x in out:
        if x is None:
            results.append(Failed("reward_error", "returned None for this sample (no reward)"))
            continue
        try:
            results.append(Scored(_number(x)))
        except BadReturn as e:
            results.append(Failed("reward_error", str(e)))
    return results


def check(reward: LoadedReward, out: Any, inputs: list[RewardInput]) -> list[Result]:
    """Per input: Scored or Failed (never raises for a bad answer)."""
    try:
        if reward.form == "trl":
            return check_group(reward, out, len(inputs))
        return [check_sample(reward, out)]
    except BadReturn as e:
        return [Failed("reward_error", str(e))] * len(inputs)


def raised(reward: LoadedReward, e: BaseException, inputs: list[RewardInput], tb: str | None = None) -> list[Result]:
    """The reward raised `e`: worded as `raised KeyError('answer')`, with a hint when a
    required argument is missing (a column the dataset does not have)."""
    text = _short(e, 300)
    hint = ""
    if isinstance(e, TypeError) and reward.form != "trl" and len(inputs) == 1:
        missing = _missing_arguments(reward, inputs[0])
        if missing:
            hint = (f"the row has no column {', '.join(f'`{m}`' for m in missing)} "
                    f"(columns: {_columns(inputs[0])})")
    if tb is None:
        tb = "".join(tb_module.format_exception(e))
    return [Failed("reward_error", f"raised {text}", tb, hint)] * len(inputs)


def _missing_arguments(reward: LoadedReward, inp: RewardInput) -> list[str]:
    try:
        params = inspect.signature(reward.fn).parameters
    except (TypeError, ValueError):
        return []
    args, kwargs = arguments(reward, [inp])
    positional = len(args)
    missing = []
    for i, (k, p) in enumerate(params.items()):
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if i < positional and p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if k not in kwargs:
            missing.append(k)
    return missing


def timed_out(timeout_s: float, n: int, hint: str = "") -> list[Result]:
    return [Failed("timeout", f"did not return within reward.timeout_s={timeout_s:g}s", hint=hint)] * n


def bad_input(e: BadInput, n: int) -> list[Result]:
    return [Failed("reward_error", str(e))] * n


# -- outcome -----------------------------------------------------------------------------------
def error_text(reward: LoadedReward, failed: Failed, inp: RewardInput) -> str:
    """One readable line: function, what happened, the episode (the rollout's own wording)."""
    where = f"on episode {inp.episode_id} (task {inp.task_id}) of step {inp.step}"
    text = f"reward function `{reward.label}` {failed.what} {where}"
    return f"{text}: {failed.hint}" if failed.hint else text


class OncePerStep:
    """Which failures were logged in full: a reward that fails the same way on many episodes
    logs its traceback once per step (the first episode), the others one line each in
    train.log only (INFO), and the step's summary counts them (tidal/runtime/health.py).
    Distinct errors are told apart by function, status and what happened; the steps kept are
    bounded (async training scores several steps at once)."""

    STEPS = 8

    def __init__(self):
        self._seen: dict[int, set[tuple[str, str, str]]] = {}
        self._lock = threading.Lock()  # the pools answer from their own threads

    def first(self, step: int, key: tuple[str, str, str]) -> bool:
        with self._lock:
            seen = self._seen.get(step)
            if seen is None:
                seen = self._seen[step] = set()
                for old in sorted(self._seen)[: -self.STEPS]:
                    del self._seen[old]
            if key in seen:
                return False
            seen.add(key)
            return True


_RAISED = re.compile(r"raised (\w+)\(")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def failure_key(r: LoadedReward, res: Failed) -> tuple[str, str, str]:
    """What makes two failures the same error: the function, the status, and for a raise the
    exception's class and where it was raised (its message may name the episode's data), else
    what happened."""
    raised_as = _RAISED.match(res.what)
    if raised_as is None:
        return r.label, res.status, res.what
    frames = _FRAME.findall(res.traceback)
    return r.label, res.status, f"{raised_as.group(1)} at {':'.join(frames[-1]) if frames else '?'}"


def log_failure(r: LoadedReward, res: Failed, inp: RewardInput, text: str, logged: OncePerStep | None) -> None:
    """Its traceback the first time `logged` (the scorer's) sees this error in the step; later
    ones a line in train.log. `logged` None: every traceback."""
    if logged is not None and not logged.first(inp.step, failure_key(r, res)):
        log.info("%s (the same error as logged above for this step)", text)
    elif res.traceback:
        log.warning("%s\n%s", text, res.traceback.rstrip())
    else:
        log.warning("%s", text)


def combine(rewards: list[LoadedReward], inp: RewardInput, results: list[Result],
            logged: OncePerStep | None = None) -> RewardOutcome:
    """One episode's outcome from each reward's result (in the order of `rewards`). The first
    failure (in that order) is the outcome; every failure is logged, its traceback once per
    distinct error and step where the scorer keeps `logged` (`log_failure`)."""
    first: RewardOutcome | None = None
    for r, res in zip(rewards, results):
        if isinstance(res, Failed):
            text = error_text(r, res, inp)
            log_failure(r, res, inp, text, logged)
            if first is None:
                first = RewardOutcome(res.status, error=text)  # type: ignore[arg-type]
    if first is not None:
        return first
    parts: dict[str, float] = {}
    metrics: dict[str, float] = {}
    correct: float | None = None
    several = len(rewards) > 1
    for r, res in zip(rewards, results):
        assert isinstance(res, Scored)
        if res.parts:
            for k, v in res.parts.items():
                name = f"{r.name}/{k}" if several else k
                parts[name] = parts.get(name, 0.0) + r.weight * v
                if k == "correct" and correct is None:
                    correct = v
        else:
            parts[r.name] = parts.get(r.name, 0.0) + r.weight * res.value
        for k, v in res.metrics.items():
            metrics[extra_key(k, r.name if several else None)] = v
    if correct is None:
        correct = _correct_elsewhere(rewards, results)
    if correct is not None:
        metrics["correct"] = correct
    return RewardOutcome("ok", reward=sum(parts.values()), parts=parts, metrics=metrics)


def extra_key(key: str, reward: str | None) -> str:
    """The metric name of a number a reward reported besides its value (veRL's `acc`, a
    RewardParts metric): `reward/extra/<key>` (`reward/extra/<reward>/<key>` among several
    rewards), so that it reaches the step's metrics; a key with a `/` (`judge/injection`) is
    already a metric name and stays as it is."""
    if "/" in key:
        return key
    return f"reward/extra/{reward}/{key}" if reward else f"reward/extra/{key}"


def says_correct(reward: LoadedReward) -> str | None:
    """Where a reward's answers say what is correct, as a person reads its config, or None:
    a tidal-form `correct` part can only be seen in its answers (None here)."""
    if reward.name == "correct":
        return f"the reward named `correct` (`{reward.label}`)"
    if reward.form == "verl":
        return f"veRL's `acc` of `{reward.label}`, where it returns one"
    return None


def _correct_elsewhere(rewards: list[LoadedReward], results: list[Result]) -> float | None:
    """Accuracy where no `correct` part says it: a reward named `correct` (its unweighted
    value: a TRL or veRL function named so in config), else veRL's `acc` (its extra key for
    accuracy, as veRL's own validation reads it)."""
    for r, res in zip(rewards, results):
        if r.name == "correct" and isinstance(res, Scored) and not res.parts:
            return res.value
    for r, res in zip(rewards, results):
        if r.form == "verl" and isinstance(res, Scored) and "acc" in res.metrics:
            return res.metrics["acc"]
    return None
