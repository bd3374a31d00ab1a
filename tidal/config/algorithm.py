"""Config sections of the RL algorithm: advantage estimator, policy loss, KL, importance
weights and rejection, DAPO's filters, and the critic that `gae` trains.

The choice: the built-in names (estimators, losses, aggregations, KL estimators, IS and
rejection levels) come from tidal.algorithms, so a name the algorithms do not know is refused
when the config is read; an estimator or loss of your own is a path, imported at assembly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.algorithms import AGGREGATIONS, ESTIMATORS, IS_LEVELS, KL_ESTIMATORS, POLICY_LOSSES, REJECTION_LEVELS
from tidal.config.section import Section


class CriticConfig(Section):
    path: str | None = Field(None, description="Critic initialization: an HF model directory; None: the policy's own weights with a fresh value head.")
    lr: float = Field(1e-3, gt=0.0, description="Critic AdamW learning rate (constant after train.warmup_steps).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip of the value update around the pre-update values (PPO2); None: plain squared error.")


class AlgorithmConfig(Section):
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
