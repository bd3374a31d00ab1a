"""Images as values (tidal/images.py) and a vision-language model's placeholders and positions
(tidal/models/vision.py), against transformers' own Qwen2-VL and Qwen2.5-VL where they define the answer."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch
from PIL import Image, ImageDraw

from tidal.images import ImageDir, ImageError, as_image, normalize_messages
from tidal.models.vision import Vision, rope_positions
from tidal.recipes.tiny_vlm import build_untrained_vlm


def picture(color="red", size=(40, 30)):
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((2, 2, size[0] // 2, size[1] // 2), fill=color)
    return img


def encoded(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_the_same_picture_has_one_id_whatever_shape_or_lossless_format_it_came_in(tmp_path):
    img = picture()
    (tmp_path / "a.bmp").write_bytes(encoded(img, "BMP"))
    url = "data:image/png;base64," + base64.b64encode(encoded(img, "PNG")).decode()
    shapes = [img, encoded(img, "PNG"), encoded(img, "BMP"), str(tmp_path / "a.bmp"), url,
              {"bytes": encoded(img, "PNG"), "path": None}, img.convert("RGBA"), img.convert("P")]
    ids = {as_image(s).id for s in shapes}
    assert len(ids) == 1
    assert as_image(picture("blue")).id not in ids  # another picture, another id
    blob = as_image(img)
    again = pickle.loads(pickle.dumps(blob))  # what crosses a process boundary: the PNG, not the decoded picture
    assert again == blob and again.pil().tobytes() == img.tobytes()


def test_transparency_lands_on_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert as_image(rgba).pil().getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("value, why", [
    (b"not an image", "not a readable image"),
    ("data:image/png,notbase64", "base64-encoded"),
    ("https://example.com/a.png", "fetches nothing"),
    (3.5, "cannot read an image from a float"),
    ({"other": 1}, "needs `bytes`, `path` or `url`"),
])
def test_unreadable_images_are_named(value, why):
    with pytest.raises(ImageError, match=why) as e:
        as_image(value, where="row 7")
    assert "row 7" in str(e.value)


def test_a_decompression_bomb_is_refused_before_decoding(monkeypatch):
    from tidal import images

    monkeypatch.setattr(images, "MAX_PIXELS", 100)
    with pytest.raises(ImageError, match="larger than 100 pixels"):
        as_image(encoded(picture(size=(20, 20)), "PNG"))


def test_normalize_messages_takes_placeholders_from_the_row_in_order():
    a, b = picture("red"), picture("green")
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                          + base64.b64encode(encoded(a, "PNG")).decode()}}]}]
    out, blobs = normalize_messages(msgs, row_images=[b, a])
    assert [x.id for x in blobs] == [as_image(b).id, as_image(a).id, as_image(a).id]
    assert out[0] == msgs[0] and out[1]["content"][1] == {"type": "text", "text": "and"}
    assert all(p["type"] == "image" for p in out[1]["content"][::2])
    with pytest.raises(ImageError, match="no image left"):
        normalize_messages(msgs, row_images=[b])
    with pytest.raises(ImageError, match="1 image.*that no"):
        normalize_messages(msgs, row_images=[b, a, a])


def test_image_dir_is_content_addressed_and_detects_a_changed_file(tmp_path):
    store = ImageDir(tmp_path)
    blob = as_image(picture())
    p = store.put(blob)
    assert store.put(blob) == p and store.get(blob.id) == blob
    p.write_bytes(encoded(picture("blue"), "PNG"))
    with pytest.raises(ImageError, match="do not match its id"):
        store.get(blob.id)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tidal.models import load_model

    d = build_untrained_vlm(tmp_path_factory.mktemp("vlm"))
    return load_model(d).eval(), Vision.load(d)


def test_expand_and_collapse_pair_up_and_mismatches_are_refused(vlm):
    _, v = vlm
    pad, blobs = v.image_token_id, [as_image(picture(size=(56, 56))), as_image(picture(size=(100, 60)))]
    ids = [100, 101, pad, 102, pad, 103]
    out = v.expand(ids, blobs)
    assert [e - s for s, e in v.runs(out)] == [4, 8]
    assert v.collapse(out) == ids
    with pytest.raises(ValueError, match="2 run"):
        v.expand(ids, blobs[:1])
    with pytest.raises(ValueError, match="one <\\|image_pad\\|>"):
        v.expand([100, pad, pad, 101], blobs[:1])


def test_rope_positions_equal_transformers_get_rope_index(vlm):
    model, v = vlm
    pad = v.image_token_id
    blobs = [as_image(picture(size=(56, 56))), as_image(picture(size=(100, 60))), as_image(picture(size=(60, 150)))]
    ids = v.expand([100, 101, pad, 102, 103, 104, pad, 105, pad, 106], blobs)
    ref, _ = model.model.get_rope_index(torch.tensor([ids]), torch.tensor([[int(t == pad) for t in ids]]),
                                        torch.tensor([v.grid(b) for b in blobs]))
    assert torch.equal(v.positions(ids, blobs), ref[:, 0])
    # Qwen2.5-VL's index is the same for images (its videos differ: tidal sends no videos)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=1, num_key_value_heads=1),
                           vision_config=dict(depth=1, hidden_size=16, out_hidden_size=32, intermediate_size=16,
                                              num_heads=1), image_token_id=pad)
    ref25, _ = Qwen2_5_VLModel(cfg).get_rope_index(torch.tensor([ids]), torch.tensor([[int(t == pad) for t in ids]]),
                                                   torch.tensor([v.grid(b) for b in blobs]))
    assert torch.equal(v.positions(ids, blobs), ref25[:, 0])
    with pytest.raises(ValueError, match="needs 4"):
        rope_positions([pad] * 3, [(1, 4, 4)], pad, 2)
