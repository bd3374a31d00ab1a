"""The planner's input (`tidal plan SPEC.yaml`): the model, the cluster, the workload, one placement, the
cost model's efficiencies, failures and the search space, as typed pydantic sections validated before
anything is simulated (a bad key is named). The choice: one spec describes both a run to simulate
(`placement`) and the space the planner searches around it (`search`), so a plan the search prints is
the same spec with its placement replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _S(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_S):
    params_b: float = Field(..., gt=0, description="Total parameters, billions.")
    active_params_b: float | None = Field(None, gt=0, description="Parameters a token uses (MoE), billions; None: dense.")
    layers: int = Field(..., ge=1, description="Transformer blocks.")
    hidden: int = Field(..., ge=1, description="Hidden size.")
    kv_heads: int = Field(8, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int = Field(128, ge=1, description="Dimension of one attention head.")
    experts: int = Field(0, ge=0, description="Routed experts per MoE layer (0: dense).")
    top_k: int = Field(0, ge=0, description="Experts each token is routed to.")
    dtype_bytes: int = Field(2, ge=1, description="Bytes of one weight as the engines hold and receive it (2: bf16, 1: fp8).")

    @property
    def active_b(self) -> float:
        return self.active_params_b or self.params_b

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16 cache

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.active_b > self.params_b:
            raise ValueError(f"model.active_params_b={self.active_b} exceeds model.params_b={self.params_b}")
        if (self.experts > 0) != (self.top_k > 0) or self.top_k > self.experts:
            raise ValueError("model.experts and model.top_k: both 0 (dense) or 0 < top_k <= experts")
        return self


class ClusterSpec(_S):
    gpu: str = Field("H100", description="Accelerator kind, a key of tidal.plan.hardware.ACCELERATORS.")
    gpus: int = Field(..., ge=1, description="GPUs in the cluster.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs of one node (NVLink domain).")
    network: Literal["ib", "roce", "ethernet_100g", "ethernet_400g"] = Field("ib", description="Links between nodes: one InfiniBand/RoCE NIC per GPU at the accelerator's rate, or Ethernet of the named rate per node shared by its GPUs.")
    accelerator: dict[str, float] = Field(default_factory=dict, description="Fields of the accelerator replaced (e.g. a calibrated CPU's bf16_flops, hbm_bw).")
    storage_bw_gbs: float = Field(10.0, gt=0, description="Shared filesystem bandwidth, GB/s (checkpoints, disk weight sync).")


class LengthSpec(_S):
    kind: Literal["lognormal", "geometric", "fixed", "parquet"] = Field("lognormal", description="Response lengths per turn: lognormal (long-tailed), geometric, fixed, or sampled from a run's episode store (path).")
    mean: float = Field(1024, gt=0, description="Mean generated tokens per turn (lognormal, geometric, fixed).")
    sigma: float = Field(1.0, ge=0, description="lognormal: sigma of the log (1.0: p99 about 10x the median).")
    max: int = Field(8192, ge=1, description="Token budget of one turn (rollout.max_new_tokens): longer ones are truncated.")
    path: str | None = Field(None, description="parquet: a run's episodes/ directory or one step file.")


class WorkloadSpec(_S):
    prompts_per_step: int = Field(512, ge=1, description="Prompts per training step (rollout.prompts_per_step).")
    samples_per_prompt: int = Field(16, ge=1, description="Episodes per prompt (rollout.samples_per_prompt).")
    prompt_tokens: int = Field(512, ge=1, description="Tokens of a prompt.")
    lengths: LengthSpec = Field(default_factory=LengthSpec, description="Generated tokens per policy turn.")
    turns: int = Field(1, ge=1, description="Policy turns per episode (multi-turn, tools).")
    obs_tokens: int = Field(0, ge=0, description="Tokens an environment adds between turns (tool output), prefilled.")
    env_latency_s: float = Field(0.0, ge=0, description="Mean seconds of one environment step between turns (tool call, sandbox).")
    env_concurrency: int = Field(8, ge=1, description="Environment steps one env worker runs at once.")
    reward_s: float = Field(0.0, ge=0, description="Seconds of one episode's reward on one reward worker.")
    prefix_sharing: bool = Field(True, description="A group's prompt is prefilled once per engine replica (prefix cache).")
    uninformative_frac: float = Field(0.0, ge=0, lt=1, description="DAPO dynamic sampling: share of groups whose rewards are all equal (dropped and refilled); 0: dynamic sampling off.")
    max_sampling_rounds: int = Field(4, ge=1, description="DAPO: most sampling rounds per step.")


class PlacementSpec(_S):
    trainer_gpus: int = Field(8, ge=1, description="GPUs that train (the whole cluster when colocated).")
    engine_gpus: int = Field(8, ge=0, description="GPUs that generate (ignored when colocated: the trainer's GPUs).")
    engine_tp: int = Field(1, ge=1, description="Tensor-parallel degree of one engine replica.")
    engine_ep: int = Field(1, ge=1, description="Expert-parallel degree of one engine replica (its GPUs = tp x ep).")
    train_tp: int = Field(1, ge=1, description="Trainer tensor-parallel degree.")
    train_cp: int = Field(1, ge=1, description="Trainer context-parallel degree.")
    train_ep: int = Field(1, ge=1, description="Trainer expert-parallel degree, borrowed from the data-parallel ranks (tidal's train.parallel.ep; tidal's does not combine with tp or cp, a spec may, to model another trainer).")
    colocate: bool = Field(False, description="Trainer and engines share the GPUs and take turns (sleep/wake).")
    max_staleness: int = Field(0, ge=0, description="rollout.max_staleness k: step s starts once the engines hold version s-1-k.")
    rollout_mode: Literal["step", "stream"] = Field("step", description="step: tidal's loop, a step's rollout lasts until its longest response and the next step's requests join after it; stream: engines never wait for a step's tail (AReaL-style), a what-if tidal does not run.")
    env_workers: int = Field(0, ge=0, description="Env workers (0: environments in the driver, one worker's worth).")
    reward_workers: int = Field(0, ge=0, description="Reward workers (0: rewards in the driver, one worker's worth).")
    sync: Literal["broadcast", "slices", "shard", "delta", "disk", "inprocess"] = Field("broadcast", description="Weight-sync transport (tidal.plan.sync_model), each one of tidal's placement.weight_sync: broadcast (gather + rank-0 broadcast of the whole model), slices (gather, then rank 0 sends each tensor-parallel engine rank only its slices), shard (the transfer plan: no gather), delta (shard with placement.weight_sync_delta: changed bytes only), disk, inprocess (colocated).")

    delta_fraction: float = Field(0.25, gt=0, le=1, description="sync=delta: the delta's bytes as a share of the full bytes (tidal's XOR + zstd per byte plane: 0.27 in bfloat16 and 0.63 in float32 on the default job, BENCHMARKS.md; an RL step of a large model at a small learning rate leaves more bf16 values unchanged).")

    @property
    def engine_gpus_per_replica(self) -> int:
        return self.engine_tp * self.engine_ep


class Efficiency(_S):
    """Fractions of the accelerator's peaks that each kind of work reaches: stated, or calibrated."""
    mfu_train: float = Field(0.4, gt=0, le=1, description="Training FLOP/s over peak.")
    mfu_prefill: float = Field(0.5, gt=0, le=1, description="Prefill FLOP/s over peak.")
    mfu_decode: float = Field(0.5, gt=0, le=1, description="Decode matmul FLOP/s over peak (large batches).")
    hbm: float = Field(0.7, gt=0, le=1, description="HBM bandwidth reached by a decode step.")
    link: float = Field(0.8, gt=0, le=1, description="Link bandwidth reached by collectives and transfers.")
    comm_overlap: float = Field(0.7, ge=0, le=1, description="Share of the trainer's data-parallel communication hidden under compute.")
    decode_overhead_s: float = Field(0.0, ge=0, description="Fixed seconds per decode iteration (scheduling, launches).")
    train_overhead_s: float = Field(0.0, ge=0, description="Fixed seconds per training step.")
    rollout_overhead_s: float = Field(0.0, ge=0, description="Fixed seconds per rollout round (scheduling, scoring, the driver's own work; calibrated on a CPU run).")
    sync_overhead_s: float = Field(0.5, ge=0, description="Fixed seconds per weight sync (pause, engine reload, control).")
    kv_mem_frac: float = Field(0.9, gt=0, le=1, description="Share of an engine GPU's memory for weights and KV cache.")
    train_bytes_per_param: float = Field(18.0, gt=0, description="Trainer memory per parameter (bf16 weights, fp32 master, grads, Adam).")
    micro_batch_tokens: int = Field(16384, ge=1, description="Tokens per GPU per micro-batch (activation memory).")
    max_batch: int = Field(512, ge=1, description="Most sequences one engine replica decodes at once (engine.max_batch_size).")


