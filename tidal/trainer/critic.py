"""The critic of PPO proper: a value model V(s_t) per token, trained by a clipped value loss.

It is the policy architecture with a scalar head (HF `*ForTokenClassification`, one
label), initialized from the policy's weights unless `algorithm.critic.path` names
another model, and saved as a normal HF directory next to the policy in checkpoints.
Dropout is off: the critic's values feed GAE and must not be noisy.

Alignment is the trainer's: values[t] is the value of the state that generates token t+1.
Data parallel, it is FSDP2-sharded like the policy (tidal.trainer.distributed), and
`step`, `state_dict`, `save` and `load` are collectives.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.algorithms import aggregate, value_loss
from tidal.config import CriticConfig
from tidal.models import DTYPES, resolve_model_dir
from tidal.trainer import distributed as dp
from tidal.trainer.parallel import parallelize
from tidal.trainer.parallel.hf_model import save_hf


def load_value_model(path: str | Path, dtype: str, device: str):
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    p = resolve_model_dir(path)
    cfg = AutoConfig.from_pretrained(str(p), num_labels=1)
    cfg.classifier_dropout = 0.0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a fresh value head is expected, not news
    try:
        model = AutoModelForTokenClassification.from_pretrained(str(p), config=cfg, dtype=DTYPES[dtype])
    finally:
        hf_logging.set_verbosity(verbosity)
    if _has_no_head(p):
        torch.nn.init.zeros_(model.score.weight)  # V ≡ 0 at the start: GAE starts as Monte Carlo returns
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    return model.to(device)


def _has_no_head(p: Path) -> bool:
    """Whether the directory's weights hold no value head (`score.*`): one model.safetensors, or
    the files its index names (a sharded trainer writes several: tidal/trainer/parallel/hf_model.py)."""
    import json

    index = p / "model.safetensors.index.json"
    if index.is_file():
        return not any(k.startswith("score.") for k in json.loads(index.read_text())["weight_map"])
    if not (p / "model.safetensors").is_file():
        return True
    from safetensors import safe_open

    with safe_open(str(p / "model.safetensors"), "pt") as f:
        return not any(k.startswith("score.") for k in f.keys())  # noqa: SIM118 (a safetensors file handle, not a dict)


class Critic:
    def __init__(self, model_path: str, cfg: CriticConfig, *, dtype: str, device: torch.device,
                 warmup_steps: int, betas: tuple[float, float], dims=None):
        self.cfg = cfg
        self.device = device
        self.model = load_value_model(model_path, dtype, str(device))
        self.model.train()
        if dims is not None:  # the trainer's mesh: sharded over its data dimensions, replicated over tp

            parallelize(self.model, dims, tensor_parallel=False)
        elif dp.world_size() > 1:
            dp.shard_model(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=betas, weight_decay=0.0)
        warm = max(warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=attn).logits[:, :-1, 0].float()

    def loss(self, values_BT, old_values_BT, returns_BT, mask_BT, total_tokens: float) -> tuple[torch.Tensor, dict]:
        """Token-mean clipped value loss, this micro-batch's share (denominator: the batch's tokens)."""
        loss_BT, clipped_BT = value_loss(values_BT, old_values_BT, returns_BT, self.cfg.value_clip)
        loss = aggregate(loss_BT, mask_BT, "token-mean", total_tokens, 0.0)
        m = mask_BT.float()
        return loss, {"value_loss": float((loss_BT.detach() * m).sum()),
                      "value_clip_frac": float((clipped_BT.float() * m).sum())}

    def step(self, grad_clip: float) -> dict[str, float]:
        norm = dp.clip_grad_norm(list(self.model.parameters()), grad_clip)
        if torch.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"critic_grad_norm": float(norm)}

    def state_dict(self) -> dict:
        """Optimizer (full, by parameter name) and scheduler state."""
        return {"optimizer": dp.optimizer_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}

    def save(self, path: Path) -> None:
        save_hf(self.model, path)

    def load(self, path: Path, state: dict) -> None:
        missing, unexpected = dp.load_hf_weights(self.model, path)
        if missing or unexpected:
            raise ValueError(f"critic checkpoint {path} does not match the model: missing {missing}, "
                             f"unexpected {unexpected}")
        dp.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
