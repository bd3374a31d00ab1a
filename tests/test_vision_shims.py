"""tidal/models/vision_shims.py, the transformers part (no vLLM needed): where torchvision cannot be
imported, transformers' Qwen2-VL processor module and `Qwen2VLProcessor.from_pretrained` fail without
the shims and work with them, and the image-only processor they give vLLM turns a picture into the
same pixels and grid as tidal's own image processor. Run in a fresh interpreter: the shims patch
transformers process-wide. (The vLLM part runs in tests/test_vlm_vllm.py, where vLLM starts with it.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tidal.recipes.tiny_vlm import build_untrained_vlm

SCRIPT = r"""
import json, sys
import torch
from PIL import Image, ImageDraw
from tidal.images import as_image
from tidal.models.vision import Vision
from tidal.models import vision_shims

out = {"torchvision": vision_shims.torchvision_usable()}
try:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # noqa: F401
    out["module_before"] = "ok"
except Exception as e:
    out["module_before"] = type(e).__name__
from transformers import Qwen2VLProcessor
try:
    Qwen2VLProcessor.from_pretrained(sys.argv[1])
    out["processor_before"] = "ok"
except Exception as e:
    out["processor_before"] = type(e).__name__
out["applied"] = [vision_shims.apply_transformers_shims(), vision_shims.apply_transformers_shims()]
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
out["smart_resize"] = list(smart_resize(60, 100, factor=28, min_pixels=56 * 56, max_pixels=224 * 224))
proc = Qwen2VLProcessor.from_pretrained(sys.argv[1])
out["has_video_processor"] = hasattr(proc, "video_processor")
vision = Vision.load(sys.argv[1])
same = []
for w, h in [(56, 56), (100, 60), (400, 300), (20, 20)]:
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).rectangle((3, 5, w // 2, h // 2), fill="red")
    blob = as_image(img)
    theirs = proc(images=[blob.pil()], text=["<|image_pad|>"], return_tensors="pt")
    pixels, grid = vision.process(blob)
    same.append([list(grid) == theirs["image_grid_thw"][0].tolist(), bool(torch.equal(pixels, theirs["pixel_values"])),
                 theirs["input_ids"][0].tolist().count(vision.image_token_id) == vision.num_tokens(blob)])
out["same"] = same
print(json.dumps(out))
"""


def test_transformers_shims_give_an_image_only_processor_equal_to_tidals(tmp_path):
    d = build_untrained_vlm(tmp_path / "vlm")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(d)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["torchvision"]:  # nothing to patch: the shims stay off
        assert out["applied"] == [False, False]
        return
    # What breaks without them (the module docstring's reasons), then what works with them.
    assert out["module_before"] == "ModuleNotFoundError"
    assert out["processor_before"] == "ImportError"
    assert out["applied"] == [True, True]  # idempotent
    assert out["smart_resize"] == [56, 112]
    assert out["has_video_processor"] is False
    assert out["same"] == [[True, True, True]] * 4  # grid, pixel values, expanded pads
