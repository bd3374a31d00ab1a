"""TidalConfig, the whole configuration: its sections, the batch sizes derived from them, and
the checks that span sections (placement with weight sync, engine with device, MoE with the
trainer's mesh, a launcher's limits).

The choice: every combination that cannot work is refused here, at validation, naming the keys,
before any worker starts or any model loads.
"""

from __future__ import annotations

import importlib.util

from pydantic import Field, model_validator

from tidal.algorithms.advantages import BUILTIN_NEEDS
from tidal.config.algorithm import AlgorithmConfig
from tidal.config.placement import EngineConfig, GatewayConfig, PlacementConfig
from tidal.config.run import AlertsConfig, EvalConfig, RunConfig
from tidal.config.section import Section
from tidal.config.task import ModelConfig, RewardConfig, RolloutConfig, TaskConfig
from tidal.config.train import TrainConfig


class TidalConfig(Section):
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
