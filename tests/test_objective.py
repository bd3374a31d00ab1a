"""The loss as a component (tidal/algorithms/objective.py): forward_backward is forward ->
objective -> backward; `algorithm.loss` swaps in a user's objective by dotted or file path,
whose gradients are exactly what it computes; the default objective keeps split invariance
(tests/test_trainer.py) and every option."""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_trainer import GRAD_TOL, _batch

from tidal.config import AlgorithmConfig, TrainConfig
from tidal.trainer.trainer import Trainer

USER = textwrap.dedent('''
    import torch
    from tidal.algorithms.objective import LossOutput

    def reinforce(x):
        """-A·log π per policy token, token-mean over the whole batch."""
        per_token = -(x.logp * x.advantages) * x.mask
        return LossOutput(per_token.sum() / x.total_tokens, {"reinforce": float(per_token.detach().sum())})
    reinforce.metric_keys = ("reinforce",)

    class Scaled:
        """A class built with the algorithm section: 2 × reinforce, as a (loss, sums) pair."""
        def __init__(self, algo):
            self.scale = 2.0
        def __call__(self, x):
            loss = -(self.scale * x.logp * x.advantages * x.mask).sum() / x.total_tokens
            return loss, {}

    def wrong(x):
        return "a loss"
''')


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_losses.py"
    path.write_text(USER)
    return path


def grads(model_dir, algo, budget=10_000, batch=None):
    torch.manual_seed(0)
    tr = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget), algo, pad_token_id=0)
    metrics = tr.forward_backward(batch or _batch())
    return {n: p.grad.clone() for n, p in tr.model.named_parameters()}, metrics, tr


def hand_reinforce_grads(model_dir, scale=1.0):
    """The same objective written plainly, without tidal's trainer: one padded batch."""
    torch.manual_seed(0)
    tr = Trainer(str(model_dir), TrainConfig(), AlgorithmConfig(), pad_token_id=0)
    b = _batch()
    width = max(map(len, b.tokens))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in b.tokens])
    attn = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in b.tokens])
    logits = tr.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.tensor([m[1:] + [False] * (width - len(m)) for m in b.loss_mask])
    adv = torch.tensor([a + [0.0] * (width - 1 - len(a)) for a in b.advantages])
    (-(scale * logp * adv) * mask).sum().div(mask.sum()).backward()
    return {n: p.grad.clone() for n, p in tr.model.named_parameters()}


@pytest.mark.parametrize("budget", [10_000, 24])
def test_a_users_function_is_the_objective(tiny_model_dir, losses, budget):
    got, metrics, _ = grads(tiny_model_dir, AlgorithmConfig(loss=f"{losses}:reinforce"), budget)
    want = hand_reinforce_grads(tiny_model_dir)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **GRAD_TOL)
    assert "reinforce" in metrics and "pg_loss" not in metrics and "clip_frac" not in metrics
    assert metrics["entropy"] > 0 and "mismatch_kl" in metrics  # the trainer's own reports stay


def test_a_users_class_is_built_with_the_algorithm_section(tiny_model_dir, losses):
    got, _, _ = grads(tiny_model_dir, AlgorithmConfig(loss=f"{losses}:Scaled"), 24)
    want = hand_reinforce_grads(tiny_model_dir, scale=2.0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **GRAD_TOL)


def test_the_default_objective_is_tidals_policy_loss(tiny_model_dir):
    """No algorithm.loss: the PPO objective (clip, IS weight, rejection, KL, entropy bonus)."""
    algo = AlgorithmConfig(is_level="token", rejection="token", kl_coef=0.05, entropy_coef=0.01)
    whole, m, tr = grads(tiny_model_dir, algo)
    split, _, _ = grads(tiny_model_dir, algo, budget=24)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], **GRAD_TOL)
    assert {"pg_loss", "kl", "clip_frac", "is_weight", "is_truncated_frac", "rejected_frac", "entropy"} <= set(m)
    assert m["clip_frac"] > 0 and m["rejected_frac"] > 0 and m["kl"] >= 0
    assert type(tr.objective).__name__ == "PolicyObjective" and tr.objective.entropy_grad


@pytest.mark.parametrize("path, error", [
    ("tidal.nope:loss", r"`algorithm.loss`: cannot import module `tidal.nope`"),
    ("tidal.algorithms.objective:NOPE", r"`algorithm.loss`: module `tidal.algorithms.objective` has no attribute"),
])
def test_a_loss_that_cannot_load_names_the_key(tiny_model_dir, path, error):
    with pytest.raises(ValueError, match=error):
        Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(loss=path), pad_token_id=0)


def test_a_loss_of_the_wrong_type_names_the_key(tiny_model_dir, losses):
    tr = Trainer(str(tiny_model_dir), TrainConfig(), AlgorithmConfig(loss=f"{losses}:wrong"), pad_token_id=0)
    with pytest.raises(TypeError, match=r"`algorithm.loss` .*:wrong` returned str"):
        tr.forward_backward(_batch())
