"""The Trainer's state across steps and restarts: the learning-rate schedule its optimizer steps
through, the random generators' state, and its checkpoints (save and load).

The choice: functions over the trainer's parts (policy, optimizer, scheduler, critic), passed by
name, which the Trainer's `save` and `load` call (tidal/trainer/trainer.py): what a checkpoint
holds, and in which file, is read in this one place. A checkpoint directory holds:

- `model/`: a normal HF directory, loadable by every engine and `tidal eval` (with the tokenizer,
  and a vision-language model's image processor settings); under LoRA the merged weights, with
  `adapter/` beside it in peft's format (what trains);
- `shards/`: when several ranks train without LoRA, each rank's shards of the policy and of its
  optimizer state (torch.distributed.checkpoint, tidal/trainer/parallel/checkpoint.py);
- `trainer_state.pt`: the scheduler, the policy version and the RNG state; the optimizer state
  whole, by parameter name, when one process (or LoRA) saved it; the critic's optimizer and
  scheduler state;
- `critic/`: the critic's HF directory, when one trains (tidal/trainer/critic.py).

Either layout resumes on any number of ranks and any mesh.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from tidal.config import TrainConfig
from tidal.durable import disk_error
from tidal.trainer import distributed as dp
from tidal.trainer.critic import Critic
from tidal.trainer.lora import load_adapter, merged_weights
from tidal.trainer.parallel.checkpoint import DIRNAME as SHARDS
from tidal.trainer.parallel.checkpoint import load_sharded, save_sharded
from tidal.trainer.parallel.hf_model import save_hf


def lr_factor(train: TrainConfig):
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then constant or cosine."""
    total = max(train.steps * train.mini_batches * train.epochs, 1)

    def factor(s: int) -> float:
        warm = min(1.0, (s + 1) / train.warmup_steps) if train.warmup_steps > 0 else 1.0
        if train.lr_schedule == "constant":
            return warm
        progress = min(max(s - train.warmup_steps, 0) / max(total - train.warmup_steps, 1), 1.0)
        return warm * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return factor


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(path: Path, model, optimizer, scheduler, *, version: int, critic: Critic | None, lora: bool,
                    world_size: int, tokenizer=None, processor: Path | None = None) -> None:
    """Write the checkpoint directory `path` (the module docstring). `processor`: a
    vision-language model's preprocessor_config.json, copied into model/. Data parallel: a
    collective."""
    if lora:  # model/: merged, for every engine and reader; adapter/: what trains (peft's format)
        merged = merged_weights(model)  # data parallel: collectives, in the same order on every rank
        adapter = {n: dp.full_tensor(p.detach()) for n, p in model.named_parameters() if "lora_" in n}
        if dp.rank() == 0:
            model.get_base_model().save_pretrained(path / "model", state_dict=merged, safe_serialization=True)
            model.save_pretrained(path / "adapter", state_dict=adapter, safe_serialization=True)
    else:
        save_hf(model, path / "model")
    state = {"scheduler": scheduler.state_dict(), "version": version, "rng": rng_state()}
    if world_size > 1 and not lora:  # every rank writes its shards (tidal/trainer/parallel/checkpoint.py)
        save_sharded(model, optimizer, path / SHARDS)
    else:
        state["optimizer"] = dp.optimizer_state(model, optimizer)
    if critic is not None:
        critic.save(path / "critic")
        state["critic"] = critic.state_dict()
    if dp.rank() == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(path / "model")
        if processor is not None:  # the image processor's settings: engines and the trainer load it from model/
            shutil.copy2(processor, path / "model" / "preprocessor_config.json")
        try:
            torch.save(state, path / "trainer_state.pt")
        except RuntimeError as e:  # a short write of its zip writer names no file (tidal/durable.py)
            cause = disk_error(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, str(path / "trainer_state.pt")) from e
    dp.barrier()  # nobody reads the checkpoint before it is whole


def load_checkpoint(path: Path, model, optimizer, scheduler, *, critic: Critic | None, lora: bool,
                    device: torch.device, advantage: str) -> int:
    """Restore the checkpoint directory `path`, saved by any number of ranks on any mesh, into
    the policy, its optimizer and scheduler, the critic (`advantage`: the estimator that needs
    it, for the error when it is missing) and the RNG; returns the policy version. A sharded
    checkpoint restores the policy and its optimizer from shards/; one saved by one process
    from model/ and trainer_state.pt. Data parallel: a collective; every rank reads the files
    (the checkpoint directory must be visible to all)."""
    st = torch.load(path / "trainer_state.pt", weights_only=False, map_location=device)
    sharded = (path / SHARDS).is_dir() and not lora
    if sharded:
        load_sharded(model, optimizer, path / SHARDS)
    elif lora:
        load_adapter(model, path / "adapter")
    else:
        missing, unexpected = dp.load_hf_weights(model, path / "model")
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    if "optimizer" in st:
        dp.load_optimizer_state(model, optimizer, st["optimizer"])
    elif not sharded:
        raise ValueError(f"checkpoint {path} has neither {SHARDS}/ nor an optimizer state in trainer_state.pt")
    scheduler.load_state_dict(st["scheduler"])
    if critic is not None:
        if "critic" not in st:
            raise ValueError(f"checkpoint {path} has no critic, but algorithm.advantage={advantage} needs one")
        critic.load(path / "critic", st["critic"])
    set_rng_state(st["rng"])
    return st["version"]
