"""Typed configuration: pydantic models, YAML files and `a.b=c` command-line overrides.

Every field has a description. Everything is validated before any work starts; an error
names the offending key and the reason. Batch sizes are derived: the user gives the
global batch (prompts × samples per prompt) and a token budget per micro-batch.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidal.algorithms import AGGREGATIONS, ESTIMATORS, IS_LEVELS, KL_ESTIMATORS, POLICY_LOSSES, REJECTION_LEVELS
from tidal.algorithms.advantages import BUILTIN_NEEDS
from tidal.importing import adapter_of, check_extra

# The names of the monitors' parts (tidal/monitor/), held here so that a config is validated
# without importing the monitors: they sit above config in the package order and read these.
ALERTS = ("entropy_collapse", "kl_spike", "grad_norm_spike", "mismatch_growth", "expert_collapse", "staleness_over_bound",
          "failure_rate_jump", "tool_error_rate_jump", "throughput_drop", "no_learning_signal", "reward_up_eval_down",
          "reward_hacking")
HACKING_KINDS = ("divergence", "length_correlation", "part_dominance", "verifier_errors", "judge_disagreement")
# What each optional metric sink (run.loggers) imports, and the extra that installs it.
SINK_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field("default", description="Local HF model directory, tidal checkpoint, LoRA adapter directory, or a Hugging Face Hub id (`Qwen/Qwen3-0.6B`: downloaded into the Hub cache with a network, read from it offline, as transformers does); 'default' is the embedded tiny model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of trainer and engine.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto: cuda when a GPU is present, else cpu.")

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


class RewardSpec(_Section):
    fn: str = Field(..., description="The reward: a dotted path `pkg.module:function` or a file path `path/to/rewards.py:function`. A class or factory is called with `args` first.")
    form: Literal["tidal", "trl", "verl"] = Field("tidal", description="Calling convention (tidal/rewards/contract.py): tidal `fn(completion, **columns)`, trl `fn(prompts, completions, completion_ids, **columns) -> list`, verl `compute_score(data_source, solution_str, ground_truth, extra_info)`.")
    weight: float = Field(1.0, description="Weight of this reward in the episode's reward.")
    name: str | None = Field(None, description="Name of its part in reward_parts and the metrics; default: the function's name.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a class or factory named by `fn` (e.g. a reward model's path).")


AGENT_ENVS = ("openai_agent", "tidal.envs.openai_agent", "tidal.envs.openai_agent:OpenAIAgentEnv")


class TaskConfig(_Section):
    name: str | None = Field(None, description="Task name recorded on every episode (Episode.env); None: the environment's name (arithmetic for the default task).")
    env: str = Field("single_turn", description="Environment class: a built-in name (single_turn, tool_arith, code, shell) or a dotted path `my_pkg.envs:MyEnv` or a file path `path/to/envs.py:MyEnv`; built as `Env(row, seed=..., **env_args)`.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment class and of its row generator `Env.rows` (when there is no dataset), split by their signatures: rows() gets the keys it names, the class the keys it names and, if it takes **kwargs, the rest (docs/agents.md); for the generated arithmetic task, its problem distribution: min_digits, max_digits, ops (tidal/envs/arithmetic.py).")
    agent: str | None = Field(None, description="With task.env=openai_agent: the agent, `solve(row, client)` (sync or async) as a dotted path `my_pkg.agents:solve` or a file path; `client` is an `openai.OpenAI` (sync) or `openai.AsyncOpenAI` (async) client pointed at the gateway's session of the episode.")
    agent_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the agent: `solve(row, client, **agent_args)`.")
    dataset: str | None = Field(None, description="Prompt dataset (JSONL, Parquet or HF datasets dir) with a `prompt` column, or `reasoning_gym:TASK` (a reasoning-gym task: train_size rows from `seed`, eval_size held-out rows from a distinct seed, its score_answer the default reward; docs/envhub.md). None: the environment's own generated task (the arithmetic task for single_turn).")
    dataset_args: dict[str, Any] = Field(default_factory=dict, description="With `dataset: reasoning_gym:TASK`: the task's config (e.g. min_terms, max_digits for chain_sum), passed to reasoning_gym.create_dataset.")
    prompt_template: str | None = Field(None, description="With `dataset: reasoning_gym:TASK`: the user's message as a format string over the entry's `question` and metadata fields (e.g. 'What is {expression}?'); None: the task's own question.")
    eval_dataset: str | None = Field(None, description="Held-out prompt dataset; None with `dataset` None: the generated task's held-out split.")
    reward: str | None = Field(None, description="Reward function as a dotted path `pkg.module:function` or a file path `path/to/rewards.py:function`; None: the environment's default (tidal.rewards.arithmetic:score for the arithmetic task).")
    reward_form: Literal["tidal", "trl", "verl"] = Field("tidal", description="Calling convention of `reward` (see task.rewards[].form).")
    rewards: list[RewardSpec] = Field(default_factory=list, description="Several rewards combined with weights, each logged as a part (instead of `reward`).")
    train_size: int = Field(10_000, ge=1, description="Generated train problems.")
    eval_size: int = Field(500, ge=1, description="Held-out problems used by evaluation.")
    seed: int = Field(0, description="Seed of the generated problems.")

    @model_validator(mode="before")
    @classmethod
    def _arithmetic_is_env_args(cls, data: Any) -> Any:
        """`task.arithmetic` (configs and run directories written before it moved) is the arithmetic
        task's `task.env_args`: carried there for the generated task, dropped (as it always was
        ignored) for any other environment."""
        if not isinstance(data, dict) or "arithmetic" not in data:
            return data
        data = dict(data)
        old = data.pop("arithmetic")
        if not isinstance(old, dict):  # ValueError: pydantic names the key with it (a TypeError escapes)
            raise ValueError("task.arithmetic is now task.env_args (e.g. task.env_args.max_digits=3): got "  # noqa: TRY004
                             f"{type(old).__name__}, not a mapping")
        if data.get("env", "single_turn") == "single_turn" and data.get("dataset") is None:
            args = dict(data.get("env_args") or {})
            clash = [k for k in old if k in args and args[k] != old[k]]
            if clash:
                raise ValueError(f"task.arithmetic is now task.env_args: task.arithmetic.{clash[0]} and "
                                 f"task.env_args.{clash[0]} disagree; set only task.env_args.{clash[0]}")
            data["env_args"] = {**old, **args}
        return data

    @model_validator(mode="after")
    def _one_reward_list(self) -> TaskConfig:
        if self.reward is not None and self.rewards:
            raise ValueError("set task.reward or task.rewards, not both")
        check_extra("task.env", self.env)  # an adapter's package missing: named with its pip command
        check_extra("task.dataset", self.dataset)
        if (self.dataset_args or self.prompt_template) and adapter_of(self.dataset) != "reasoning_gym:":
            raise ValueError("task.dataset_args and task.prompt_template shape a generated dataset (task.dataset: reasoning_gym:TASK)")
        agent_env = self.env in AGENT_ENVS
        if agent_env and not self.agent:
            raise ValueError(f"task.env={self.env} runs an agent: name it in task.agent (e.g. my_pkg.agents:solve)")
        if self.agent and not agent_env:
            raise ValueError(f"task.agent is set but task.env={self.env} does not run agents: use task.env=openai_agent")
        return self

    def reward_specs(self, env_default: str | None) -> list[RewardSpec]:
        """The rewards of this task: `rewards`, else `reward`, else the environment's default."""
        if self.rewards:
            return list(self.rewards)
        path = self.reward or env_default
        return [RewardSpec(fn=path, form=self.reward_form)] if path else []


