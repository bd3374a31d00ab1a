"""Config sections of the trainer: optimizer and schedule, micro-batch layout, precision,
LoRA, the device mesh of the trainer ranks (train.parallel) and mixture-of-experts training.

The choice: the mesh's degrees are checked against each other here and against the number of
trainer ranks by `ParallelConfig.degrees`, the one place that resolves `dp_shard=-1`
(tidal/trainer/parallel/mesh.py calls it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tidal.config.section import Section


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank r (peft); 0: full fine-tuning. With r > 0 the policy trains low-rank adapters on `targets` only, the reference model (algorithm.kl_coef > 0) is the same weights with the adapters off (no second copy), engines receive the merged weights, and checkpoints hold the adapter beside the merged model (docs/algorithms.md).")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator: the update is (alpha / rank) · B·A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (peft's lora_dropout).")
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                               min_length=1, description="Names of the linear modules that get adapters (peft's target_modules; module names as in the model).")


class ParallelConfig(Section):
    """How the trainer ranks are laid out as a named device mesh (tidal/trainer/parallel/mesh.py,
    docs/parallel.md). The degrees multiply to placement.trainer_ranks."""

    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicas: groups of ranks that each hold a whole copy of the (sharded) model and average nothing but their gradients (HSDP's replicated dimension: one all-reduce of gradients per step across groups, e.g. one group per node).")
    dp_shard: int = Field(-1, ge=-1, description="Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2) within a replica; -1: every rank the other dimensions leave (the default: 1-D FSDP over all trainer ranks).")
    tp: int = Field(1, ge=1, description="Tensor parallelism: each layer's attention heads, MLP columns and the vocabulary split over this many ranks (DTensor plans; Qwen2/Qwen2.5/Qwen3/Llama). The heads, the key-value heads, the MLP width and the vocabulary must divide by it; these ranks get the same sequences.")
    cp: int = Field(1, ge=1, description="Context parallelism (Ulysses): each micro-batch's positions split over this many ranks, attention made whole by all-to-alls between the position and the head dimension (tidal/trainer/parallel/context.py); activations ~1/cp per rank. The attention heads of a rank (after tp) must divide by it; these ranks get the same sequences. Text models, without LoRA.")
    ep: int = Field(1, ge=1, description="Expert parallelism (mixture-of-experts models): each rank holds num_experts / ep of every MoE layer's experts, and tokens travel to the rank of their expert and back by all-to-all, dropless (tidal/trainer/parallel/expert.py). Borrowed from the data ranks: these ranks get different sequences, and the parameters outside the experts are FSDP-sharded over dp_shard x ep. The model's num_experts must divide by it; not with tp, cp or LoRA.")

    @model_validator(mode="after")
    def _ep_alone(self) -> ParallelConfig:
        # ep is built over data ranks (tidal/trainer/parallel/expert.py): with tp the experts would also
        # need a plan of their own, and with cp the expert data mesh would not be contiguous; neither is built
        for key in ("tp", "cp"):
            if self.ep > 1 and getattr(self, key) > 1:
                raise ValueError(f"train.parallel.ep={self.ep} with {key}={getattr(self, key)}: expert parallelism "
                                 "composes with dp_shard and dp_replicate only; set one of them to 1")
        return self

    @property
    def fixed(self) -> int:
        """The product of every degree but an automatic dp_shard."""
        return self.dp_replicate * self.tp * self.cp * self.ep * (self.dp_shard if self.dp_shard > 0 else 1)

    def degrees(self, ranks: int) -> dict[str, int]:
        """The degree of every dimension for `ranks` trainer ranks (dp_shard=-1 resolved); a
        ValueError naming the keys and their product when they cannot multiply to `ranks`."""
        if self.dp_shard == 0:
            raise ValueError("train.parallel.dp_shard=0: use a positive degree, or -1 for every rank left")
        named = f"dp_replicate={self.dp_replicate} x tp={self.tp} x cp={self.cp} x ep={self.ep}"
        if self.dp_shard == -1:
            if ranks % self.fixed:
                raise ValueError(f"train.parallel: {named} = {self.fixed} does not divide placement.trainer_ranks={ranks} "
                                 "(dp_shard=-1 takes the ranks left)")
            shard = ranks // self.fixed
        else:
            shard = self.dp_shard
            if self.fixed != ranks:
                raise ValueError(f"train.parallel: dp_shard={shard} x {named} = {self.fixed}, but "
                                 f"placement.trainer_ranks={ranks}: the product of the degrees must equal the trainer ranks")
        return {"dp_replicate": self.dp_replicate, "dp_shard": shard, "cp": self.cp, "tp": self.tp, "ep": self.ep}


class MoeConfig(Section):
    """Mixture-of-experts training (a model with top-k routers, e.g. Qwen3-MoE; docs/moe.md). The
    router always runs in float32 (tidal/models/moe.py)."""

    routing_replay: Literal["none", "R2", "R3"] = Field("none", description="Routing replay. R3 (rollout routing replay): on every generated token the trainer's forward (log-prob pass and update) uses the experts the engine chose (recorded per token and layer, carried by the episodes), while the router's weight still gets its gradient through its softmax at those experts; prompt and observation tokens (which the engine did not generate) use the trainer's own routing. R2: the trainer's own routing, recorded in the log-prob pass that computes the PPO anchor, is replayed in the updates (only when there is such a pass: train.mini_batches x train.epochs > 1). none: the trainer routes every token itself.")
    aux_loss_coef: float = Field(0.0, ge=0.0, description="Load-balancing loss (Switch/transformers': experts x sum over experts of token share x mean router probability, per layer, averaged over layers) added to the policy loss with this coefficient. 0 (the default, as the large-MoE RL recipes run): off.")
    measure_unreplayed: bool = Field(False, description="With routing replay on, also run each micro-batch once without replay (no gradient) to report the engine/trainer log-prob mismatch the replay removed (moe/logprob_abs_diff_unreplayed): one more forward per micro-batch.")


class TrainConfig(Section):
    steps: int = Field(60, ge=1, description="Training steps (one rollout batch each).")
    lr: float = Field(3e-4, gt=0.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up over this many optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warm-up: constant, or cosine decay to min_lr_ratio × lr at the last step.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Floor of the cosine schedule, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one micro-batch (padded tokens); micro-batches are derived from it.")
    mixed_precision: bool = Field(False, description="Compute forward and backward in bfloat16 over float32 master weights and optimizer state (FSDP2's MixedPrecisionPolicy with float32 gradient reduction when sharded, torch.autocast otherwise); needs model.dtype=float32. Log-probs, losses and the entropy stay float32.")
    attention: Literal["auto", "sdpa", "eager"] = Field("auto", description="The trainer's attention (transformers' attn_implementation): sdpa (torch's scaled_dot_product_attention), eager (matmuls and a float32 softmax), or auto: eager with train.mixed_precision on a CPU, sdpa otherwise. On a CPU, torch's fused attention backward in bfloat16 took 4.5x its float32 time on the default job, more than the bfloat16 matmuls saved; eager runs its matmuls in bfloat16 too (docs/algorithms.md, Mixed precision).")
    packing: bool = Field(False, description="Pack each micro-batch's sequences into rows as long as its longest (first-fit decreasing), each sequence at its own positions from 0, attention kept within it: the padding the plain path computes on is skipped. The same loss and gradient as the padded path up to float summation order (tests/test_packing.py). The critic stays padded.")
    share_prompts: bool = Field(False, description="Compute a prompt once for all the sequences of a micro-batch that open with it (a GRPO group's samples): each sequence's own tokens attend to the one copy through a 4-D attention mask, and its gradient is the sum of what the copies would have received. The same loss and gradient as the padded path up to float summation order (tests/test_packing.py); a group longer than the model's hidden size (or the batch's longest sequence, if longer) is laid out as several units, each with the prompt, so that the attention over a row stays cheap (docs/algorithms.md). Text models, sdpa or eager attention; the critic stays padded.")
    activation_checkpointing: bool = Field(False, description="Recompute each transformer block's activations in the backward pass instead of keeping them (transformers' gradient checkpointing, non-reentrant): activation memory of about one block instead of all, for about one more forward pass of compute (not measured here yet). The same gradients (tests/test_trainer.py).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (peft) instead of full fine-tuning; off at rank 0.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="The trainer ranks' device mesh: data-parallel replicas and shards, tensor parallelism (docs/parallel.md). Default: FSDP2 over every rank.")
    logprob_chunk_tokens: int = Field(512, ge=1, description="Log-probs and entropy are computed from the output head this many tokens at a time (their logits recomputed in the backward pass), so memory holds chunk x vocabulary logits, never tokens x vocabulary (tidal/trainer/parallel/logprob.py).")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch; the global batch must divide evenly.")
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    moe: MoeConfig = Field(default_factory=MoeConfig, description="Mixture-of-experts models: routing replay and the balancing loss (docs/moe.md).")
    max_nonfinite_steps: int = Field(3, ge=1, description="The run stops (exit code 3, its last checkpoint intact) after this many steps in a row with a non-finite gradient (NaN or inf: such an update is skipped, `skipped_step` in the metrics), rather than skipping forever.")

    @model_validator(mode="after")
    def _ep_without_lora(self) -> TrainConfig:
        if self.parallel.ep > 1 and self.lora.rank > 0:
            raise ValueError(f"train.parallel.ep={self.parallel.ep} with train.lora: adapters on expert-parallel experts "
                             "are not supported; use ep=1 (FSDP) with LoRA")
        return self
