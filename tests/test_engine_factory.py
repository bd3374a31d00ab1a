"""Engine choice per device and the parts of the vLLM engine that need no vLLM (fast)."""

from __future__ import annotations

import importlib.util

import pytest

from tidal.config import ConfigError, EngineConfig, load_config
from tidal.engines.factory import build_engine, choose_engine_kind
from tidal.engines.vllm_engine import vllm_env
from tidal.engines.vllm_requests import vllm_sampling_fields
from tidal.types import SamplingParams


def test_default_config_keeps_the_torch_engine_on_cpu():
    cfg = load_config()
    assert cfg.engine.kind == "auto"
    kind, why = choose_engine_kind(cfg.engine.kind, "cpu")
    assert kind == "torch" and "CPU" in why


def test_auto_on_a_gpu_box_takes_vllm_when_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert choose_engine_kind("auto", "cuda")[0] == "vllm"
    assert choose_engine_kind("auto", "cuda:1")[0] == "vllm"
    assert choose_engine_kind("torch", "cuda") == ("torch", "engine.kind=torch in the config")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    kind, why = choose_engine_kind("auto", "cuda")
    assert kind == "torch" and "not installed" in why


def test_vllm_without_vllm_installed_is_a_config_error(monkeypatch, tiny_model_dir):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="engine.kind=vllm: vLLM is not installed.*make setup-vllm"):
        build_engine("vllm", EngineConfig(kind="vllm"), tiny_model_dir, dtype="float32", device="cpu", pad_token_id=0)


def test_in_process_vllm_replicas_are_refused(monkeypatch, tiny_model_dir):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    cfg = EngineConfig(kind="vllm", replicas=2)
    with pytest.raises(ConfigError, match="engine.replicas=2 with engine.vllm_mode=in_process"):
        build_engine("vllm", cfg, tiny_model_dir, dtype="float32", device="cpu", pad_token_id=0)


def test_engine_config_is_validated():
    with pytest.raises(ConfigError, match="engine.vllm_mode"):
        load_config(overrides=["engine.vllm_mode=subprocess"])
    with pytest.raises(ConfigError, match="engine.kind"):
        load_config(overrides=["engine.kind=tensorrt"])
    assert load_config(overrides=["engine.kind=vllm", "engine.vllm_mode=server"]).engine.vllm_mode == "server"


def test_sampling_params_map_to_vllm():
    greedy = vllm_sampling_fields(SamplingParams(max_new_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=9,
                                             stop_token_ids=(2, 7)))
    assert greedy == {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 9,
                      "stop_token_ids": [2, 7], "ignore_eos": True, "logprobs": 0}
    sampled = vllm_sampling_fields(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 40)


def test_vllm_env_stays_on_loopback():
    env = vllm_env("in_process", 2.0)
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    server = vllm_env("server", 1.0)
    assert server["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in server


# -- engine.tensor_parallel ---------------------------------------------------------------------
def test_tensor_parallel_is_refused_for_the_torch_engine():
    with pytest.raises(ConfigError, match="engine.tensor_parallel=2: the torch engine"):
        load_config(overrides=["engine.tensor_parallel=2"])  # auto on a CPU box: the torch engine
    with pytest.raises(ConfigError, match="engine.tensor_parallel"):
        load_config(overrides=["engine.tensor_parallel=0", "engine.kind=vllm"])
    assert load_config(overrides=["engine.tensor_parallel=2", "engine.kind=vllm"]).engine.tensor_parallel == 2


def test_tensor_parallel_must_split_the_model():
    from tidal.engines.factory import check_engine_tp

    check_engine_tp("default", 2)  # 4 heads, 2 kv heads
    check_engine_tp("default", 4)  # each kv head kept by 2 ranks
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel=3 does not divide the model's 4 attention heads"):
        check_engine_tp("default", 3)


def test_cpu_binding_gives_each_rank_its_own_cores():
    from tidal.engines.vllm_engine import cpu_binding

    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [3, 0, 1, 2, 4]) == "0,1,2|3,4"
    assert cpu_binding(4, [0, 1]) == "0|1|0|1"  # fewer cores than ranks: shared in turn
    env = vllm_env("in_process", 1.0, tensor_parallel=2, device="cpu")
    assert env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("in_process", 1.0)  # TP 1: vLLM's default
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("in_process", 1.0, tensor_parallel=2, device="cuda")


def test_sglang_gets_tp_size():
    from tidal.engines.sglang_engine import server_command

    cmd = server_command("m", "127.0.0.1", 1, dtype="bfloat16", seed=0, max_batch_size=8, mem_fraction_static=0.5,
                         tp_size=4)
    assert cmd[cmd.index("--tp-size") + 1] == "4"


def test_auto_transport_sends_slices_to_tensor_parallel_engines():
    from tidal.runtime.sync import choose_transport

    assert choose_transport("auto", colocated=False, engine_tp=2) == "slices"
    assert choose_transport("auto", colocated=False, engine_tp=2, engine_kind="vllm") == "shard"  # no gather
    assert choose_transport("auto", colocated=False, engine_tp=2, engine_kind="vllm", lora=True) == "slices"
    assert choose_transport("auto", colocated=False, engine_tp=2, engine_kind="sglang") == "slices"
    assert choose_transport("auto", colocated=False, engine_tp=1) == "broadcast"
    assert choose_transport("auto", colocated=True, engine_tp=2) == "inprocess"
    with pytest.raises(ConfigError, match="placement.weight_sync=slices needs placement.mode=ray"):
        load_config(overrides=["placement.weight_sync=slices"])
