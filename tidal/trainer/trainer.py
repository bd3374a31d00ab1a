"""The Trainer role: policy, optimizer, optional frozen reference and critic; micro-batching by tokens.

`forward_backward` accumulates gradients over micro-batches whose losses are each a
share of the batch loss under one normalization (tidal.algorithms.aggregate), so the
gradient is the same however the batch is split. `optim_step` clips and steps.

Data parallel: when a torch.distributed group of more than one rank is initialized
(tidal.trainer.distributed.init_distributed) before the Trainer is built, every model is
FSDP2-sharded over it and each rank trains on its own shard of the global batch. Then
every public method is a collective that ALL ranks must call, in the same order: FSDP
gathers parameters in each forward and reduce-scatters gradients in each backward, so
ranks pad their micro-batch loops with dummy passes to the same count. Gradients are
summed across ranks under the global denominators, so they equal the single-process
gradient of the whole batch. Without a group (or with one rank) nothing changes.

Vision-language models (Qwen2-VL family, tidal/models/vision.py): `TrainBatch.images` holds each
sequence's images; a forward gets every sequence's mRoPE positions (computed from its tokens and
images, as the torch engine computes them) and the micro-batch's pixels, and the vision special
tokens' logits are masked out of every forward's distribution, as the engines mask them. The
vision tower trains with the rest unless LoRA freezes it. Data parallel, a micro-batch with no
image runs the tower on a dummy image (`_with_images`, tidal/trainer/forward.py) so that every
rank joins its collectives. A critic (algorithm.advantage=gae) is refused for these models.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.algorithms import build_estimator, kl_estimate, needs
from tidal.algorithms.objective import LossInputs, build_objective
from tidal.config import AlgorithmConfig, TrainConfig
from tidal.importing import import_object
from tidal.models import load_model, resolve_model_dir
from tidal.models.moe import install_routers
from tidal.models.vision import Vision
from tidal.trainer import distributed as dp
from tidal.trainer.critic import Critic
from tidal.trainer.forward import MicroBatchForward
from tidal.trainer.inputs import TrainBatch, refuse_what_cannot_work
from tidal.trainer.layout import micro_batches, pad_rows, padded, shared_micro_batches
from tidal.trainer.lora import add_lora, merged_weights
from tidal.trainer.parallel import ParallelDims, parallelize
from tidal.trainer.parallel.context import ContextParallel
from tidal.trainer.routing import TrainerRouting
from tidal.trainer.trainer_state import load_checkpoint, lr_factor, save_checkpoint


class Trainer:
    def __init__(self, model_path: str, train: TrainConfig, algo: AlgorithmConfig, *,
                 dtype: str = "float32", temperature: float = 1.0, pad_token_id: int = 0, device: str = "cpu",
                 norm_len: int = 1):
        self.train_cfg, self.algo = train, algo
        self.objective = build_objective(algo, import_object)  # algorithm.loss, or tidal's PolicyObjective
        # An estimator that declares needs_values (gae) gets a critic, trained beside the policy.
        self.needs_values = needs(build_estimator(algo, import_object), "values")
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_token_id = pad_token_id
        self.norm_len = float(norm_len)  # seq-mean-token-sum-norm's constant
        self.device = torch.device(device)
        self.world_size = dp.world_size()  # > 1: ranks laid out by train.parallel (tidal/trainer/parallel)
        self.dims = ParallelDims.from_config(train.parallel, self.world_size).build(self.device.type)
        self.model_dir = resolve_model_dir(model_path)
        # A vision-language model's images, placeholders and positions; None: a text model (module docstring)
        self.vision = Vision.load(self.model_dir)
        refuse_what_cannot_work(train, algo, self.dims, self.vision is not None, self.needs_values, dtype, model_path)
        # Eager attention under CPU mixed precision: torch's fused CPU attention backward is slow in
        # bfloat16 (train.attention).
        self.attention = train.attention if train.attention != "auto" else (
            "eager" if train.mixed_precision and self.device.type == "cpu" else "sdpa")
        self.model = load_model(model_path, dtype=dtype, device=device, attention=self.attention)
        # A mixture of experts: float32 routers that record and replay (tidal/trainer/routing.py),
        # installed before LoRA and sharding wrap the model.
        self.routing = TrainerRouting(self.model, train.moe.routing_replay, train.moe.aux_loss_coef)
        self._hidden = int(getattr(self.model.config, "hidden_size", 0) or 0)  # train.share_prompts' unit length
        self.model.config.use_cache = False
        self.lora = train.lora.rank > 0
        if self.lora:  # adapters only; the base weights stay frozen (and serve as the reference)
            self.model = add_lora(self.model, train.lora)
            # the adapter's record of its base, as an absolute path: `tidal eval <checkpoint>/adapter` finds it
            self.model.peft_config["default"].base_model_name_or_path = str(resolve_model_dir(model_path).resolve())
        if train.activation_checkpointing:  # blocks recompute their activations in backward
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        # Mixed precision: bfloat16 compute over these float32 parameters (the optimizer's state
        # follows them). Sharded, FSDP2 casts per group and reduces gradients in float32;
        # otherwise autocast casts per op (matmuls in bfloat16, reductions and softmax in float32).
        mixed = train.mixed_precision
        self.context = None  # context parallelism (train.parallel.cp): tidal/trainer/parallel/context.py
        if self.dims.cp > 1:
            self.context = ContextParallel(self.dims.cp_mesh)
        parallelize(self.model, self.dims, mixed_precision=mixed)  # before the optimizer: it holds the shards
        if self.context is not None:
            self.context.prepare(self.model)
        self.ref_model = None
        self.has_ref = algo.kl_coef > 0
        if self.has_ref and not self.lora:  # no reference model is loaded when it cannot matter
            self.ref_model = load_model(model_path, dtype=dtype, device=device,
                                        attention=self.attention).eval().requires_grad_(False)
            install_routers(self.ref_model)  # its router in float32 too
            parallelize(self.ref_model, self.dims, mixed_precision=mixed, reshard_root=True)
            if self.context is not None:
                self.context.prepare(self.ref_model)
        self.critic = None
        if self.needs_values:
            self.critic = Critic(algo.critic.path or model_path, algo.critic, dtype=dtype, device=self.device,
                                 warmup_steps=train.warmup_steps, betas=train.betas, dims=self.dims)
        # tensor parallelism mixes DTensor and plain parameters (norms), which foreach kernels refuse
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=train.lr, betas=train.betas,
            weight_decay=train.weight_decay, **({"foreach": False} if self.dims.tp > 1 else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train))
        self.version = 0
        # one micro-batch through a model: layout, images, routing, the head's scores (tidal/trainer/forward.py)
        self._forward = MicroBatchForward(
            self.model, train, temperature=self.temperature, pad_token_id=pad_token_id, device=self.device,
            vision=self.vision, attention=self.attention, autocast=mixed and not self.dims.fsdp, context=self.context,
            routing=self.routing, world_size=self.world_size, model_dir=self.model_dir)

    # -- forward passes -------------------------------------------------------------------
    def _inputs(self, tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return padded(tokens, self.pad_token_id, self.device)

    def _prompts(self, batch: TrainBatch, idx: list[int] | None = None) -> list[int] | None:
        """`train.share_prompts`: each sequence's prompt length (its tokens before the first policy
        token; all of them but the last when it has none), for `idx` (default: all); else None."""
        if not self.train_cfg.share_prompts:
            return None
        out = []
        for i in range(len(batch)) if idx is None else idx:
            m = batch.loss_mask[i]
            out.append(next((j for j, on in enumerate(m) if on), len(m) - 1))
        return out

    def _unit_len(self, batch: TrainBatch) -> int | None:
        """`train.share_prompts`: the longest a unit (a prompt and its samples' own tokens) may be,
        the model's hidden size or the batch's longest sequence if longer; else None. Eager or
        masked attention costs each row its length squared, the linear layers each token its hidden
        size squared: on rows up to the hidden size attention stays a small share. Measured once on
        the default model (hidden 128; a one-off timing, docs/algorithms.md), one update of a GRPO batch: 0.28 s against 0.33 s with whole
        groups as units (18-token prompts, answers of 6-32 tokens), 0.58 s against 1.5 s
        (long-tailed answers up to 192 tokens), in bfloat16."""
        if not self.train_cfg.share_prompts or not len(batch):
            return None
        return max(self._hidden, max(len(t) for t in batch.tokens))

    def _micro_batches(self, batch: TrainBatch) -> list[list[int] | None]:
        """This batch's micro-batches. Data parallel: padded with `None` (a dummy pass) to the
        largest count over ranks, since every rank must run as many FSDP forwards and
        backwards; a sequence over the budget on any rank raises on every rank."""
        lengths = [len(t) for t in batch.tokens]
        budget, prompts = self.train_cfg.micro_batch_tokens, self._prompts(batch)
        split = (lambda: micro_batches(lengths, budget)) if prompts is None else (
            lambda: shared_micro_batches(batch.tokens, prompts, budget, self._unit_len(batch)))
        if self.world_size == 1:
            return split()
        parts: list[list[int]] = []
        error = None
        try:
            parts = split()
        except ValueError as e:
            error = e
        count, failed = dp.all_reduce([len(parts), float(error is not None)], "max", self.device)
        if error is not None:
            raise error
        if failed:
            raise ValueError("another trainer rank's batch has a sequence longer than train.micro_batch_tokens="
                             f"{self.train_cfg.micro_batch_tokens}")
        return parts + [None] * (int(count) - len(parts))

    def _dummy_tokens(self) -> list[list[int]]:
        return [[self.pad_token_id, self.pad_token_id]]  # two tokens: one target position

    @torch.no_grad()
    def _per_position(self, batch: TrainBatch, model, fn) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in range(len(batch))]
        unit_len = self._unit_len(batch)
        for idx in self._micro_batches(batch):
            if idx is None:  # data parallel: another rank still has micro-batches; join its all-gathers
                fn(self._dummy_tokens(), None, None, None, None)
                continue
            values = fn([batch.tokens[i] for i in idx], None if batch.images is None else [batch.images[i] for i in idx],
                        self._prompts(batch, idx), unit_len, idx)
            for row, i in enumerate(idx):
                out[i] = values[row, : len(batch.tokens[i]) - 1].tolist()
        dp.reshard(model)
        return out

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Current-policy log-probs of every token after the first (position 0 scores token 1).
        Data parallel: a collective; each rank scores its own batch."""
        return self._logprobs(batch)

    def logprobs_routed(self, batch: TrainBatch) -> list[tuple[list[float], object]]:
        """R2 (train.moe.routing_replay): per sequence, its log-probs (as `logprobs`) and the experts
        this pass routed its tokens to (a compact record, tidal/models/moe.py), to replay in the
        updates. Data parallel: a collective."""
        records: list = [None] * len(batch)
        lps = self._logprobs(batch, records)
        return list(zip(lps, records))

    def _logprobs(self, batch: TrainBatch, records: list | None = None) -> list[list[float]]:
        def fn(toks, ims, prompts, unit_len, idx):
            routing = self._routing_args(batch, idx, keep_records=records is not None and idx is not None)
            out = self._forward(self.model, toks, images=ims, prompts=prompts, unit_len=unit_len, routing=routing)[0]
            if routing.get("keep_records"):
                for row, i in enumerate(idx):
                    records[i] = self._forward.records[row]
            return out

        return self._per_position(batch, self.model, fn)

    def _routing_args(self, batch: TrainBatch, idx: list[int] | None, **kw) -> dict:
        """`_forward`'s `routing` for the micro-batch `idx` of `batch`: the records that
        train.moe.routing_replay replays (R3: the engine's; R2: the log-prob pass's, when the batch
        has them), and `kw` (statistics, keep_records)."""
        pick = lambda xs: None if xs is None or idx is None else [xs[i] for i in idx]
        mode = self.routing.mode
        records = pick(batch.routed_experts) if mode == "R3" else pick(batch.trainer_routing) if mode == "R2" else None
        return {"records": records, **kw}

    def _ref_forward(self, tokens: list[list[int]], keep: torch.Tensor | None = None, images: list[list] | None = None,
                     prompts: list[int] | None = None, unit_len: int | None = None):
        """`_forward` of the frozen reference: its own model, or under LoRA the policy with its
        adapters off (the base weights, which never train)."""
        if not self.lora:
            return self._forward(self.ref_model, tokens, keep, images, prompts, unit_len)
        with self.model.disable_adapter():
            return self._forward(self.model, tokens, keep, images, prompts, unit_len)

    def ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The frozen reference's log-probs, aligned as `logprobs`."""
        if not self.has_ref:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        return self._per_position(batch, self.model if self.lora else self.ref_model,
                                  lambda toks, ims, prompts, unit_len, _idx: self._ref_forward(
                                      toks, images=ims, prompts=prompts, unit_len=unit_len)[0])

    def values(self, batch: TrainBatch) -> list[list[float]]:
        """The critic's V(s_t), aligned as `logprobs`."""
        if self.critic is None:
            raise RuntimeError(f"no critic: algorithm.advantage={self.algo.advantage} declares no needs_values")
        return self._per_position(batch, self.critic.model, lambda toks, _i, _p, _u, _idx: self.critic.forward(*self._inputs(toks)))

    def _dummy_backward(self, kl_in_loss: bool, with_critic: bool) -> None:
        """A pass that adds exactly zero to every gradient but runs the same FSDP collectives
        as a real micro-batch: policy forward and backward, the reference's forward, the
        critic's forward and backward."""
        toks = self._dummy_tokens()
        logp, ent = self._forward(self.model, toks)
        if kl_in_loss:
            with torch.no_grad():
                self._ref_forward(toks)
        if with_critic:
            (self.critic.forward(*self._inputs(toks)).sum() * 0.0).backward()
        ((logp.sum() + ent.sum()) * 0.0).backward()

    def forward_backward(self, batch: TrainBatch, kl_coef: float | None = None,
                         totals: tuple[float, float] | None = None) -> dict[str, float]:
        """Accumulate the gradient of the batch loss (policy, and critic when there is one);
        return token-weighted metrics. `totals` = (tokens, sequences) of the whole batch
        across data-parallel ranks; default: this batch's own (data parallel: the sum of
        every rank's, all-reduced). `kl_coef` overrides the configured coefficient
        (adaptive KL).

        Data parallel: a collective; `batch` is this rank's shard (possibly empty), and the
        metrics returned are those of the global batch, the same on every rank."""
        algo = self.algo
        kl_coef = algo.kl_coef if kl_coef is None else kl_coef
        kl_in_loss = self.has_ref and algo.kl_in == "loss"
        with_critic = self.critic is not None and batch.returns is not None
        masks = [m[1:] for m in batch.loss_mask]  # aligned with targets
        if totals is None and self.world_size > 1:
            totals = tuple(dp.all_reduce(list(batch.totals()), "sum", self.device, self.dims.dp_group))
        total_tokens, total_seqs = totals if totals is not None else batch.totals()
        own = ("loss", "entropy", "logprob_abs_diff", "mismatch_kl", "value_loss", "value_clip_frac")
        sums = dict.fromkeys((*own, *self.objective.metric_keys), 0.0)
        max_diff = 0.0
        unit_len = self._unit_len(batch)
        for idx in self._micro_batches(batch):
            if idx is None:
                self._dummy_backward(kl_in_loss, with_critic)
                continue
            diff = self._micro_backward(batch, idx, masks, sums, kl_coef=kl_coef, kl_in_loss=kl_in_loss,
                                        with_critic=with_critic, totals=(total_tokens, total_seqs), unit_len=unit_len)
            max_diff = max(max_diff, diff)
        if self.train_cfg.moe.measure_unreplayed and self.routing.mode != "none":
            sums.setdefault("moe/logprob_abs_diff_unreplayed", 0.0)  # every rank has the key: it is all-reduced
        metrics = self._global_metrics(sums, masks, max_diff, kl_in_loss)
        return metrics | self.routing.metrics(self.world_size, self.device, self.dims.dp_group)

    def _micro_backward(self, batch: TrainBatch, idx: list[int], masks: list[list[bool]], sums: dict[str, float], *,
                        kl_coef: float, kl_in_loss: bool, with_critic: bool, totals: tuple[float, float],
                        unit_len: int | None) -> float:
        """One micro-batch's forward and backward (policy, and critic when it trains); its sums
        are added to `sums`. Returns its largest |trainer − engine| log-prob difference."""
        toks = [batch.tokens[i] for i in idx]
        ims = None if batch.images is None else [batch.images[i] for i in idx]
        pad = lambda rows, v=0.0: pad_rows(rows, v, torch.float32, self.device)
        # forward: logits at the policy tokens only; log-probs and entropy 0 elsewhere
        mask = pad_rows([masks[i] for i in idx], False, torch.bool, self.device)
        prompts = self._prompts(batch, idx)
        moe_cfg = self.train_cfg.moe
        aux = moe_cfg.aux_loss_coef > 0
        routing = self._routing_args(batch, idx, policy_BT=mask, aux=aux,
                                     engine=None if batch.routed_experts is None else [batch.routed_experts[i] for i in idx])
        unreplayed = None
        if moe_cfg.measure_unreplayed and routing["records"] is not None:  # the mismatch the replay removes
            with torch.no_grad():
                unreplayed = self._forward(self.model, toks, keep=mask, images=ims, prompts=prompts, unit_len=unit_len,
                                           routing={"records": None})[0]
        logp, entropy = self._forward(self.model, toks, keep=mask, images=ims, prompts=prompts, unit_len=unit_len,
                                      routing=routing)
        ref_logp = None
        if kl_in_loss:
            with torch.no_grad():
                ref_logp = self._ref_forward(toks, keep=mask, images=ims, prompts=prompts, unit_len=unit_len)[0]
        behav = pad([batch.behaviour_logprobs[i][1:] for i in idx])
        x = LossInputs(
            logp=logp, old_logp=logp.detach() if batch.old_logprobs is None else pad([batch.old_logprobs[i]
                                                                                       for i in idx]),
            behaviour_logp=behav, advantages=pad([batch.advantages[i] for i in idx]), mask=mask,
            entropy=entropy if self.objective.entropy_grad else entropy.detach(),
            total_tokens=totals[0], total_seqs=totals[1], norm_len=self.norm_len, ref_logp=ref_logp,
            kl_coef=kl_coef)
        # loss
        out = self.objective(x)
        # backward
        if with_critic:
            ids, attn = self._inputs(toks)
            v_loss, v_sums = self.critic.loss(self.critic.forward(ids, attn), pad([batch.old_values[i] for i in idx]),
                                              pad([batch.returns[i] for i in idx]), mask, totals[0])
            v_loss.backward()  # the critic's own parameters: no interaction with the policy loss
            for k, v in v_sums.items():
                sums[k] += v
        if aux:  # its share of the batch's balancing loss, weighted by its policy tokens like the loss
            (out.loss + moe_cfg.aux_loss_coef * self.routing.aux * (float(mask.sum()) / totals[0])).backward()
        else:
            out.loss.backward()
        for k, v in out.sums.items():
            if k in sums:
                sums[k] += v
        with torch.no_grad():  # what the trainer itself reports: the loss, entropy, engine/trainer mismatch
            m = mask.float()
            sums["loss"] += float(out.loss)
            sums["entropy"] += float((x.entropy.detach() * m).sum())
            diff = (logp.detach() - behav).abs() * m
            sums["logprob_abs_diff"] += float(diff.sum())
            sums["mismatch_kl"] += float((kl_estimate(behav, logp.detach(), "k3") * m).sum())
            if unreplayed is not None:
                sums["moe/logprob_abs_diff_unreplayed"] = sums.get("moe/logprob_abs_diff_unreplayed", 0.0) + float(
                    ((unreplayed - behav).abs() * m).sum())
            return float(diff.max()) if diff.numel() else 0.0

    def _global_metrics(self, sums: dict[str, float], masks: list[list[bool]], max_diff: float,
                        kl_in_loss: bool) -> dict[str, float]:
        """The batch's metrics per policy token (data parallel: of the global batch, the same on
        every rank); those of parts that are off are left out."""
        algo = self.algo
        denom = max(float(sum(sum(m) for m in masks)), 1.0)  # this batch's tokens: metrics are local
        if self.world_size > 1:  # ... unless data parallel: then global, the same on every rank
            keys = list(sums)
            # over the data-parallel ranks: a tp group's ranks hold the same sequences
            *values, tokens = dp.all_reduce([sums[k] for k in keys] + [float(sum(sum(m) for m in masks))], "sum",
                                            self.device, self.dims.dp_group)
            sums, denom = dict(zip(keys, values)), max(tokens, 1.0)
            max_diff = dp.all_reduce([max_diff], "max", self.device)[0]
        metrics = {k: v / denom for k, v in sums.items() if k != "loss"}
        metrics["loss"] = sums["loss"]
        metrics["logprob_max_abs_diff"] = max_diff
        if not kl_in_loss:
            metrics.pop("kl", None)
        if self.critic is None:
            metrics.pop("value_loss"), metrics.pop("value_clip_frac")
        if algo.is_level == "none":
            metrics.pop("is_weight", None), metrics.pop("is_truncated_frac", None)
        if algo.rejection == "none":
            metrics.pop("rejected_frac", None)
        return metrics

    def optim_step(self) -> dict[str, float]:
        """Clip and step (policy, then critic). Data parallel: a collective; the grad norm is
        that of the whole gradient, so every rank takes or skips the step alike."""
        grad_norm = dp.clip_grad_norm(list(self.model.parameters()), self.train_cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.version += 1
        out = {"grad_norm": float(grad_norm), "lr": lr, "skipped_step": float(not torch.isfinite(grad_norm))}
        if self.critic is not None:
            out.update(self.critic.step(self.train_cfg.grad_clip))
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The policy's parameters by name, whole. Data parallel: a collective (each
        parameter is all-gathered); every rank gets the full tensors."""
        if self.lora:
            return merged_weights(self.model)
        if self.world_size == 1:
            return {n: p.detach() for n, p in self.model.named_parameters()}
        dp.reshard(self.model)
        return {n: dp.full_tensor(p.detach()) for n, p in self.model.named_parameters()}

    # -- checkpoints (what they hold and where: tidal/trainer/trainer_state.py) ----------------
    def save(self, path: str | Path, tokenizer=None) -> None:
        """Write a checkpoint that resumes on any number of ranks and any mesh: model/ is a normal
        HF directory (loadable by every engine and `tidal eval`). Data parallel: a collective."""
        save_checkpoint(Path(path), self.model, self.optimizer, self.scheduler, version=self.version,
                        critic=self.critic, lora=self.lora, world_size=self.world_size, tokenizer=tokenizer,
                        processor=None if self.vision is None else self.model_dir / "preprocessor_config.json")

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint saved by any number of ranks on any mesh. Data parallel: a
        collective; every rank reads the files (the checkpoint directory must be visible to all)."""
        self.version = load_checkpoint(Path(path), self.model, self.optimizer, self.scheduler, critic=self.critic,
                                       lora=self.lora, device=self.device, advantage=self.algo.advantage)