class RewardConfig(_Section):
    isolation: Literal["process", "inline"] = Field("process", description="Where reward code runs: process, a pool of worker processes whose hung calls are killed and replaced (Ray actors when placement.reward_workers > 0 in ray mode); inline, in the rollout's own process (debugging with breakpoints: a hung synchronous reward cannot be killed there).")
    workers: int = Field(2, ge=1, description="Worker processes of the local process pool (ray mode: placement.reward_workers actors instead).")
    timeout_s: float = Field(30.0, gt=0.0, description="Most seconds one reward call may take; past it the call is killed and its episode ends `timeout`.")
    max_concurrency: int = Field(64, ge=1, description="Most async calls in flight in one worker (they overlap on its event loop).")
    sync_concurrency: int = Field(8, ge=1, description="Synchronous calls one worker runs at once, each sync lane a thread of its own running its calls in order: hung calls time out together, not one after another (the worst case of a step: docs/rewards.md). 1: one at a time, for a synchronous reward that is not thread-safe.")
    worker_memory_mb: int = Field(4096, ge=64, description="Memory limit of one reward worker process and everything it starts (its cgroup's memory limit, where tidal can make cgroups: see docs/rewards.md, Limits); a worker that reaches it is killed by the kernel and the call it was running ends `reward_error` naming the limit. Where no cgroup can be made it is not enforced (a warning says so) and worker_max_rss_mb recycling bounds a leak.")
    worker_max_processes: int = Field(512, ge=8, description="Most processes and threads of one reward worker and what it starts (its cgroup's pids limit, where tidal can make cgroups): a fork bomb fails its own forks.")
    worker_max_calls: int = Field(10000, ge=0, description="A reward worker is recycled (a fresh one takes its place, the old one ends once its calls are answered) after this many calls; 0: never.")
    worker_max_rss_mb: int = Field(2048, ge=0, description="A reward worker whose resident memory (its own, as it reports after each answer) passes this is recycled the same way: a reward that leaks costs at most this much; 0: never.")
    worker_address_space_mb: int | None = Field(None, ge=64, description="RLIMIT_AS of a reward worker process (an allocation past it raises MemoryError in the reward, which ends that call `reward_error`); None: none. Off by default: an address-space limit counts the reservations of libraries (torch reserves gigabytes it never touches); worker_memory_mb is the limit that counts memory used.")
    worker_log_bytes: int = Field(1 << 20, ge=0, description="Most bytes of one reward worker's stdout and stderr written to train.log (logger tidal.rewards.output, one line per record); the rest is read and dropped, and counted in a last line. A reward's output never reaches tidal's own stdout.")
    failure_budget: float = Field(0.5, ge=0.0, le=1.0, description="The run stops (checkpoint intact, exit code 3) when more than this fraction of a step's episodes fail (any non-trainable status) for `failure_steps` steps in a row; 1.0: never.")
    failure_steps: int = Field(3, ge=1, description="Consecutive steps over the failure budget that stop the run.")
    monitors: bool = Field(True, description="Reward-hacking monitors (tidal/monitor/hacking.py): events in the metrics (`hacking/*`), the log and <run dir>/hacking_events.jsonl, each with example episodes.")
    monitor_args: dict[str, Any] = Field(default_factory=dict, description="Bounds of the monitors: keyword arguments of tidal.monitor.hacking.HackingMonitor (e.g. length_corr_max, part_share_max, error_jump).")


