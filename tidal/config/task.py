"""Config sections of what a run learns from: the model, the task (environment, dataset,
rewards), how rewards are run, and the rollout's sampling.

The choice: the task names its environment, rewards and agent by a built-in name or a dotted
or file path, checked here for form (and for an adapter's missing package) only; the objects
themselves are imported where the run is assembled.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.config.section import Section
from tidal.importing import adapter_of, check_extra


class ModelConfig(Section):
    path: str = Field("default", description="Local HF model directory, tidal checkpoint, LoRA adapter directory, or a Hugging Face Hub id (`Qwen/Qwen3-0.6B`: downloaded into the Hub cache with a network, read from it offline, as transformers does); 'default' is the embedded tiny model; 'default-vlm', 'default-moe' and 'default-tool' (calls tools from their schemas) the other embedded ones.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of trainer and engine.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto: cuda when a GPU is present, else cpu.")

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


class RewardSpec(Section):
    fn: str = Field(..., description="The reward: a dotted path `pkg.module:function` or a file path `path/to/rewards.py:function`. A class or factory is called with `args` first.")
    form: Literal["tidal", "trl", "verl"] = Field("tidal", description="Calling convention (tidal/rewards/contract.py): tidal `fn(completion, **columns)`, trl `fn(prompts, completions, completion_ids, **columns) -> list`, verl `compute_score(data_source, solution_str, ground_truth, extra_info)`.")
    weight: float = Field(1.0, description="Weight of this reward in the episode's reward.")
    name: str | None = Field(None, description="Name of its part in reward_parts and the metrics; default: the function's name.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a class or factory named by `fn` (e.g. a reward model's path).")


AGENT_ENVS = ("openai_agent", "tidal.envs.openai_agent", "tidal.envs.openai_agent:OpenAIAgentEnv")


class TaskConfig(Section):
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


class RewardConfig(Section):
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


class RolloutConfig(Section):
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
