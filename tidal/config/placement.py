"""Config sections of where and how the roles run: the rollout engines, the placement of
trainer ranks, engines, reward and environment workers (local, Ray or a launcher), the weight
sync between them, and the OpenAI-compatible gateway.

The choice: each section checks only its own keys; the combinations across sections (a mode
with a transport, an engine with a device) are checked in one place, tidal/config/tidal_config.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tidal.config.section import Section


class EngineConfig(Section):
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


class RoleResources(Section):
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs one actor of this role reserves.")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs one actor of this role reserves (fractions share a GPU).")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources one actor needs, e.g. {node_type_a: 1}: pins the role to nodes that offer them.")


class WeightSyncDeltaConfig(Section):
    """Delta weight sync (docs/weightsync.md#delta-sync): each engine gets the XOR of the new
    weights with the version it holds, compressed, with a checksum per piece; a full sync when a
    checksum fails, when an engine is new or restarted, and every `full_every` versions. Bit for
    bit the full sync's result. `placement.weight_sync_delta=true` is short for `enabled: true`."""

    enabled: bool = Field(False, description="Send deltas (placement.weight_sync=shard; needs the `delta` extra: pip install 'tidal[delta]'). Off: every sync sends the full bytes, which on fast links is quicker (BENCHMARKS.md, Weight sync at scale).")
    full_every: int = Field(20, ge=1, description="A full sync every this many versions, whatever the checksums say.")
    codec: Literal["zstd", "lz4"] = Field("zstd", description="Compressor of the XOR's byte planes: zstd (smaller) or lz4.")
    level: int = Field(1, ge=-5, le=19, description="Compression level (zstd: 1 is its fast default; lz4: 0 fast, 3+ high-compression mode).")


class PlacementConfig(Section):
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


class GatewayConfig(Section):
    enabled: bool | None = Field(None, description="Serve the policy being trained through the OpenAI-compatible gateway during the run (tidal/runtime/gateway.py). None: only when the task runs agents (task.env=openai_agent).")
    host: str = Field("127.0.0.1", description="Address the gateway binds. Off loopback every call needs the token (gateway.token, or a random one written to <run dir>/gateway.json, readable by the owner only).")
    port: int = Field(0, ge=0, le=65535, description="Port (0: a free one; the URL is logged and written to <run dir>/gateway.json).")
    token: str | None = Field(None, description="Bearer token every call must carry; None: none on loopback, a random one elsewhere. Agents of the run are given it as their API key.")
    model_name: str | None = Field(None, description="Model name served at /v1/models; None: the model directory's name. Calls under a session (an agent episode) may name any model.")
    max_tokens: int = Field(256, ge=1, description="max_tokens of a call outside a session that gives none (in a session: rollout.max_new_tokens).")
    max_model_len: int | None = Field(None, ge=1, description="Longest context (prompt + completion) a call may use; None: the model's max_position_embeddings. Beyond it a call is refused (context_length_exceeded).")
