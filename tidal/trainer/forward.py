"""One micro-batch through one of the trainer's models: its sequences laid out (padded,
packed, or with shared prompts), a vision-language model's images and positions, a mixture of
experts' routing, and the output head's log-probs and entropy at the scored positions only.

The Trainer (tidal/trainer/trainer.py) decides what runs (policy, reference, dummy passes) and
on which sequences; this module decides how a micro-batch becomes the model's inputs and its
scores come back in the targets' [B, longest - 1] layout. The choice: one object built with the
trainer's settings, called with the model to run, so the policy and the frozen reference (or
the policy with its LoRA adapters off) go through the same layout and head; the layouts
themselves are pure functions of tidal/trainer/layout.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tidal.config import TrainConfig
from tidal.images import as_image
from tidal.models.vision import Vision
from tidal.trainer.layout import at_mask, keep_rows, packed_inputs, packed_order, pad_rows, padded, shared_inputs
from tidal.trainer.parallel.context import ContextParallel
from tidal.trainer.parallel.logprob import head_scores
from tidal.trainer.routing import TrainerRouting


class MicroBatchForward:
    """Built once by the Trainer (its `_forward`), called as `forward(model, tokens, ...)` for the
    policy, the frozen reference and data parallelism's dummy passes (`__call__`'s docstring)."""

    def __init__(self, policy, train: TrainConfig, *, temperature: float, pad_token_id: int, device: torch.device,
                 vision: Vision | None, attention: str, autocast: bool, context: ContextParallel | None,
                 routing: TrainerRouting, world_size: int, model_dir: Path):
        self.policy = policy  # the model whose routers record and replay (`routing`)
        self.train_cfg, self.temperature, self.pad_token_id, self.device = train, temperature, pad_token_id, device
        self.vision, self.attention, self.autocast, self.context = vision, attention, autocast, context
        self.routing, self.world_size, self.model_dir = routing, world_size, model_dir
        # the vision special tokens, masked out of every distribution as the engines mask them
        self.banned = None if vision is None else torch.tensor(vision.banned_token_ids, device=device)
        self.records: list | None = None  # the last forward's routing per sequence, when asked (R2)

    def __call__(self, model, tokens: list[list[int]], keep: torch.Tensor | None = None,
                 images: list[list] | None = None, prompts: list[int] | None = None, unit_len: int | None = None,
                 routing: dict | None = None):
        """(log-probs, entropy) [B, longest - 1] of every sequence's targets under softmax(logits /
        temperature), float32, 0 outside `keep` ([B, longest - 1] bool, the targets' layout;
        default: every sequence's own targets). Only the kept positions reach the output head
        (`keep_rows`), and the head computes their log-probs and entropy from the hidden states
        `train.logprob_chunk_tokens` at a time, on its vocabulary shards under tensor parallelism
        (`head_scores`, tidal/trainer/parallel/logprob.py): no tokens x vocabulary logits exist.

        `train.packing`: the model runs on the packed rows (`packed_inputs`), attention kept
        within each sequence by transformers' packed-sequence mask, which it derives from
        position ids that restart at 0 (no attention mask passed).

        `prompts` (`train.share_prompts`: each sequence's prompt length, `Trainer._prompts`): sequences
        that open with the same prompt run it once (`shared_inputs`, units of at most `unit_len`
        tokens: `Trainer._unit_len`), under a 4-D attention mask.

        A vision-language model (`images`: per sequence, one per image run of its tokens) also
        gets each sequence's mRoPE positions and the micro-batch's pixels in the order its image
        pads appear, and its vision special tokens' logits are masked (`banned`): the policy's
        distribution is the one the engines sample from.

        A mixture of experts (`routing`: `TrainerRouting.forward`'s keyword arguments: `records` to
        replay, `policy_BT` and `engine` to count, `aux`, and `keep_records` to keep this forward's
        routing per sequence in `self.records`): the policy's routers run inside it, given each
        token's flat position in the laid-out rows (tidal/trainer/routing.py)."""
        targets = pad_rows(tokens, self.pad_token_id, torch.long, self.device)[:, 1:]
        B, T = targets.shape
        if keep is None:
            lengths = torch.tensor([len(t) - 1 for t in tokens], device=self.device)
            keep = torch.arange(T, device=self.device)[None, :] < lengths[:, None]
        seqs, vis = self._with_images(tokens, images)
        kept = targets[keep]
        pos = allowed = None
        kw = {}
        if prompts is not None and len(seqs) > 1:
            # context parallel: the spans of the layout, not its [rows, S, S] mask
            ids, pos, allowed, index = shared_inputs(seqs, prompts, self.pad_token_id, self.device, unit_len,
                                                     spans=self.context is not None)
            flat = index[:B, :T]
            kw = {"position_ids": pos, "use_cache": False}
            if self.context is None:
                kw["attention_mask"] = self._mask_4d(allowed)
        elif self.train_cfg.packing and len(seqs) > 1:
            rope = None if vis is None else [self._rope(t, im, i) for i, (t, im) in enumerate(zip(seqs, vis))]
            ids, pos, index = packed_inputs(seqs, self.pad_token_id, self.device, rope)
            flat = index[:B, :T]  # index[:B]: a dummy image's sequence (data parallel) is not scored
            kw = {"position_ids": pos, "use_cache": False,
                  **({} if vis is None else self._pixels(vis, packed_order([len(t) for t in seqs])))}
        else:
            ids, kw, flat = self._padded_inputs(seqs, vis, B, T)
        rows = flat[keep]

        def run(model, ids, rows, targets, **kw):
            head = head_scores(model, targets, self.temperature, self.train_cfg.logprob_chunk_tokens, self.banned)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast), \
                    keep_rows(model, rows), head:
                return model(input_ids=ids, **kw).logits

        if self.context is None:
            routed = routing is not None and model is self.policy and self.routing
            with self.routing.forward(flat_BT=flat, lengths=[len(t) for t in tokens], numel=ids.numel(),
                                      **{k: v for k, v in routing.items() if k != "keep_records"}) \
                    if routed else contextlib.nullcontext():
                out = run(model, ids, rows, kept, **kw)
            if routed and routing.get("keep_records"):
                self.records = self.routing.records(flat, [len(t) for t in tokens])
        else:  # context parallel: this rank's slice of the positions; the scores come back whole
            out = self.context.forward(
                model, ids, pos, allowed, rows,
                lambda m, ids, pos, rows, sel: run(m, ids, rows, kept[sel], position_ids=pos, use_cache=False))
        return at_mask(keep, out[:, 0]), at_mask(keep, out[:, 1])

    def _padded_inputs(self, seqs, vis, B: int, T: int):
        """The padded layout of `__call__`: (input ids [B, longest], the model's keyword arguments,
        the flat positions of the [B, T] targets in [B, longest] hidden states)."""
        ids, attn = padded(seqs, self.pad_token_id, self.device)
        kw = {"attention_mask": attn}
        if vis is not None:  # padding positions: 0 (masked out)
            vpos = torch.zeros((3, *ids.shape), dtype=torch.long)
            for i, (t, im) in enumerate(zip(seqs, vis)):
                vpos[:, i, :len(t)] = self._rope(t, im, i)
            kw |= {"position_ids": vpos.to(self.device), "use_cache": False, **self._pixels(vis, range(len(seqs)))}
        flat = torch.arange(B, device=self.device)[:, None] * ids.shape[1] + torch.arange(T, device=self.device)
        return ids, kw, flat

    def _mask_4d(self, allowed: torch.Tensor) -> torch.Tensor:
        """A 4-D attention mask as the attention takes it: sdpa a boolean one (True: attend), eager
        an additive one (0, or float32's minimum where masked; transformers adds it to the scores)."""
        if self.attention == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)

    def _with_images(self, tokens: list[list[int]], images: list[list] | None):
        """The sequences to run and, for a vision-language model, each one's images (else None).

        Data parallel, a micro-batch without any image gets one more sequence holding a dummy
        image: FSDP gathers the vision tower's blocks in the forward and reduce-scatters their
        gradients in the backward only on a rank that runs it, so every rank runs it in every
        pass, or the ranks' collectives would pair up wrongly. The dummy sequence is never
        scored: its logits leave the loss, so its gradient (and so its share of every
        parameter's gradient) is exactly 0, while its activations stay in the graph, so the
        vision tower's (zero) gradients are reduced with the other ranks'."""
        if self.vision is None:
            if images is not None and any(images):
                raise ValueError(f"the batch carries images, but `{self.model_dir}` is a text-only model")
            return tokens, None
        vis = [list(im) for im in images] if images is not None else [[] for _ in tokens]
        if len(vis) != len(tokens):
            raise ValueError(f"{len(tokens)} sequences but images for {len(vis)}")
        if self.world_size > 1 and not any(vis):
            blob = self._dummy_image()
            return [*tokens, self._dummy_image_tokens(blob)], [*vis, [blob]]
        return tokens, vis

    def _dummy_image(self):
        from PIL import Image


        return as_image(Image.new("RGB", (56, 56)))  # the processor's usual minimum: 4 tokens

    def _dummy_image_tokens(self, blob) -> list[int]:
        spec = self.vision.spec
        return [spec.vision_start_token_id, *[spec.image_token_id] * self.vision.num_tokens(blob),
                spec.vision_end_token_id]

    def _rope(self, tokens: list[int], images: list, i: int) -> torch.Tensor:
        try:
            return self.vision.positions(tokens, images)
        except ValueError as e:
            raise ValueError(f"sequence {i} of a micro-batch ({len(tokens)} tokens): {e}; TrainBatch.images must hold "
                             "one image per run of image pads, in order") from None

    def _pixels(self, images: list[list], order) -> dict:
        """The vision tower's inputs: the images of the sequences in `order` (the order their
        image pads take in the input ids), concatenated; nothing when there are none."""
        blobs = [b for i in order for b in images[i]]
        if not blobs:
            return {}
        pixel_values, grid = self.vision.pixels(blobs)
        return {"pixel_values": pixel_values.to(self.device), "image_grid_thw": grid.to(self.device)}