class RolloutConfig(_Section):
    prompts_per_step: int = Field(32, ge=1, description="Prompts per training step.")
    samples_per_prompt: int = Field(8, ge=1, description="Episodes per prompt (the GRPO group size).")
    max_new_tokens: int = Field(32, ge=1, description="Token budget of one policy turn.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy). The trainer scores with the same temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    episode_timeout_s: float = Field(600.0, gt=0.0, description="Wall-clock bound of one episode (all turns); past it the episode ends `timeout`.")
    max_turns: int = Field(1, ge=1, description="Most policy turns of one episode (multi-turn and tool-using environments); an episode out of turns ends `truncated`.")
    max_total_tokens: int | None = Field(None, ge=1, description="Token budget of one episode across turns (prompt, observations and generations); a turn's max_new_tokens is cut to what is left, and an episode with none left ends `truncated`. None: no budget beyond max_turns × max_new_tokens.")
    prefix_policy: Literal["split", "continue"] = Field("split", description="When the chat template re-renders earlier turns differently from what the policy saw (not prefix-preserving): split, the episode continues in a new segment that starts from the template's rendering and every segment is trained separately; continue, the same, but the earlier segments are kept masked (not trained). Counted in rollout/prefix_breaks.")
    max_staleness: int = Field(0, ge=0, description="Bound k on how stale trained data may be, in training steps: a step's prompts start only once the engines hold weights at most k steps older than those it will be trained against. 0: synchronous on-policy; 1: one-step off-policy; k > 1: fully asynchronous (generation overlaps training).")

    @property
    def global_batch(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


class CriticConfig(_Section):
    path: str | None = Field(None, description="Critic initialization: an HF model directory; None: the policy's own weights with a fresh value head.")
    lr: float = Field(1e-3, gt=0.0, description="Critic AdamW learning rate (constant after train.warmup_steps).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip of the value update around the pre-update values (PPO2); None: plain squared error.")


class AlgorithmConfig(_Section):
    advantage: str = Field("grpo", description=f"Advantage estimator: one of {ESTIMATORS} (`gae` trains a critic, PPO proper; `remax` adds one greedy rollout per prompt as baseline), or a dotted or file path (`my_pkg.adv:MyEstimator`) to a class built with this section and `advantage_args`, or a function of tidal.algorithms.AdvantageInputs, declaring `needs_values` / `needs_greedy_baseline` (tidal/algorithms/advantages.py).")
    advantage_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of an `advantage` estimator of your own (a class gets them after this section; a function after its inputs).")
    std_scale: Literal["group", "batch", "none"] = Field("group", description="GRPO reward scaling: group std, batch std or none (Dr.GRPO).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over policy tokens (gae, reinforce++).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE λ.")
    policy_loss: Literal[POLICY_LOSSES] = Field("ppo", description=f"Policy loss, one of {POLICY_LOSSES}.")
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="Ratio clip below 1 (GSPO: ~3e-4; CISPO: 1.0 removes the lower bound).")
    clip_high: float = Field(0.28, ge=0.0, description="Ratio clip above 1 (clip-higher when > clip_low; GSPO: ~4e-4).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c > 1 bounding the loss of negative advantages (ppo only); None: off.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient (the loss subtracts coef × entropy).")
    loss: str | None = Field(None, description="The per-token objective: a dotted or file path (`my_pkg.losses:MyLoss`) to a class built with this section, or a function, called with tidal.algorithms.objective.LossInputs and returning a LossOutput (tidal/algorithms/objective.py); None: tidal's PolicyObjective (policy_loss, IS weight, rejection, KL, entropy, loss_agg).")
    loss_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a `loss` of your own (a class gets them after this section; a function after its LossInputs).")
    loss_agg: str = Field("token-mean", description=f"Loss aggregation, one of {AGGREGATIONS}.")
    loss_norm_len: int | None = Field(None, ge=1, description="Constant length of seq-mean-token-sum-norm (Dr.GRPO); None: rollout.max_new_tokens.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL coefficient against the frozen reference; 0 loads no reference model.")
    kl_estimator: Literal[KL_ESTIMATORS] = Field("k3", description="KL estimator (k1, k2, k3).")
    kl_in: Literal["loss", "reward"] = Field("loss", description="Where the KL enters: a loss term, or a per-token reward penalty before advantages.")
    kl_target: float | None = Field(None, gt=0.0, description="Adaptive KL: target per-token KL; β moves towards it (Ziegler et al.). None: fixed kl_coef.")
    kl_horizon: int = Field(10_000, ge=1, description="Adaptive KL horizon in samples.")
    anchor: Literal["proximal", "behaviour"] = Field("proximal", description="PPO clipping anchor: the trainer's pre-update log-probs (proximal; decoupled PPO with is_level) or the engine's (behaviour).")
    is_level: Literal[IS_LEVELS] = Field("none", description="Truncated importance weight π_prox/μ_engine: none, per token, or per sequence.")
    is_cap: float = Field(2.0, gt=0.0, description="Truncation of the importance weight.")
    rejection: Literal[REJECTION_LEVELS] = Field("none", description="Mask tokens (token) or whole sequences (geometric mean) whose π_prox/μ ratio leaves [reject_low, reject_high].")
    reject_low: float = Field(0.5, gt=0.0, description="Lower ratio bound of rejection.")
    reject_high: float = Field(2.0, gt=0.0, description="Upper ratio bound of rejection.")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch.")
    max_sampling_rounds: int = Field(3, ge=1, description="Dynamic sampling: most generation rounds per step (the bound on extra generation).")
    overlong_filter: bool = Field(False, description="DAPO: truncated episodes get no loss (still counted in their group's baseline).")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty: the last N tokens of the budget are penalized linearly; 0: off.")
    overlong_penalty: float = Field(1.0, ge=0.0, description="Largest soft overlong penalty.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model, used when advantage=gae.")

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.advantage not in ESTIMATORS and not any(c in self.advantage for c in ".:/"):
            raise ValueError(f"advantage must be one of {ESTIMATORS} or a path to an estimator of your own "
                             f"(`my_pkg.module:Estimator`), got {self.advantage!r}")
        if self.advantage_args and self.advantage in ESTIMATORS:
            raise ValueError(f"advantage_args is for an estimator of your own; `{self.advantage}` takes its settings "
                             "from this section (std_scale, gamma, lam)")
        if self.loss_args and not self.loss:
            raise ValueError("loss_args is for a `loss` of your own: set algorithm.loss")
        if self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {AGGREGATIONS}, got {self.loss_agg!r}")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("kl_target needs an initial kl_coef > 0 (with kl_coef=0 no reference model is loaded)")
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ValueError(f"dual_clip applies to policy_loss=ppo only, not {self.policy_loss!r}")
        if self.reject_low >= self.reject_high:
            raise ValueError(f"reject_low={self.reject_low} must be below reject_high={self.reject_high}")
        return self


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, description="LoRA rank r (peft); 0: full fine-tuning. With r > 0 the policy trains low-rank adapters on `targets` only, the reference model (algorithm.kl_coef > 0) is the same weights with the adapters off (no second copy), engines receive the merged weights, and checkpoints hold the adapter beside the merged model (docs/algorithms.md).")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator: the update is (alpha / rank) · B·A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (peft's lora_dropout).")
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                               min_length=1, description="Names of the linear modules that get adapters (peft's target_modules; module names as in the model).")