class FailureSpec(_S):
    node_mtbf_h: float | None = Field(None, gt=0, description="Mean hours between failures of one node; None: no failures.")
    restart_s: float = Field(300.0, ge=0, description="Seconds to restart every role after a failure (scheduling, model loading).")
    save_every: int = Field(50, ge=1, description="Steps between checkpoints (run.save_every): a failure loses the steps since the last.")
    max_failures: int = Field(1000, ge=1, description="The simulation stops with an error past this many failures (a run whose checkpoints come slower than its failures never ends).")
    checkpoint_s: float | None = Field(None, ge=0, description="Seconds a checkpoint takes; None: the trainer state over the shared filesystem.")


class SimSpec(_S):
    steps: int = Field(200, ge=1, description="Training steps to simulate.")
    warmup_steps: int = Field(2, ge=0, description="Steps left out of the throughput window.")
    seed: int = Field(0, description="Seed of the sampled lengths, latencies and failures.")
    chunks: int = Field(64, ge=1, description="Decode iterations are simulated in at most this many chunks per turn (speed against resolution).")


class SearchSpec(_S):
    max_staleness: list[int] = Field(default_factory=lambda: [0, 1, 2], description="k values tried.")
    trainer_fractions: list[float] = Field(default_factory=lambda: [0.25, 0.375, 0.5, 0.625, 0.75], description="Shares of the GPUs that train (disaggregated).")
    colocate: list[bool] = Field(default_factory=lambda: [False, True], description="Colocated or not.")
    engine_tp: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], description="Engine TP degrees tried.")
    train_tp: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], description="Trainer TP degrees tried.")
    sync: list[str] = Field(default_factory=lambda: ["broadcast", "shard"], description="Sync transports tried (disaggregated).")
    reward_workers: list[int] = Field(default_factory=lambda: [0], description="Reward worker counts tried.")
    env_workers: list[int] = Field(default_factory=lambda: [0], description="Env worker counts tried.")
    steps: int = Field(30, ge=2, description="Steps simulated per candidate plan.")
    top: int = Field(5, ge=1, description="Plans printed.")


