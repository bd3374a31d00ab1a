"""Vision-language models (Qwen2-VL and Qwen2.5-VL): their image processor, placeholders and positions.

A vision-language model sees an image as a run of `<|image_pad|>` tokens whose embeddings the
vision tower replaces; how many depends on the image's size after the processor resizes it
(`grid_thw`: temporal × height × width patches, merged `merge_size`² to one token). The chat
template renders each image as ONE pad between `<|vision_start|>` and `<|vision_end|>`;
`Vision.expand` grows each to its run, once, in the rollout. From there on the episode's tokens
are what the model sees: the trainer and the torch engine take the expanded run, and the vLLM
engine, which expands placeholders itself, gets each run collapsed back to one (`collapse`), so
no engine expands twice.

Positions are multimodal RoPE (mRoPE): a text token's three position components are equal and
advance by one; an image's tokens take (t, row, column) offsets from the position where the
image starts, and the text after it resumes at that start + max(rows, columns). `rope_positions`
computes them from the tokens and the images' grids alone (no model needed), as transformers'
`get_rope_index` does; the trainer and the torch engine both use it, so they agree. For a decode
step after the prompt, all three components are the same number (the prompt's largest position
+ 1 + the tokens since), which makes a decode step of the language model an ordinary 1-D RoPE
step at that position.

The image processor is transformers' PIL one (`Qwen2VLImageProcessorPil`), built from the
directory's `preprocessor_config.json`, so nothing here needs torchvision (which is not usable
on every machine: tidal/models/vision_shims.py). Vision special tokens are never sampled:
`banned_token_ids` lists them, and every engine and the trainer mask them out of the policy's
distribution alike.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.images import ImageBlob

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# Processed images kept per Vision object (pixel values and grid by image id): a group's samples
# and an episode's later turns reuse them.
_PIXEL_CACHE_ENTRIES = 512


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def is_vision_config(config: dict) -> bool:
    return config.get("model_type") in VISION_MODEL_TYPES or "vision_config" in config


@dataclass(frozen=True)
class VisionSpec:
    """The token ids and geometry a vision-language model's config fixes."""

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    merge_size: int

    @classmethod
    def from_config(cls, config: dict) -> VisionSpec:
        vc = config.get("vision_config") or {}
        try:
            return cls(config.get("model_type", ""), int(config["image_token_id"]), int(config["video_token_id"]),
                       int(config["vision_start_token_id"]), int(config["vision_end_token_id"]),
                       int(vc.get("spatial_merge_size", 2)))
        except KeyError as e:
            raise ValueError(f"vision-language config has no `{e.args[0]}`") from None

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.vision_start_token_id, self.vision_end_token_id, self.image_token_id, self.video_token_id)


