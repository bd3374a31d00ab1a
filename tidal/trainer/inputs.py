"""What the Trainer takes in: the batch it trains on (`TrainBatch`) and the settings it can build
(`refuse_what_cannot_work`).

The choice: a batch is plain lists, one entry per sequence, not tensors. The runtime builds it
from scored episodes (tidal/runtime/batch.py) and splits it among data-parallel ranks and
mini-batches by index (`select`); the trainer lays each micro-batch out as tensors itself
(tidal/trainer/layout.py, tidal/trainer/forward.py), so no layout decision is made before the
trainer knows its budget and mesh. A combination of settings the trainer cannot build is refused
with an error naming its keys before any model loads, not found halfway through a build.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import AlgorithmConfig, TrainConfig


@dataclass
class TrainBatch:
    """What the trainer needs of a set of episodes. Lists are per sequence.

    `tokens`, `loss_mask` and `behaviour_logprobs` are aligned with the tokens; the
    per-position lists (`advantages`, `old_logprobs`, `returns`, `old_values`) are
    aligned with the trainer's targets: entry t belongs to token t+1 (one shorter)."""

    tokens: list[list[int]]
    loss_mask: list[list[bool]]
    advantages: list[list[float]]
    behaviour_logprobs: list[list[float]]  # engine log-probs, 0 off the mask
    old_logprobs: list[list[float]] | None = None  # proximal policy; None: on-policy (= current, detached)
    returns: list[list[float]] | None = None  # critic targets (gae)
    old_values: list[list[float]] | None = None  # critic values before the update (value clipping)
    # Vision-language models: per sequence, its images (tidal.images.ImageBlob), one per run of
    # image pads in its tokens, in order. None: no sequence has an image.
    images: list[list] | None = None
    # A mixture of experts (tidal/trainer/routing.py): per sequence, the engine's experts per token
    # ([len, layers, k], tidal/models/moe.py's compact record; None: none), replayed under R3 and
    # compared with the trainer's own; `trainer_routing`: the log-prob pass's, replayed under R2.
    routed_experts: list | None = None
    trainer_routing: list | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, idx: list[int]) -> TrainBatch:
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]
        return TrainBatch(pick(self.tokens), pick(self.loss_mask), pick(self.advantages),
                          pick(self.behaviour_logprobs), pick(self.old_logprobs), pick(self.returns),
                          pick(self.old_values), pick(self.images), pick(self.routed_experts),
                          pick(self.trainer_routing))

    def totals(self) -> tuple[float, float]:
        """(masked tokens, sequences with any masked token): the loss denominators of this
        batch. A data-parallel rank passes the totals of the global batch instead."""
        masks = [m[1:] for m in self.loss_mask]
        return float(sum(sum(m) for m in masks)), float(sum(1 for m in masks if any(m)))


def refuse_what_cannot_work(train: TrainConfig, algo: AlgorithmConfig, dims, vision: bool, needs_values: bool,
                            dtype: str, model_path: str) -> None:
    """A ValueError naming the keys for a combination the trainer cannot build, before any model loads."""
    if dims.tp > 1 and train.lora.rank > 0:
        raise ValueError(f"train.parallel.tp={dims.tp} with train.lora: adapters under tensor parallelism are "
                         "not supported; use tp=1 (FSDP) with LoRA")
    if vision and needs_values:
        raise ValueError(f"algorithm.advantage={algo.advantage} trains a critic (a token-classification value model), which "
                         f"tidal cannot build for the vision-language model `{model_path}` (transformers has no "
                         "such head for Qwen2-VL): use an outcome estimator (grpo, rloo, reinforce++, ...)")
    if train.share_prompts and vision:
        raise ValueError(f"train.share_prompts is for text models; `{model_path}` is a vision-language model, whose "
                         "positions and pictures are laid out per sequence: turn it off (or use train.packing)")
    if train.mixed_precision and dtype != "float32":
        raise ValueError(f"train.mixed_precision needs float32 parameters (got {dtype})")
    if vision and dims.tp > 1:
        raise ValueError(f"train.parallel.tp={dims.tp}: `{model_path}` is a vision-language model, which has no "
                         "tensor-parallel plan yet (tidal/trainer/parallel/tensor.py); use FSDP (train.parallel.tp=1)")
    if dims.cp > 1 and (vision or train.lora.rank > 0 or algo.advantage == "gae"):
        raise ValueError(f"train.parallel.cp={dims.cp} is for text models, without LoRA or a critic "
                         f"(algorithm.advantage=gae): `{model_path}`")
