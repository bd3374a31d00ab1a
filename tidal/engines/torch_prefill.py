"""The prompt half of a prefill in the torch engine (tidal/engines/torch_engine.py): the model
over the prompts' uncached tokens, left-padded after each row's cached prefix, with a
vision-language model's image features in the input embeddings.

`TorchEngine` inherits it; it reads the engine's model, device, pad token, vision support,
decode step and caches, and counts `prefill_tokens` and `images_encoded`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from tidal.engines.lean_decode import LeanDecoder
from tidal.engines.prefix_cache import Prefix
from tidal.images import ImageBlob
from tidal.models.vision import next_position
from tidal.types import GenerationRequest


class PromptForward:
    """`_forward_prompts` and its image helpers, for `TorchEngine`."""

    def _forward_prompts(self, reqs: list[GenerationRequest], hits: list[Prefix | None]):
        """The model over the prompts' uncached tokens, left-padded: (cache, attention mask,
        next position, next-token logits), one row per request."""
        dev, B = self.device, len(reqs)
        lens = [len(r.prompt_ids) for r in reqs]
        # Tokens each row has cached (at least one prompt token is fed: its logits are needed).
        cached = [min(len(h.tokens), n - 1) if h is not None else 0 for h, n in zip(hits, lens)]
        S = max(n - c for n, c in zip(lens, cached))  # new tokens fed per row, left-padded
        fed = [min(S, n) for n in lens]  # a row re-feeds cached tokens up to S: its cache stays contiguous
        past = [n - f for n, f in zip(lens, fed)]  # cached tokens used as they are (<= cached)
        P = max(past)
        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((B, P + S), dtype=torch.long)
        for i, r in enumerate(reqs):
            input_ids[i, S - fed[i]:] = torch.tensor(r.prompt_ids[past[i]:])
            attn[i, P - past[i]:P] = 1
            attn[i, P + S - fed[i]:] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        if self.vision is None:
            position_ids = (attn.cumsum(-1) - 1).clamp(min=0)[:, P:]
            inputs = {"input_ids": input_ids}
            next_pos = attn.sum(-1)
        else:  # mRoPE positions of the fed columns and the image features in the input embeddings
            rope = [self.vision.positions(r.prompt_ids, list(r.images)) for r in reqs]
            position_ids = torch.zeros((3, B, S), dtype=torch.long)  # padding: any position (masked)
            for i, pos in enumerate(rope):
                position_ids[:, i, S - fed[i]:] = pos[:, past[i]:]
            position_ids = position_ids.to(dev)
            inputs = {"inputs_embeds": self._embed(input_ids, reqs, past, S)}
            next_pos = torch.tensor([next_position(pos) for pos in rope], dtype=torch.long, device=dev)
        cache = DynamicCache()
        step = self._decoder() if self.vision is None and P == 0 else None
        if isinstance(step, LeanDecoder) and step.prefills and not step.hooked():
            # Text prompts with nothing cached: the lean step's formulas for every prompt token.
            layers, logits, fed_positions = step.prefill_prompts(input_ids, attn, [r.prompt_ids for r in reqs])
            self.prefill_tokens += fed_positions
            for layer, (k, v) in enumerate(layers):
                cache.update(k, v, layer)
            return cache, attn, next_pos, logits
        self.prefill_tokens += sum(fed)
        if P > 0:
            ref = next(h for h, p in zip(hits, past) if p > 0)
            for layer in range(len(ref.keys)):
                k = ref.keys[layer].new_zeros((B, *ref.keys[layer].shape[1:2], P, ref.keys[layer].shape[3]))
                v = ref.values[layer].new_zeros((B, *ref.values[layer].shape[1:2], P, ref.values[layer].shape[3]))
                for i, (h, p) in enumerate(zip(hits, past)):
                    if p:
                        k[i, :, P - p:] = h.keys[layer][0, :, :p]
                        v[i, :, P - p:] = h.values[layer][0, :, :p]
                cache.update(k, v, layer)
        logits = self.model(
            **inputs, attention_mask=attn, position_ids=position_ids,
            cache=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        return cache, attn, next_pos, logits

    def _embed(self, input_ids: torch.Tensor, reqs: list[GenerationRequest], past: list[int], S: int) -> torch.Tensor:
        """Input embeddings [B, S, hidden] of a prefill: the fed tokens' embeddings, each fed image
        pad's replaced by its row of its image's features (a row that re-feeds the end of a cached
        image's run gets that part of its features)."""
        embeds = self.model.get_input_embeddings()(input_ids)
        spans = []  # (row, first column, end column, image, first feature row)
        for i, r in enumerate(reqs):
            first_col = S - (len(r.prompt_ids) - past[i])  # the column of prompt token past[i]
            for (s, e), blob in zip(self.vision.runs(r.prompt_ids), r.images):
                if e > past[i]:  # some of this run is fed
                    a = max(s, past[i])
                    spans.append((i, first_col + a - past[i], first_col + e - past[i], blob, a - s))
        if spans:
            features = self._image_features([blob for *_, blob, _ in spans])
            for i, c0, c1, blob, a in spans:
                embeds[i, c0:c1] = features[blob.id][a:a + c1 - c0].to(embeds.dtype)
        return embeds

    def _image_features(self, blobs: list[ImageBlob]) -> dict[str, torch.Tensor]:
        """Features [tokens, hidden] of each image by id: from the cache, else the vision tower
        (one call for all the missing ones, each image attending only within itself)."""
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, ImageBlob] = {}
        for blob in blobs:
            if blob.id in out or blob.id in missing:
                continue
            hit = self.features.get(blob.id)
            if hit is None:
                missing[blob.id] = blob
            else:
                out[blob.id] = hit
        if missing:
            pixel_values, grid = self.vision.pixels(list(missing.values()))
            encoded = self.model.get_image_features(pixel_values.to(self.device), grid.to(self.device)).pooler_output
            self.images_encoded += len(missing)
            for image_id, f in zip(missing, encoded, strict=True):
                f = f.clone()  # a view of the call's output: kept alone, it would keep all of it
                out[image_id] = f
                self.features.put(image_id, f)
        return out