class PlanSpec(_S):
    model: ModelSpec
    cluster: ClusterSpec
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    efficiency: Efficiency = Field(default_factory=Efficiency)
    failures: FailureSpec = Field(default_factory=FailureSpec)
    sim: SimSpec = Field(default_factory=SimSpec)
    search: SearchSpec = Field(default_factory=SearchSpec)

    @model_validator(mode="after")
    def _fits(self) -> PlanSpec:
        p, n = self.placement, self.cluster.gpus
        used = p.trainer_gpus if p.colocate else p.trainer_gpus + p.engine_gpus
        if used > n:
            raise ValueError(f"placement uses {used} GPUs (trainer_gpus + engine_gpus) of cluster.gpus={n}")
        engines = p.trainer_gpus if p.colocate else p.engine_gpus
        if engines % p.engine_gpus_per_replica:
            raise ValueError(f"placement: {engines} engine GPUs are not a multiple of a replica's "
                             f"engine_tp x engine_ep = {p.engine_gpus_per_replica}")
        return self


class PlanSpecError(ValueError):
    pass


def load_spec(path: str | Path | None = None, data: dict | None = None) -> PlanSpec:
    """A validated spec from a YAML file (or a dict); errors name the file and the key."""
    where = str(path) if path else "spec"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise PlanSpecError(f"{where}: no such file")
        data = yaml.safe_load(p.read_text()) or {}
    try:
        return PlanSpec.model_validate(data or {})
    except ValidationError as e:
        lines = [f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors()]
        raise PlanSpecError(f"{where}: " + "; ".join(lines)) from None
