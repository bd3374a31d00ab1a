"""Config sections of the run around the steps: its directory, checkpoints and loggers,
held-out evaluation, and the health alerts.

The choice: the names the monitors define (`ALERTS`, `HACKING_KINDS`) and the packages the
optional metric sinks import (`SINK_EXTRAS`) are held here, so a config is validated without
importing the monitors, which sit above config in the package order (docs/architecture.md).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from tidal.config.section import Section

# The names of the monitors' parts (tidal/monitor/), held here so that a config is validated
# without importing the monitors: they sit above config in the package order and read these.
ALERTS = ("entropy_collapse", "kl_spike", "grad_norm_spike", "mismatch_growth", "expert_collapse", "staleness_over_bound",
          "failure_rate_jump", "tool_error_rate_jump", "throughput_drop", "no_learning_signal", "reward_up_eval_down",
          "reward_hacking")
HACKING_KINDS = ("divergence", "length_correlation", "part_dominance", "verifier_errors", "judge_disagreement")
# What each optional metric sink (run.loggers) imports, and the extra that installs it.
SINK_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class RunConfig(Section):
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


class EvalConfig(Section):
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


class AlertsConfig(Section):
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
