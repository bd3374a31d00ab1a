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
