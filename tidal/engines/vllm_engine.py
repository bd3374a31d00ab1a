"""vLLM as a tidal rollout engine: in this process (default) or as a supervised server.

Two modes behind one class, `VLLMEngine`:

- `in_process`: vLLM's V1 `LLMEngine` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
  vLLM's `AsyncLLM` always runs its engine core in a child process, so the in-process
  engine is the synchronous one, driven by one worker thread that owns it: `generate`
  hands requests to the thread, which keeps stepping the engine while any are unfinished
  (continuous batching across concurrent `generate` calls) and resolves each request's
  future when it finishes.
- `server`: `python -m vllm.entrypoints.openai.api_server` as a child process bound to
  127.0.0.1 on a free port, health-checked at start, killed with its process group on
  close. Token ids go in as the `prompt` of /v1/completions; token ids and the log-prob of
  each sampled token come back. Weights are updated over HTTP (`VLLM_SERVER_DEV_MODE=1`):
  tidal writes a safetensors file, `POST /collective_rpc` runs the model runner's
  `reload_weights` on it, `POST /reset_prefix_cache` drops KV blocks of the old weights.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-softmax of the
logits after temperature scaling (and after top-k/top-p masking, when a request sets
them). Without truncation that is exactly tidal's convention, log softmax(logits / T)
(types.GenerationResult); greedy requests get T=1. With top-k/top-p vLLM renormalizes over
the kept tokens, so its values are higher than tidal's by the log of the kept mass; the
engine warns once when a request asks for truncation. "raw_logprobs" would ignore the
temperature instead, which every sampled RL rollout uses.

Weights: full tensors through the model runner's `reload_weights` (layer-wise, through the
model's own weight loader, so the CPU backend's repacked linear layers are rebuilt); slices,
each worker only its own, through vLLM 0.32's weight-transfer API with tidal's `tidal_gloo`
backend (`join_weight_group`, `receive_slices`; tidal/engines/vllm_transfer.py), whose
built-in backends need CUDA. `tensor_parallel` > 1: one worker process per rank.
Tied embeddings: `lm_head.weight` is always sent (a copy of the input embedding when the
caller leaves it out) — vLLM keeps a separately packed output layer on CPU that otherwise
stays stale. Every update ends with a prefix-cache reset.

Versions: an update waits until every `generate` call in flight has finished and holds
new calls back until it is done, so each result's `version` produced all of its tokens. With
`partial_rollout` (in-process only) it lands between two engine steps instead, the requests in
flight go on with the new weights, and each result's `token_versions` says which version
sampled each token (tidal/engines/vllm_inprocess.py).

Images (a vision-language model: `vision`, tidal/models/vision.py): a request's prompt holds
each image's run of pads already expanded by tidal. vLLM expands placeholders itself, and
expands an already expanded run again (silently: every pad of the run becomes a run), so each
run goes to vLLM collapsed to one pad (`vision.collapse`), with the request's pictures as
`multi_modal_data` and their content ids as `multi_modal_uuids`. vLLM's processor is built
from the same preprocessor_config.json as tidal's; every answer is checked: the prompt vLLM
expanded must be the request's prompt, token for token, or the call fails naming both run
lengths. A weight update also resets vLLM's encoder cache (image embeddings computed by the
old vision tower; a repeated image after an update otherwise fails with "Encoder cache
miss"). The vision special tokens are never sampled: every request bans them through vLLM's
`bad_words` (their logits set to -inf before the log-softmax, so the processed log-probs are
those of the masked distribution the trainer scores, `vision.mask_banned`). Server mode sends
requests with images to vLLM's token-in/token-out endpoint `/inference/v1/generate` (token
ids and the pictures as data URLs); text requests keep /v1/completions. Where torchvision
cannot be imported, tidal/models/vision_shims.py patches what vLLM's Qwen2-VL code needs.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tidal.engines.served import ServedEngine
from tidal.engines.stop_strings import check_stop_strings
from tidal.engines.vllm_inprocess import InProcessVLLM
from tidal.engines.vllm_requests import (
    VLLMEngineError,
    banned_words,
)
from tidal.engines.vllm_server import VLLMServer
from tidal.models import load_tokenizer
from tidal.models.vision_shims import apply_vllm_shims, plugin_registered, torchvision_usable
from tidal.types import GenerationRequest
from tidal.weightsync.base import WeightSyncError

if TYPE_CHECKING:
    from tidal.models.vision import Vision

log = logging.getLogger("tidal")

Mode = Literal["in_process", "server"]
LOGPROBS_MODE = "processed_logprobs"


def cpu_binding(tp_size: int, cpus: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp_size` CPU workers: the allowed cores in `tp_size`
    contiguous groups ("0|1"), or, with fewer cores than ranks, one core each, shared in turn.
    vLLM's default ("auto") binds rank r to NUMA node r and refuses to start TP 2 on a box
    with one node ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    cpus = sorted(cpus)
    if len(cpus) < tp_size:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(tp_size))
    per, extra = divmod(len(cpus), tp_size)
    groups, i = [], 0
    for r in range(tp_size):
        n = per + (r < extra)
        groups.append(",".join(map(str, cpus[i:i + n])))
        i += n
    return "|".join(groups)


def vllm_env(mode: Mode, kv_cache_gib: float, tensor_parallel: int = 1, device: str = "cpu") -> dict[str, str]:
    """Environment vLLM needs on this machine (read by vLLM when it starts)."""
    env = {
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own rendezvous stays on loopback
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",  # GiB; without it vLLM-CPU refuses to start on a memory check
    }
    if tensor_parallel > 1 and not device.startswith("cuda"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel, sorted(os.sched_getaffinity(0)))
    if mode == "in_process":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
    return env


class VLLMEngine(ServedEngine):
    """The Engine protocol over vLLM (see the module docstring for the two modes)."""

    error = VLLMEngineError

    def __init__(
        self,
        model_dir: str | Path,
        mode: Mode = "in_process",
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 512,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        log_dir: str | Path | None = None,
        vision: Vision | None = None,
        tensor_parallel: int = 1,
        partial_rollout: bool = False,
    ):
        if mode not in ("in_process", "server"):
            raise ValueError(f"vLLM engine mode must be 'in_process' or 'server', got {mode!r}")
        if partial_rollout and mode != "in_process":
            raise VLLMEngineError("vLLM engine: partial rollout (requests in flight kept across a weight update) needs "
                                  "mode='in_process' (engine.vllm_mode): the server's update routes run beside its "
                                  "requests with no way to tell which version sampled which token")
        self.partial_rollout = partial_rollout
        self.model_dir = Path(model_dir)
        self.mode: Mode = mode
        self.request_timeout_s = request_timeout_s
        self.tensor_parallel = tensor_parallel
        self._broken = ""  # why the engine cannot serve any more (a failed slice receive), else ""
        self._start_serving()
        self._warned_truncation = False
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self._tied = bool(cfg.get("tie_word_embeddings", False) or
                          (cfg.get("text_config") or {}).get("tie_word_embeddings", False))
        self.vision = vision
        self._banned: tuple[str, ...] = ()
        engine_args = {
            "dtype": dtype, "seed": seed, "max_num_seqs": max_batch_size, "enforce_eager": True,
            "logprobs_mode": LOGPROBS_MODE, "gpu_memory_utilization": gpu_memory_utilization,
            "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
        }
        # tidal's backend for vLLM's weight-transfer API (vllm_transfer.py): each worker receives its own
        # slices. vLLM imports the extension class in every worker, which registers the backend there.
        engine_args["worker_extension_cls"] = "tidal.engines.vllm_transfer.TidalWorkerExtension"
        engine_args["weight_transfer_config"] = {"backend": "tidal_gloo"}
        if tensor_parallel > 1:
            # One worker process per rank (vLLM's multiprocessing executor), in-process mode too: only
            # the engine core stays in this process. Ray's executor is not needed on one node.
            engine_args["tensor_parallel_size"] = tensor_parallel
            engine_args["distributed_executor_backend"] = "mp"
        if not device.startswith("cuda"):
            # vLLM-CPU 0.32 fails on a seeded request whose prompt is prefilled in chunks (it
            # rewinds the request's generator offset, which CPU generators do not have): whole
            # prompts only. A batch larger than the token budget still runs, in several steps.
            engine_args["enable_chunked_prefill"] = False
        if vision is not None:
            self._banned = self._prepare_vision(engine_args)
        env = vllm_env(mode, kv_cache_gib, tensor_parallel, device)
        if mode == "in_process":
            self._backend: InProcessVLLM | VLLMServer = InProcessVLLM(self.model_dir, engine_args, env, vision is not None)
            self._backend.partial = partial_rollout
        else:
            self._backend = VLLMServer(self.model_dir, engine_args, env, start_timeout_s, request_timeout_s, log_dir,
                                    vision is not None)
        self.max_model_len = self._backend.max_model_len
        # Close on interpreter exit: no server process outlives tidal.
        self._finalizer = weakref.finalize(self, self._backend.close)

    # -- the Engine protocol (the rest is ServedEngine's) ----------------------------------------
    @property
    def name(self) -> str:
        return f"vLLM engine ({self._backend.describe()})"

    def dead(self) -> str:
        return self._broken or self._backend.dead()

    async def _generate(self, requests: list[GenerationRequest], what: str,
                        version: int) -> list[tuple[list[int], list[float], str]]:
        try:
            return await self._backend.generate(requests, self.request_timeout_s, self.vision, self._banned)
        except VLLMEngineError as e:
            raise VLLMEngineError(f"{self.name}: {e}") from e
        except TimeoutError:
            raise VLLMEngineError(f"{self.name}: {what} did not finish within {self.request_timeout_s:g} s "
                                  f"(engine.request_timeout_s)") from None
        except Exception as e:
            raise VLLMEngineError(f"{self.name}: {what} failed: {type(e).__name__}: {e}") from e

    def _load_weights(self, named: dict, version: int) -> None:
        self._backend.load_weights(named, self.request_timeout_s, version)

    # -- slices: vLLM's weight-transfer API with tidal's backend (vllm_transfer.py) --------------
    def join_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, name: str,
                          timeout_s: float, role: str, backend: str = "gloo", poison: bool = False,
                          shard: bool = False) -> None:
        """Every worker joins tidal's slice group (tidal/weightsync/sliced.py) as rank
        `rank_offset` + its TP rank; returns once the whole group has joined. `role` names this
        replica in errors ("engine replica 0"); `poison`: see sliced.expand. `shard`: the group is
        the shard transport's (tidal/weightsync/shard.py; every trainer rank sends, the plan arrives
        at the join), and `receive_slices` then receives by its plan."""
        info = {"host": host, "port": port, "world_size": world_size, "rank_offset": rank_offset, "name": name,
                "timeout_s": timeout_s, "role": role, "backend": backend, "poison": poison, "shard": shard}
        self._check_open("join_weight_group")
        try:
            self._backend.transfer([("init_weight_transfer_engine", {"init_info": info})], timeout_s)
        except Exception as e:
            raise WeightSyncError(f"{role}: joining weight-sync group {name!r} failed: {e}") from e

    def receive_slices(self, timeout_s: float | None = None) -> dict:
        """Receive one sync from the slice group (the sender calls `send_slices`), each worker
        its own slices, through vLLM's start/update/finish_weight_update; like `update_weights`
        it waits for the calls in flight and holds new ones back. Returns `version`, `bytes`
        (all ranks), `bytes_per_rank`, `checksum_ok` (None: none was sent), `reports` (per rank)."""
        timeout_s = timeout_s or self.request_timeout_s
        what = "receive_slices"
        self._check_open(what)
        too_slow = lambda n: self.error(f"{self.name}: {what} waited {self.request_timeout_s:g} s for {n} "
                                        "generate calls in flight to finish")
        with self._update_gate(too_slow):
            try:
                reports = self._backend.transfer([
                    ("start_weight_update", {}), ("update_weights", {"update_info": {"timeout_s": timeout_s}}),
                    ("finish_weight_update", {}), ("tidal_sync_report", {})], timeout_s)
            except Exception as e:
                # vLLM's layerwise reload stopped midway: some layers may hold nothing usable. The engine
                # reports itself dead from now on, so the router takes it out and the run replaces it.
                self._broken = f"a slice receive failed and left its weights half loaded: {e}"
                raise WeightSyncError(f"{self.name}: {what} failed (the replica must be restarted: its layers may "
                                      f"be half reloaded): {e}") from e
            versions = {r.get("version") for r in reports}
            if len(versions) != 1 or None in versions:
                raise WeightSyncError(f"{self.name}: {what}: the ranks received versions {sorted(map(str, versions))}")
            self._version = int(versions.pop())
        sums = [r.get("checksum_ok") for r in reports]
        return {"version": self._version, "bytes": sum(r["bytes"] for r in reports),
                "bytes_per_rank": [r["bytes"] for r in reports],
                "checksum_ok": None if None in sums else all(sums), "reports": reports}

    def peer_weights(self):
        """vLLM keeps no readable copy of whole tensors (NO_READABLE_COPY): PeerUnavailable. A
        replica fed by the shard transport serves from its workers' copies instead (`serve_peer`)."""
        from tidal.weightsync.peer import NO_READABLE_COPY, PeerUnavailable

        raise PeerUnavailable(f"{self.name} cannot serve its weights as whole tensors: {NO_READABLE_COPY}")

    def _peer_copies(self) -> list:
        """Each worker's version of the copy of its slices it keeps (None: none)."""
        self._check_open("peer_version")
        return self._backend.transfer([("tidal_peer_version", {})], 60.0)

    def peer_version(self) -> int | None:
        """The version this replica can serve a peer (`serve_peer`): its own, when every worker
        keeps a copy of its slices at it (fed by the shard transport); else None."""
        got = self._peer_copies()
        return self._version if got and all(v == self._version for v in got) else None

    def serve_peer(self, host: str, port: int, world_size: int, name: str, timeout_s: float, dst_tp: int,
                   bucket_bytes: int, role: str = "vLLM replica", backend: str = "gloo", checksums: bool = False
                   ) -> list[dict]:
        """Send this replica's weights to a new replica (tidal/weightsync/peer.py): every worker
        joins the peer group as its TP rank (the new replica's ranks follow, from `world_size` -
        `dst_tp`) and sends its own slices from the copy the shard transport keeps; the others'
        packed weights cannot be read back on CPU, so a replica fed another way raises
        PeerUnavailable (asked first, before anyone joins). Generation pauses meanwhile (the
        workers are busy sending), no update lands. Returns each rank's `ShardSender.send` report."""
        from tidal.weightsync.peer import NO_READABLE_COPY, PeerUnavailable

        got = self._peer_copies()
        if any(v is None for v in got):
            raise PeerUnavailable(f"{self.name} cannot serve a peer: its workers hold no copy of their weights "
                                  f"({NO_READABLE_COPY})")
        if any(v != self._version for v in got):
            raise PeerUnavailable(f"{self.name} cannot serve v{self._version}: its workers' copies are "
                                  f"v{'/'.join(map(str, sorted(set(got))))} (it took newer weights by another path since)")
        info = {"host": host, "port": port, "world_size": world_size, "name": name, "timeout_s": timeout_s,
                "dst_tp": dst_tp, "bucket_bytes": bucket_bytes, "role": role, "backend": backend,
                "version": self._version, "checksums": checksums,
                "hf_config": json.loads((self.model_dir / "config.json").read_text())}
        try:
            return self._backend.transfer([("tidal_serve_peer", {"info": info})], timeout_s)
        except Exception as e:
            raise WeightSyncError(f"{self.name}: serving weights v{self._version} to a peer failed: {e}") from e

    # -- helpers ---------------------------------------------------------------------------
    def _prepare_vision(self, engine_args: dict[str, Any]) -> tuple[str, ...]:
        """Set up a vision-language model: torchvision shims, image-only limits; the texts that
        ban the vision special tokens."""
        if not torchvision_usable() and not plugin_registered():
            raise VLLMEngineError(
                f"vLLM engine: {self.model_dir} is a vision-language model and torchvision cannot be imported here, "
                "so vLLM needs tidal's shims (tidal/models/vision_shims.py) in its model-inspection subprocess too; "
                "they reach it as a `vllm.general_plugins` entry point, which this installation of tidal does not "
                "declare: reinstall it (`pip install -e .` in the tidal checkout)")
        apply_vllm_shims()  # this process (in-process mode); the entry point covers vLLM's subprocesses
        # tidal sends images only: no encoder budget reserved for videos, and no video in vLLM's
        # start-up warm-up (it would need torchvision's video processor).
        engine_args["limit_mm_per_prompt"] = {"video": 0}
        try:
            return banned_words(load_tokenizer(self.model_dir), self.vision.banned_token_ids)
        except ValueError as e:
            raise VLLMEngineError(f"vLLM engine: {self.model_dir}: {e}") from None

    def _check_images(self, r: GenerationRequest) -> None:
        """A request's images pair up with its image runs, each run as long as tidal's processor
        makes it (vLLM's answer is checked against the same lengths: check_expanded)."""
        if not r.images:
            return
        if self.vision is None:
            raise VLLMEngineError(f"{self.name}: request {r.request_id} has {len(r.images)} images but "
                                  f"{self.model_dir} is not a vision-language model (build the engine with `vision`)")
        runs = self.vision.runs(r.prompt_ids)
        want = [self.vision.num_tokens(b) for b in r.images]
        if [e - s for s, e in runs] != want:
            raise VLLMEngineError(f"{self.name}: request {r.request_id}: image runs of {[e - s for s, e in runs]} "
                                  f"tokens in the prompt for {len(r.images)} images of {want} tokens")

    def _validate(self, r: GenerationRequest) -> None:
        p = r.params
        if not r.prompt_ids:
            raise VLLMEngineError(f"{self.name}: request {r.request_id} has an empty prompt")
        self._check_images(r)
        if p.stop:
            try:
                check_stop_strings(p.stop, f"request {r.request_id}")
            except (TypeError, ValueError) as e:
                raise VLLMEngineError(f"{self.name}: {e}") from None
        if len(r.prompt_ids) + p.max_new_tokens > self.max_model_len:
            raise VLLMEngineError(
                f"{self.name}: request {r.request_id}: prompt of {len(r.prompt_ids)} tokens + max_new_tokens "
                f"{p.max_new_tokens} exceeds the model's max_model_len {self.max_model_len}")
        if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) and not self._warned_truncation:
            self._warned_truncation = True
            log.warning("%s: top_k/top_p truncation: vLLM returns log-probs renormalized over the kept tokens, "
                        "not tidal's untruncated log softmax(logits/T); engine/trainer log-prob mismatch grows "
                        "by log(kept mass) per token (first request %s)", self.name, r.request_id)