class ParallelConfig(_Section):
    """How the trainer ranks are laid out as a named device mesh (tidal/trainer/parallel/mesh.py,
    docs/parallel.md). The degrees multiply to placement.trainer_ranks."""

    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicas: groups of ranks that each hold a whole copy of the (sharded) model and average nothing but their gradients (HSDP's replicated dimension: one all-reduce of gradients per step across groups, e.g. one group per node).")
    dp_shard: int = Field(-1, ge=-1, description="Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2) within a replica; -1: every rank the other dimensions leave (the default: 1-D FSDP over all trainer ranks).")
    tp: int = Field(1, ge=1, description="Tensor parallelism: each layer's attention heads, MLP columns and the vocabulary split over this many ranks (DTensor plans; Qwen2/Qwen2.5/Qwen3/Llama). The heads, the key-value heads, the MLP width and the vocabulary must divide by it; these ranks get the same sequences.")
    cp: int = Field(1, ge=1, description="Context parallelism (Ulysses): each micro-batch's positions split over this many ranks, attention made whole by all-to-alls between the position and the head dimension (tidal/trainer/parallel/context.py); activations ~1/cp per rank. The attention heads of a rank (after tp) must divide by it; these ranks get the same sequences. Text models, without LoRA.")
    ep: int = Field(1, ge=1, description="Expert parallelism (mixture-of-experts models): each rank holds num_experts / ep of every MoE layer's experts, and tokens travel to the rank of their expert and back by all-to-all, dropless (tidal/trainer/parallel/expert.py). Borrowed from the data ranks: these ranks get different sequences, and the parameters outside the experts are FSDP-sharded over dp_shard x ep. The model's num_experts must divide by it; not with tp, cp or LoRA.")

    @model_validator(mode="after")
    def _ep_alone(self) -> ParallelConfig:
        # ep is built over data ranks (tidal/trainer/parallel/expert.py): with tp the experts would also
        # need a plan of their own, and with cp the expert data mesh would not be contiguous; neither is built
        for key in ("tp", "cp"):
            if self.ep > 1 and getattr(self, key) > 1:
                raise ValueError(f"train.parallel.ep={self.ep} with {key}={getattr(self, key)}: expert parallelism "
                                 "composes with dp_shard and dp_replicate only; set one of them to 1")
        return self

    @property
    def fixed(self) -> int:
        """The product of every degree but an automatic dp_shard."""
        return self.dp_replicate * self.tp * self.cp * self.ep * (self.dp_shard if self.dp_shard > 0 else 1)

    def degrees(self, ranks: int) -> dict[str, int]:
        """The degree of every dimension for `ranks` trainer ranks (dp_shard=-1 resolved); a
        ValueError naming the keys and their product when they cannot multiply to `ranks`."""
        if self.dp_shard == 0:
            raise ValueError("train.parallel.dp_shard=0: use a positive degree, or -1 for every rank left")
        named = f"dp_replicate={self.dp_replicate} x tp={self.tp} x cp={self.cp} x ep={self.ep}"
        if self.dp_shard == -1:
            if ranks % self.fixed:
                raise ValueError(f"train.parallel: {named} = {self.fixed} does not divide placement.trainer_ranks={ranks} "
                                 "(dp_shard=-1 takes the ranks left)")
            shard = ranks // self.fixed
        else:
            shard = self.dp_shard
            if self.fixed != ranks:
                raise ValueError(f"train.parallel: dp_shard={shard} x {named} = {self.fixed}, but "
                                 f"placement.trainer_ranks={ranks}: the product of the degrees must equal the trainer ranks")
        return {"dp_replicate": self.dp_replicate, "dp_shard": shard, "cp": self.cp, "tp": self.tp, "ep": self.ep}


class MoeConfig(_Section):
    """Mixture-of-experts training (a model with top-k routers, e.g. Qwen3-MoE; docs/moe.md). The
    router always runs in float32 (tidal/models/moe.py)."""

    routing_replay: Literal["none", "R2", "R3"] = Field("none", description="Routing replay. R3 (rollout routing replay): on every generated token the trainer's forward (log-prob pass and update) uses the experts the engine chose (recorded per token and layer, carried by the episodes), while the router's weight still gets its gradient through its softmax at those experts; prompt and observation tokens (which the engine did not generate) use the trainer's own routing. R2: the trainer's own routing, recorded in the log-prob pass that computes the PPO anchor, is replayed in the updates (only when there is such a pass: train.mini_batches x train.epochs > 1). none: the trainer routes every token itself.")
    aux_loss_coef: float = Field(0.0, ge=0.0, description="Load-balancing loss (Switch/transformers': experts x sum over experts of token share x mean router probability, per layer, averaged over layers) added to the policy loss with this coefficient. 0 (the default, as the large-MoE RL recipes run): off.")
    measure_unreplayed: bool = Field(False, description="With routing replay on, also run each micro-batch once without replay (no gradient) to report the engine/trainer log-prob mismatch the replay removed (moe/logprob_abs_diff_unreplayed): one more forward per micro-batch.")


class TrainConfig(_Section):
    steps: int = Field(60, ge=1, description="Training steps (one rollout batch each).")
    lr: float = Field(3e-4, gt=0.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up over this many optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warm-up: constant, or cosine decay to min_lr_ratio × lr at the last step.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Floor of the cosine schedule, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one micro-batch (padded tokens); micro-batches are derived from it.")
    mixed_precision: bool = Field(False, description="Compute forward and backward in bfloat16 over float32 master weights and optimizer state (FSDP2's MixedPrecisionPolicy with float32 gradient reduction when sharded, torch.autocast otherwise); needs model.dtype=float32. Log-probs, losses and the entropy stay float32.")
    attention: Literal["auto", "sdpa", "eager"] = Field("auto", description="The trainer's attention (transformers' attn_implementation): sdpa (torch's scaled_dot_product_attention), eager (matmuls and a float32 softmax), or auto: eager with train.mixed_precision on a CPU, sdpa otherwise. On a CPU, torch's fused attention backward in bfloat16 took 4.5x its float32 time on the default job, more than the bfloat16 matmuls saved; eager runs its matmuls in bfloat16 too (docs/algorithms.md, Mixed precision).")
    packing: bool = Field(False, description="Pack each micro-batch's sequences into rows as long as its longest (first-fit decreasing), each sequence at its own positions from 0, attention kept within it: the padding the plain path computes on is skipped. The same loss and gradient as the padded path up to float summation order (tests/test_packing.py). The critic stays padded.")
    share_prompts: bool = Field(False, description="Compute a prompt once for all the sequences of a micro-batch that open with it (a GRPO group's samples): each sequence's own tokens attend to the one copy through a 4-D attention mask, and its gradient is the sum of what the copies would have received. The same loss and gradient as the padded path up to float summation order (tests/test_packing.py); a group longer than the model's hidden size (or the batch's longest sequence, if longer) is laid out as several units, each with the prompt, so that the attention over a row stays cheap (docs/algorithms.md). Text models, sdpa or eager attention; the critic stays padded.")
    activation_checkpointing: bool = Field(False, description="Recompute each transformer block's activations in the backward pass instead of keeping them (transformers' gradient checkpointing, non-reentrant): activation memory of about one block instead of all, for about one more forward pass of compute (not measured here yet). The same gradients (tests/test_trainer.py).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (peft) instead of full fine-tuning; off at rank 0.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="The trainer ranks' device mesh: data-parallel replicas and shards, tensor parallelism (docs/parallel.md). Default: FSDP2 over every rank.")
    logprob_chunk_tokens: int = Field(512, ge=1, description="Log-probs and entropy are computed from the output head this many tokens at a time (their logits recomputed in the backward pass), so memory holds chunk x vocabulary logits, never tokens x vocabulary (tidal/trainer/parallel/logprob.py).")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch; the global batch must divide evenly.")
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    moe: MoeConfig = Field(default_factory=MoeConfig, description="Mixture-of-experts models: routing replay and the balancing loss (docs/moe.md).")
    max_nonfinite_steps: int = Field(3, ge=1, description="The run stops (exit code 3, its last checkpoint intact) after this many steps in a row with a non-finite gradient (NaN or inf: such an update is skipped, `skipped_step` in the metrics), rather than skipping forever.")

    @model_validator(mode="after")
    def _ep_without_lora(self) -> TrainConfig:
        if self.parallel.ep > 1 and self.lora.rank > 0:
            raise ValueError(f"train.parallel.ep={self.parallel.ep} with train.lora: adapters on expert-parallel experts "
                             "are not supported; use ep=1 (FSDP) with LoRA")
        return self


class EngineConfig(_Section):
    kind: str = Field("auto", description="Rollout engine: torch (built in), vllm, sglang (a supervised SGLang server; CUDA only, untested), auto: vllm on a GPU box where vLLM is installed, else torch (the choice and its reason are logged; auto never picks sglang); or a dotted or file path to a builder of your own (`my_pkg.engines:build`, called as tidal.engines.factory.build_engine calls the built-in ones).")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in ("auto", "torch", "vllm", "sglang") and not any(c in v for c in ".:/"):
            raise ValueError(f"kind must be auto, torch, vllm, sglang or a path to an engine builder "
                             f"(`my_pkg.engines:build`), got {v!r}")
        return v
    max_batch_size: int = Field(512, ge=1, description="Most sequences the engine decodes at once.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="The engine's parameter dtype; None: model.dtype. bfloat16 engines under a float32 (or mixed-precision) trainer receive the trainer's weights cast at the weight sync; the mismatch metrics (logprob_abs_diff, mismatch_kl) show what it costs and algorithm.is_level corrects it.")
    vllm_mode: Literal["in_process", "server"] = Field("in_process", description="vllm: the engine in this process, or an OpenAI-compatible vLLM server started and supervised by tidal on 127.0.0.1.")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vllm on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vllm on GPU: fraction of GPU memory for weights and KV cache (the rest stays with the trainer when colocated).")
    vllm_start_timeout_s: float = Field(600.0, gt=0.0, description="vllm server mode: most seconds to wait for the server to become healthy.")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size of one engine replica (vllm: tensor_parallel_size, on CPU too: each rank a worker process bound to its share of the cores; sglang: --tp-size, GPU only). Must divide the model's attention heads; each rank holds the slice of every weight that tidal/weightsync/slices.py names. The torch engine is not tensor-parallel (1 only).")
    replicas: int = Field(1, ge=1, description="Engine replicas behind a router (least-loaded, sticky per episode, re-sends a failed replica's requests).")
    max_inflight: int = Field(512, ge=1, description="Router back-pressure: most requests in flight per replica.")
    request_timeout_s: float = Field(600.0, gt=0.0, description="A replica that does not answer a batch within this is marked down and its requests re-sent; also the bound on one vLLM generate call or weight update.")
    partial_rollout: bool = Field(True, description="When new weights arrive during generation (the asynchronous loop): True, in-flight requests pause between decode steps, take the new weights and continue (each token records the version that produced it); False, the update waits until the requests in flight finish on the old weights (new requests wait for the update). The torch engine and vLLM in process (engine.vllm_mode=in_process: the update lands between two engine steps, vLLM recomputes the running requests' KV with the new weights); vLLM's server mode and SGLang finish in-flight requests before an update, and refuse an explicit true.")


class RoleResources(_Section):
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs one actor of this role reserves.")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs one actor of this role reserves (fractions share a GPU).")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources one actor needs, e.g. {node_type_a: 1}: pins the role to nodes that offer them.")


class WeightSyncDeltaConfig(_Section):
    """Delta weight sync (docs/weightsync.md#delta-sync): each engine gets the XOR of the new
    weights with the version it holds, compressed, with a checksum per piece; a full sync when a
    checksum fails, when an engine is new or restarted, and every `full_every` versions. Bit for
    bit the full sync's result. `placement.weight_sync_delta=true` is short for `enabled: true`."""

    enabled: bool = Field(False, description="Send deltas (placement.weight_sync=shard; needs the `delta` extra: pip install 'tidal[delta]'). Off: every sync sends the full bytes, which on fast links is quicker (BENCHMARKS.md, Weight sync at scale).")
    full_every: int = Field(20, ge=1, description="A full sync every this many versions, whatever the checksums say.")
    codec: Literal["zstd", "lz4"] = Field("zstd", description="Compressor of the XOR's byte planes: zstd (smaller) or lz4.")
    level: int = Field(1, ge=-5, le=19, description="Compression level (zstd: 1 is its fast default; lz4: 0 fast, 3+ high-compression mode).")


class PlacementConfig(_Section):
    mode: Literal["local", "ray", "launcher"] = Field("local", description="local: every role in the driver process (breakpoints work). ray: trainer ranks and engine replicas are Ray actors. launcher: `tidal train` started once per trainer rank by torchrun, mpirun or srun, which give the rank and world size; rank 0 runs the controller and the engines (with placement.colocate, each rank one engine), no Ray (docs/clusters.md).")
    address: str | None = Field(None, description="ray: join this running cluster (`ray start --head` printed it, e.g. 10.0.0.1:6379, or 'auto'); None: start a local Ray instance for this run.")
    host: str = Field("127.0.0.1", description="ray, local instance: the address Ray and every service it starts listen on. 127.0.0.1 keeps everything on loopback.")
    ray_temp_dir: str | None = Field(None, description="ray, local instance: Ray's session directory; None: Ray's default (/tmp/ray).")
    trainer_ranks: int = Field(1, ge=1, description="Trainer ranks (ray mode; launcher mode takes the launcher's world size), laid out as train.parallel says: by default FSDP2 over all of them.")
    colocate: bool = Field(False, description="ray or launcher: each trainer rank also hosts one engine replica in its own process (engine.replicas must equal trainer_ranks; under a launcher it is set to the world size; weights move in process). False: engines are their own actors (ray), or live in rank 0's process (launcher).")
    engine_ranks: int = Field(0, ge=0, description="launcher: the last engine_ranks processes the launcher started each host one engine replica and train nothing (engines on ranks, so on nodes, of their own: e.g. torchrun's last node); the others are the trainer ranks, and engine.replicas is set to engine_ranks. Weights reach them by placement.weight_sync: auto = broadcast from trainer rank 0, or disk. 0: the engines are in rank 0, or with placement.colocate in every rank.")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="Ray placement-group strategy for the bundles of trainer ranks and engine replicas.")
    trainer: RoleResources = Field(default_factory=RoleResources, description="Resources of one trainer rank.")
    engine: RoleResources = Field(default_factory=RoleResources, description="Resources of one engine replica (disaggregated).")
    reward_workers: int = Field(0, ge=0, description="ray: Ray actors that run the reward function (task.reward), least-loaded; 0: rewards run in the driver's rollout.")
    reward: RoleResources = Field(default_factory=RoleResources, description="Resources of one reward worker.")
    env_workers: int = Field(0, ge=0, description="ray: Ray actors that host the environments (reset/step/close, tools, sandboxes, per-turn rewards), least-loaded per episode; 0: environments run in the driver's rollout. The task's reward functions score in the reward pool either way.")
    env: RoleResources = Field(default_factory=RoleResources, description="Resources of one env worker.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend of trainer ranks and weight broadcast: auto = nccl on GPU, gloo on CPU.")
    weight_sync: Literal["auto", "inprocess", "broadcast", "shard", "slices", "disk"] = Field("auto", description="How new weights reach engines: auto = inprocess when local or colocated, else (engine.tensor_parallel > 1) shard for vLLM without LoRA and slices otherwise, else broadcast; shard = every trainer rank sends its own shards' pieces straight to the engine ranks by a transfer plan (no gather; each worker of a tensor-parallel vLLM engine is an engine rank receiving only its slices); slices = trainer rank 0 sends each rank of a tensor-parallel engine only its slices of each weight (tidal/weightsync/sliced.py); disk = safetensors under weight_sync_dir (a filesystem every node sees).")
    weight_sync_dir: str | None = Field(None, description="disk transport: directory shared by trainer and engines; None: <run dir>/weights.")
    weight_sync_bucket_mb: float = Field(256.0, gt=0.0, description="broadcast transport: size of one flat bucket.")
    weight_sync_checksum: bool = Field(False, description="Verify every sync: engines checksum what arrived against the trainer's checksum.")
    weight_sync_delta: WeightSyncDeltaConfig = Field(default_factory=WeightSyncDeltaConfig, description="Delta weight sync (placement.weight_sync=shard): send only what changed since the version each engine holds.")
    call_timeout_s: float = Field(600.0, gt=0.0, description="Bound on one remote call (a trainer step, a weight sync); past it the role is reported hung, with role, call and step.")
    collective_timeout_s: float = Field(600.0, gt=0.0, description="Bound on one torch.distributed collective of trainer ranks and weight broadcast.")
    start_timeout_s: float = Field(300.0, gt=0.0, description="Bound on starting Ray and placing every role (placement groups ready).")
    ping_s: float = Field(30.0, gt=0.0, description="An env worker with a call pending this long is pinged; one that does not answer the ping within as long is hung (stopped, deadlocked): killed and replaced as a dead one is (run.max_restarts).")
    restart_engines: bool = Field(True, description="A dead engine replica is restarted, given the current weights, and takes requests again.")
    engine_bootstrap: Literal["trainer", "peer"] = Field("trainer", description="Where a restarted engine replica takes its weights: trainer = at the next weight sync, with the others; peer = before the next rollout, from a live replica at the version it serves (tidal/weightsync/peer.py; the trainer not involved), falling back to the trainer where no peer keeps a readable copy (a vLLM-CPU replica only on placement.weight_sync=shard). Needs placement.mode=ray with engine actors of their own and placement.restart_engines.")

    @field_validator("weight_sync_delta", mode="before")
    @classmethod
    def _delta_flag(cls, v: Any) -> Any:
        return {"enabled": v} if isinstance(v, bool) else v


class GatewayConfig(_Section):
    enabled: bool | None = Field(None, description="Serve the policy being trained through the OpenAI-compatible gateway during the run (tidal/runtime/gateway.py). None: only when the task runs agents (task.env=openai_agent).")
    host: str = Field("127.0.0.1", description="Address the gateway binds. Off loopback every call needs the token (gateway.token, or a random one written to <run dir>/gateway.json, readable by the owner only).")
    port: int = Field(0, ge=0, le=65535, description="Port (0: a free one; the URL is logged and written to <run dir>/gateway.json).")
    token: str | None = Field(None, description="Bearer token every call must carry; None: none on loopback, a random one elsewhere. Agents of the run are given it as their API key.")
    model_name: str | None = Field(None, description="Model name served at /v1/models; None: the model directory's name. Calls under a session (an agent episode) may name any model.")
    max_tokens: int = Field(256, ge=1, description="max_tokens of a call outside a session that gives none (in a session: rollout.max_new_tokens).")
    max_model_len: int | None = Field(None, ge=1, description="Longest context (prompt + completion) a call may use; None: the model's max_position_embeddings. Beyond it a call is refused (context_length_exceeded).")


class RunConfig(_Section):
    dir: str | None = Field(None, description="Run directory; default runs/<name>-<time>.")
    name: str = Field("arith-grpo", description="Run name.")
    seed: int = Field(0, description="Seed of data order, sampling and initialization.")
    save_every: int = Field(20, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept.")
    eval_every: int = Field(10, ge=0, description="Held-out greedy accuracy (eval.n problems) every N steps (0: off).")
    write_episodes: bool = Field(True, description="Write every step's episodes to Parquet.")
    progress: bool = Field(True, description="Show a progress bar.")
    threads: int = Field(0, ge=0, description="torch intra-op threads (0: torch's default).")
    max_restarts: int = Field(3, ge=0, description="ray: how many times in a run a dead env worker is replaced (each logged; past it, its episodes keep failing typed until the failure budget stops the run), and how many times a lost trainer rank restarts every role from the last checkpoint (tidal/runtime/recovery.py; each an event in RUN/events.jsonl; past it, the run stops naming the rank).")
    trace: bool = Field(False, description="Spans of every role and process (generate, env step, reward, forward/backward, optimizer, sync, save, eval) in Chrome's trace format: RUN/trace.json, for Perfetto (docs/observability.md#traces).")
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Where each step's metrics go, several at once (docs/observability.md). metrics.jsonl is always written; tensorboard, wandb and mlflow need their extra (pip install 'tidal[tensorboard]').")
    log_samples: int = Field(0, ge=0, description="Every log_samples_every steps, a table of this many of the step's episodes (prompt, response, reward, status) on the console and in every logger with tables; 0: off.")
    log_samples_every: int = Field(10, ge=1, description="Steps between two sample tables (run.log_samples).")
    tensorboard_dir: str | None = Field(None, description="tensorboard: the event files' directory; default RUN/tensorboard.")
    wandb_project: str = Field("tidal", description="wandb: the W&B project.")
    wandb_entity: str | None = Field(None, description="wandb: the W&B entity (team or user); None: the account's default.")
    wandb_mode: Literal["auto", "online", "offline"] = Field("auto", description="wandb: auto is online when this machine is logged in to W&B (WANDB_API_KEY or `wandb login`), else offline (files under RUN/wandb for `wandb sync`).")
    mlflow_tracking_uri: str | None = Field(None, description="mlflow: the tracking URI (a server, or sqlite:///path.db); None: MLflow's default (MLFLOW_TRACKING_URI, else ./mlflow.db).")
    mlflow_experiment: str = Field("tidal", description="mlflow: the experiment the run is logged under.")

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, v: list[str]) -> list[str]:
        problems = [f"{name} needs the `{SINK_EXTRAS[name][0]}` package: pip install 'tidal[{SINK_EXTRAS[name][1]}]'"
                    for name in v if name in SINK_EXTRAS and importlib.util.find_spec(SINK_EXTRAS[name][0]) is None]
        if problems:
            raise ValueError("; ".join(problems))
        return list(dict.fromkeys(v))


class EvalConfig(_Section):
    n: int = Field(500, ge=1, description="Held-out problems evaluated.")
    k: int = Field(8, ge=1, description="Samples per problem for pass@k.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the pass@k samples.")
    reward: str | None = Field(None, description="The reward held-out evaluation measures accuracy with (its `correct` part), as a dotted or file path, e.g. the task's verifier when training on a reward model or a judge; None: the task's own rewards.")
    reward_form: Literal["tidal", "trl", "verl"] = Field("tidal", description="The calling convention of eval.reward, as task.reward_form: tidal, trl or verl (accuracy from its `correct` part, veRL's `acc`, or, for a TRL function, its float when eval.reward's function is named `correct`).")
    at_start: bool = Field(False, description="With run.eval_every > 0: evaluate the starting weights before step 1 too (a metrics.jsonl line of step 0).")
    k_every: int = Field(0, ge=0, description="Every N steps also sampled: eval/pass_at_k and eval/pass_at_1 with eval.k samples per problem at eval.temperature (0: off; k×n generations, costly).")
    sets: dict[str, str] = Field(default_factory=dict, description="More held-out sets, name → dataset (JSONL, Parquet or HF datasets dir, with the task's columns): eval/<name>/accuracy at every evaluation, on at most eval.n rows each.")
    keep_best: str | None = Field(None, description="Keep the checkpoint of the best value of this metric (e.g. eval/accuracy) as the run's best: saved at the evaluation that reached it, never pruned, named in RUN/checkpoints/best.json.")
    best_mode: Literal["max", "min"] = Field("max", description="keep_best: whether higher (max) or lower (min) is better.")


class AlertsConfig(_Section):
    """Health alerts (tidal/monitor/alerts.py; docs/observability.md#health-alerts)."""

    enabled: bool = Field(True, description="Health alerts: each an event in RUN/events.jsonl, a warning on the console and in train.log, and `alerts/<name>` in the metrics of its step.")
    stop_on: list[str] = Field(default_factory=list, description="Alerts that stop the run (exit 3, the last checkpoint intact; the alerting step is not checkpointed), e.g. [entropy_collapse, kl_spike].")
    warmup_steps: int = Field(5, ge=1, description="Steps before the rules that compare with the run's own past apply (their baseline).")
    window: int = Field(20, ge=2, description="Steps of the recent median that spikes and jumps are measured against.")
    entropy_collapse_ratio: float = Field(0.2, gt=0, lt=1, description="entropy_collapse: entropy below this fraction of its warm-up mean...")
    entropy_collapse_reward_margin: float = Field(0.05, ge=0, description="...while the recent reward is at most this much above its warm-up mean.")
    kl_spike_factor: float = Field(10.0, gt=1, description="kl_spike: kl over this many times its recent median...")
    kl_spike_min: float = Field(0.01, ge=0, description="...and over this (nats/token).")
    grad_norm_spike_factor: float = Field(10.0, gt=1, description="grad_norm_spike: grad_norm over this many times its recent median of nonzero norms...")
    grad_norm_spike_min: float = Field(10.0, ge=0, description="...and over this, 10x the default train.grad_clip (measured: the default job's norm reaches 4.1 at 8 prompts a step as most groups stop carrying signal; 10 leaves room for another CPU's trajectory).")
    mismatch_growth_factor: float = Field(10.0, gt=1, description="mismatch_growth: mismatch_kl over this many times its warm-up mean...")
    mismatch_min: float = Field(0.001, ge=0, description="...and over this (nats/token).")
    expert_collapse_low: float = Field(0.05, gt=0, lt=1, description="expert_collapse: a mixture of experts' expert receiving under this fraction of its layer's mean share of tokens (moe/share_min/l<i>; the mean is k / experts)...")
    expert_collapse_high: float = Field(0.9, gt=0, le=1, description="...or any expert receiving over this fraction of the tokens (moe/share_max/l<i>).")
    failure_jump: float = Field(0.2, gt=0, le=1, description="failure_rate_jump: episodes/failed_frac over its recent median plus this.")
    tool_error_jump: float = Field(0.2, gt=0, le=1, description="tool_error_rate_jump: tools/error_rate over its recent median plus this.")
    throughput_drop_ratio: float = Field(0.2, gt=0, lt=1, description="throughput_drop: tokens_per_s under this fraction of its recent median...")
    throughput_drop_steps: int = Field(3, ge=1, description="...for this many steps in a row.")
    no_signal_steps: int = Field(10, ge=1, description="no_learning_signal: every group's rewards equal (groups/zero_std_frac = 1: no advantage, no gradient) for this many steps in a row.")
    hacking_kinds: list[str] = Field(default_factory=lambda: ["divergence", "part_dominance", "verifier_errors", "judge_disagreement"], description="Reward-hacking monitor events that are alerts (divergence as reward_up_eval_down, the others as reward_hacking). length_correlation is left out by default: it fires on the healthy default job (measured: Spearman r 0.57-0.70 between the format part and length, in 4 and 15 steps of two 60-step runs); its events stay in hacking_events.jsonl and the metrics.")

    @field_validator("hacking_kinds")
    @classmethod
    def _known_kinds(cls, v: list[str]) -> list[str]:
        return _only_known(v, HACKING_KINDS, "hacking monitor(s)")

    @field_validator("stop_on")
    @classmethod
    def _known_alerts(cls, v: list[str]) -> list[str]:
        return _only_known(v, ALERTS, "alert(s)")


def _only_known(values: list[str], known: tuple[str, ...], what: str) -> list[str]:
    unknown = [x for x in values if x not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; they are {list(known)}")
    return values


class TidalConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)

    def engine_dtype(self) -> str:
        """The engines' parameter dtype: engine.dtype, else model.dtype."""
        return self.engine.dtype or self.model.dtype

    @model_validator(mode="after")
    def _derived(self) -> TidalConfig:
        if "greedy_baseline" in BUILTIN_NEEDS.get(self.algorithm.advantage, ()) and self.rollout.temperature == 0:
            raise ValueError(f"algorithm.advantage={self.algorithm.advantage} compares samples with the greedy response: rollout.temperature must be > 0")
        if self.algorithm.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} must be below rollout.max_new_tokens={self.rollout.max_new_tokens}")
        _check_placement(self)
        if self.train.mixed_precision and self.model.dtype != "float32":
            raise ValueError(f"train.mixed_precision keeps float32 master weights: model.dtype must be float32 "
                             f"(got {self.model.dtype}); engine.dtype sets the engine's own")
        _check_engine(self)
        _check_moe(self)
        if self.rollout.global_batch % self.train.mini_batches:
            raise ValueError(
                f"train.mini_batches={self.train.mini_batches} does not divide the global batch "
                f"{self.rollout.global_batch} (rollout.prompts_per_step × rollout.samples_per_prompt)"
            )
        return self

    @property
    def loss_norm_len(self) -> int:
        return self.algorithm.loss_norm_len or self.rollout.max_new_tokens

    @property
    def mini_batch_size(self) -> int:
        return self.rollout.global_batch // self.train.mini_batches


def _check_placement(cfg: TidalConfig) -> None:
    """Placement and weight-sync settings that cannot work together (TidalConfig._derived)."""
    pl = cfg.placement
    if pl.mode == "launcher":
        _check_launcher(pl)
    elif pl.engine_ranks:
        raise ValueError(f"placement.engine_ranks={pl.engine_ranks} needs placement.mode=launcher (under ray the "
                         "engines are actors of their own: placement.colocate=false)")
    if pl.mode == "local" and pl.trainer_ranks > 1:
        raise ValueError(f"placement.trainer_ranks={pl.trainer_ranks} needs placement.mode=ray (local mode runs one trainer in the driver)")
    if pl.mode == "local" and pl.env_workers:
        raise ValueError(f"placement.env_workers={pl.env_workers} needs placement.mode=ray (local mode runs environments in the driver)")
    if pl.mode == "local" and pl.reward_workers:
        raise ValueError(f"placement.reward_workers={pl.reward_workers} needs placement.mode=ray (local mode scores rewards in the driver)")
    if pl.mode == "local" and pl.colocate:
        raise ValueError("placement.colocate applies to placement.mode=ray or launcher (local mode is always colocated)")
    if pl.mode != "launcher" or "trainer_ranks" in pl.model_fields_set:  # launcher: its world size, once known
        cfg.train.parallel.degrees(pl.trainer_ranks)  # raises naming the degrees and their product
    if pl.colocate and cfg.engine.replicas != pl.trainer_ranks and (
            pl.mode != "launcher" or "trainer_ranks" in pl.model_fields_set):  # launcher: checked once its size is known
        raise ValueError(f"placement.colocate: engine.replicas={cfg.engine.replicas} must equal placement.trainer_ranks={pl.trainer_ranks} (one replica per rank)")
    if pl.mode == "local" and pl.weight_sync in ("broadcast", "shard", "slices"):
        raise ValueError(f"placement.weight_sync={pl.weight_sync} needs placement.mode=ray (local mode moves weights in process)")
    if pl.colocate and pl.weight_sync == "slices":
        raise ValueError("placement.weight_sync=slices sends to engine actors: it needs placement.colocate=false")
    if pl.weight_sync == "shard" and pl.colocate:
        raise ValueError("placement.weight_sync=shard sends to engine actors of their own; colocated engines "
                         "(placement.colocate) take the weights in process")
    if pl.weight_sync == "shard" and cfg.train.lora.rank > 0:
        raise ValueError("placement.weight_sync=shard sends the trainer's own shards; with LoRA the engines get merged "
                         "weights: use placement.weight_sync=broadcast")
    if pl.engine_bootstrap == "peer" and (pl.mode != "ray" or pl.colocate or not pl.restart_engines):
        raise ValueError("placement.engine_bootstrap=peer restarts engine actors of their own: it needs "
                         "placement.mode=ray, placement.colocate=false and placement.restart_engines=true")
    if pl.engine_bootstrap == "peer" and importlib.util.find_spec("xxhash") is None:
        raise ValueError("placement.engine_bootstrap=peer checksums every piece with xxhash: pip install 'tidal[delta]'")
    if pl.weight_sync_delta.enabled:
        if pl.weight_sync != "shard":
            raise ValueError(f"placement.weight_sync_delta needs placement.weight_sync=shard (got {pl.weight_sync})")
        missing = [m for m in ("zstandard", "lz4", "xxhash") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"placement.weight_sync_delta needs {', '.join(missing)}: pip install 'tidal[delta]'")


def _check_engine(cfg: TidalConfig) -> None:
    """Engine settings that cannot work are refused here, before anything loads."""
    eng, pl = cfg.engine, cfg.placement
    if "partial_rollout" in eng.model_fields_set and eng.partial_rollout and (
            eng.kind == "sglang" or (eng.kind == "vllm" and eng.vllm_mode == "server")):
        raise ValueError(f"engine.partial_rollout=true: engine.kind={eng.kind}"
                         + (" with engine.vllm_mode=server" if eng.kind == "vllm" else "")
                         + " finishes the requests in flight before a weight update (it cannot tell which version "
                         "sampled which token); use the torch engine or engine.vllm_mode=in_process, or set it false")
    if pl.mode in ("local", "launcher") and cfg.engine.kind == "vllm" and cfg.engine.vllm_mode == "in_process" \
            and cfg.engine.replicas > 1 and not pl.colocate and not pl.engine_ranks:
        raise ValueError(f"engine.replicas={cfg.engine.replicas} with engine.vllm_mode=in_process: one process "
                         "holds one in-process vLLM engine; use engine.vllm_mode=server (or placement.mode=ray)")
    if cfg.engine.tensor_parallel > 1 and (cfg.engine.kind == "torch" or (
            cfg.engine.kind == "auto" and not cfg.model.resolved_device().startswith("cuda"))):
        raise ValueError(f"engine.tensor_parallel={cfg.engine.tensor_parallel}: the torch engine (engine.kind="
                         f"{cfg.engine.kind}) runs one process per replica; use engine.kind=vllm (vLLM-CPU runs "
                         "tensor-parallel on CPU too) or sglang")
    if cfg.engine.kind == "sglang" and not cfg.model.resolved_device().startswith("cuda"):
        raise ValueError(f"engine.kind=sglang needs a CUDA GPU (SGLang has no CPU kernels); model.device "
                         f"resolves to {cfg.model.resolved_device()!r}")
    if pl.mode == "ray" and cfg.engine.kind == "vllm" and cfg.engine.vllm_mode == "server":
        raise ValueError("engine.vllm_mode=server with placement.mode=ray: each engine actor runs vLLM in process; use engine.vllm_mode=in_process")
    if (cfg.rollout.prefix_policy == "split" and "values" in BUILTIN_NEEDS.get(cfg.algorithm.advantage, ())
            and cfg.rollout.max_turns > 1):
        raise ValueError(f"rollout.prefix_policy=split with algorithm.advantage={cfg.algorithm.advantage}: a critic cannot value a segment "
                         "apart from its episode; use rollout.prefix_policy=continue")


def _check_moe(cfg: TidalConfig) -> None:
    """Mixture-of-experts settings against the rest (that model.path is a mixture of experts is checked
    when it is resolved: tidal/runtime/assemble.py)."""
    moe = cfg.train.moe
    if moe.routing_replay != "none" and cfg.train.parallel.cp > 1:
        raise ValueError(f"train.moe.routing_replay={moe.routing_replay} with train.parallel.cp={cfg.train.parallel.cp}: "
                         "replay is not laid out over context-parallel slices yet; use cp=1")
    if moe.routing_replay != "none" and cfg.train.activation_checkpointing:
        raise ValueError(f"train.moe.routing_replay={moe.routing_replay} with train.activation_checkpointing: the "
                         "recomputed forward would route without the replayed experts; turn one off")
    if moe.routing_replay == "R3" and cfg.engine.kind not in ("auto", "torch"):
        raise ValueError(f"train.moe.routing_replay=R3 needs an engine that records the experts it chose: the torch "
                         f"engine (engine.kind={cfg.engine.kind} does not: vLLM 0.32 returns them only from its V2 "
                         "model runner, which needs Triton, and tidal does not read them yet; docs/moe.md)")


def _check_launcher(pl: PlacementConfig) -> None:
    """placement.mode=launcher has no Ray: the roles that only Ray places are refused by key."""
    for key, value in (("reward_workers", pl.reward_workers), ("env_workers", pl.env_workers),
                       ("address", pl.address)):
        if value:
            raise ValueError(f"placement.{key}={value!r} needs placement.mode=ray (placement.mode=launcher runs no Ray: "
                             "rank 0 hosts the rewards and the environments)")
    if pl.engine_ranks:
        if pl.colocate:
            raise ValueError(f"placement.engine_ranks={pl.engine_ranks} with placement.colocate: the engines are either "
                             "in every rank (colocate) or on ranks of their own (engine_ranks), not both")
        if pl.weight_sync not in ("auto", "broadcast", "disk"):
            raise ValueError(f"placement.weight_sync={pl.weight_sync} with placement.engine_ranks: weights reach engine "
                             "ranks by broadcast (auto) or disk")
    elif pl.weight_sync not in ("auto", "inprocess"):
        raise ValueError(f"placement.weight_sync={pl.weight_sync}: placement.mode=launcher moves weights in process "
                         "(auto or inprocess): into rank 0's engines, or with placement.colocate each rank's own; "
                         "broadcast or disk need engines on ranks of their own (placement.engine_ranks)")


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
