"""LoRA for the trainer (peft): adapters on the policy, their merge into plain weights, and their checkpoint.

With `train.lora.rank > 0` only the adapters train; the base weights stay frozen and serve as
the reference model (the policy with its adapters off). Engines never see an adapter: weight
updates and a checkpoint's model/ carry `merged_weights`, the base model's own parameter names
with each adapted layer's W + scale · B·A; the adapters alone go to the checkpoint's adapter/.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from tidal.trainer import distributed as dp


def add_lora(model, lora):
    """`model` with peft LoRA adapters on `lora.targets`: B starts at zero, so the adapted
    model computes exactly what the base does until the first step."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    unknown = sorted(set(lora.targets) - names)
    if unknown:
        raise ValueError(f"train.lora.targets: no module of the model is named {unknown} (its linear layers: "
                         f"{sorted({n.rsplit('.', 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})})")
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                target_modules=list(lora.targets), bias="none"))


def merged_weights(peft_model) -> dict[str, torch.Tensor]:
    """The base model's parameters by their own names, whole, each adapted linear layer's weight
    with its adapters merged in (W + scale · B·A): what an engine holding the plain model loads.
    Data parallel: a collective (every parameter is all-gathered, in the same order on every rank)."""
    from peft.tuners.lora import LoraLayer

    dp.reshard(peft_model)
    base = peft_model.get_base_model()
    full = {n: dp.full_tensor(p.detach()) for n, p in base.named_parameters()}
    out = {n.replace(".base_layer.", "."): w for n, w in full.items() if "lora_" not in n}
    for name, mod in base.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        key = f"{name}.weight"
        for a in mod.active_adapters:
            delta = full[f"{name}.lora_B.{a}.weight"] @ full[f"{name}.lora_A.{a}.weight"] * mod.scaling[a]
            out[key] = out[key] + (delta.T if mod.fan_in_fan_out else delta).to(out[key].dtype)
    return out


def load_adapter(peft_model, path: Path) -> None:
    """Restore adapter weights saved by `save` (peft's adapter_model.safetensors, whose keys
    carry no adapter name), sharded or not."""
    from safetensors.torch import load_file

    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise ValueError(f"checkpoint {path.parent} has no adapter ({f} is missing), but train.lora.rank > 0: it was "
                         "saved by a full fine-tuning run; resume it without train.lora")
    state = {re.sub(r"\.(lora_[AB])\.", r".\1.default.", k): v for k, v in load_file(str(f)).items()}
    missing, unexpected = dp.load_full_state(peft_model, state)
    missing = [k for k in missing if "lora_" in k]
    if unexpected or missing:
        raise ValueError(f"adapter {path} does not match train.lora: missing {missing[:5]}, unexpected {unexpected[:5]}")