def image_processor(model_dir: str | Path):
    """The model's image processor (PIL backend), from `preprocessor_config.json`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"`{model_dir}` is a vision-language model without preprocessor_config.json "
                                "(its image processor): save it with the model")
    cfg = json.loads(path.read_text())
    keep = {"min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
            "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "size", "resample"}
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k in keep})


class Vision:
    """What tidal needs of a vision-language model outside its forward pass (module docstring)."""

    def __init__(self, spec: VisionSpec, processor):
        self.spec = spec
        self.processor = processor
        self._cache: OrderedDict[str, tuple[torch.Tensor, tuple[int, int, int]]] = OrderedDict()

    @classmethod
    def load(cls, model_dir: str | Path) -> Vision | None:
        """The Vision of a model directory; None for a text-only model."""
        config = read_config(model_dir)
        if not is_vision_config(config):
            return None
        return cls(VisionSpec.from_config(config), image_processor(model_dir))

    @property
    def image_token_id(self) -> int:
        return self.spec.image_token_id

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        return self.spec.special_ids

    # -- pixels ---------------------------------------------------------------------------
    def process(self, blob: ImageBlob) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Pixel patches [patches, C·T·P·P] and grid (t, h, w) of one image (cached by id)."""
        hit = self._cache.get(blob.id)
        if hit is not None:
            # Threads share the cache (an engine validates requests on each generate call's thread):
            # another one may evict this entry between the look-up and here.
            with contextlib.suppress(KeyError):
                self._cache.move_to_end(blob.id)
            return hit
        out = self.processor(images=[blob.pil()], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        hit = (out["pixel_values"], grid)
        self._cache[blob.id] = hit
        if len(self._cache) > _PIXEL_CACHE_ENTRIES:
            with contextlib.suppress(KeyError):  # emptied by other threads' evictions meanwhile
                self._cache.popitem(last=False)
        return hit

    def grid(self, blob: ImageBlob) -> tuple[int, int, int]:
        return self.process(blob)[1]

    def num_tokens(self, blob: ImageBlob) -> int:
        t, h, w = self.grid(blob)
        return t * h * w // self.spec.merge_size ** 2

    def pixels(self, blobs: list[ImageBlob]) -> tuple[torch.Tensor, torch.Tensor]:
        """The vision tower's inputs for `blobs`, in order: pixel values [Σ patches, C·T·P·P]
        and image_grid_thw [len(blobs), 3]."""
        done = [self.process(b) for b in blobs]
        return torch.cat([p for p, _ in done]), torch.tensor([g for _, g in done], dtype=torch.long)

    # -- placeholders ---------------------------------------------------------------------
    def runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, end) of each run of image pads in `ids`."""
        return image_runs(ids, self.spec.image_token_id)

    def check_expanded(self, ids: list[int], images, where: str) -> None:
        """An expanded prompt's image runs pair up with its pictures: ImageBlobs, one per run of image
        pads, in order, each run as long as its picture's token count (the placeholders expanded
        once, for these pictures); no video pads. ValueError naming `where` otherwise."""
        spec = self.spec
        bad = [b for b in images if not isinstance(b, ImageBlob)]
        if bad:
            raise ValueError(f"{where}: images must be tidal.images.ImageBlob (as_image(value)), "
                             f"got {type(bad[0]).__name__}")
        if spec.video_token_id in ids:
            raise ValueError(f"{where}: its prompt holds video pads (token {spec.video_token_id}); "
                             "only images are taken")
        runs = self.runs(ids)
        if len(runs) != len(images):
            raise ValueError(f"{where}: its prompt has {len(runs)} run(s) of image pads (token "
                             f"{spec.image_token_id}) but the request carries {len(images)} image(s); it needs one "
                             "image per run, in order")
        for k, ((s, e), blob) in enumerate(zip(runs, images)):
            need = self.num_tokens(blob)
            if e - s != need:
                raise ValueError(f"{where}: image {k} ({blob.width}x{blob.height}, id {blob.id[:12]}) "
                                 f"takes {need} image tokens but its run (tokens {s}..{e}) has {e - s}; the prompt's "
                                 "placeholders must be expanded once, for these images (Vision.expand)")

    def expand(self, ids: list[int], blobs: list[ImageBlob], where: str = "prompt") -> list[int]:
        """`ids` (rendered by the chat template: one pad per image) with each pad grown to its
        image's run. Raises ValueError when the pads and the images do not pair up."""
        pad = self.spec.image_token_id
        runs = self.runs(ids)
        if len(runs) != len(blobs) or any(e - s != 1 for s, e in runs):
            raise ValueError(f"{where}: the chat template rendered {sum(e - s for s, e in runs)} image placeholder "
                             f"token(s) in {len(runs)} run(s) for {len(blobs)} image(s); it must render each image "
                             "as one <|image_pad|>")
        out: list[int] = []
        last = 0
        for (s, _), blob in zip(runs, blobs):
            out += ids[last:s]
            out += [pad] * self.num_tokens(blob)
            last = s + 1
        return out + ids[last:]

    def collapse(self, ids: list[int]) -> list[int]:
        """Each run of image pads as one pad (what an engine that expands images itself takes)."""
        pad = self.spec.image_token_id
        return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]

    # -- positions ------------------------------------------------------------------------
    def positions(self, ids: list[int], blobs: list[ImageBlob]) -> torch.Tensor:
        """mRoPE positions [3, len(ids)] of one sequence whose image runs are `blobs`' (in order)."""
        return rope_positions(ids, [self.grid(b) for b in blobs], self.spec.image_token_id, self.spec.merge_size)

    def model_inputs(self, ids: list[int], blobs: list[ImageBlob], device=None) -> dict[str, torch.Tensor]:
        """The keyword arguments of one whole-sequence forward of the model ([1, len(ids)]): input ids,
        mRoPE position ids and, when it has images, their pixel values and grids."""
        kw = {"input_ids": torch.tensor([ids], dtype=torch.long),
              "position_ids": self.positions(ids, blobs)[:, None]}
        if blobs:
            kw["pixel_values"], kw["image_grid_thw"] = self.pixels(blobs)
        return {k: v.to(device) for k, v in kw.items()} if device is not None else kw


def image_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(ids):
        if t == image_token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def rope_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                   merge_size: int) -> torch.Tensor:
    """mRoPE position ids [3, len(ids)] (module docstring): text positions advance by one in all
    three components; image k's run (grid (t, h, w), h·w·t / merge² tokens) takes start + (t, row,
    column) and the text after it resumes at start + max(h, w) / merge. A run must be exactly its
    grid's length. Matches transformers' Qwen2-VL `get_rope_index` for images."""
    n = len(ids)
    out = torch.empty((3, n), dtype=torch.long)
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"{len(runs)} image runs in the tokens but {len(grids)} images")
    pos, last = 0, 0
    for (s, e), (t, h, w) in zip(runs, grids):
        if s > last:
            out[:, last:s] = torch.arange(pos, pos + s - last)
            pos += s - last
        gh, gw = h // merge_size, w // merge_size
        if e - s != t * gh * gw:
            raise ValueError(f"an image run of {e - s} tokens where its grid {(t, h, w)} needs {t * gh * gw}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        out[0, s:e] = tt.reshape(-1) + pos
        out[1, s:e] = hh.reshape(-1) + pos
        out[2, s:e] = ww.reshape(-1) + pos
        pos += max(gh, gw)
        last = e
    if n > last:
        out[:, last:] = torch.arange(pos, pos + n - last)
    return out


def next_position(positions: torch.Tensor) -> int:
    """The (text) position of the token after a sequence with mRoPE `positions` [3, n]."""
    return int(positions.max()) + 1 if positions.numel() else 0


# The banned tokens' logit: large and finite, so their probability is exactly 0 in float32 and
# bfloat16 while p·log p (the entropy) stays 0 rather than NaN, as it would with -inf.
BANNED_LOGIT = -1e9


def mask_banned(logits: torch.Tensor, banned_ids: torch.Tensor | list[int] | tuple[int, ...]) -> torch.Tensor:
    """`logits` [..., V] with the vocabulary entries `banned_ids` set to BANNED_LOGIT (a new tensor;
    the gradient into them is 0): the policy's distribution without the vision special tokens,
    which engines sample from and the trainer scores alike."""
    ids = torch.as_tensor(banned_ids, dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, ids, BANNED_LOGIT)
