"""Images in the data path: one canonical value, addressed by its content.

An image reaches tidal in many shapes: a PIL image or a file path in a dataset row, the bytes
of a PNG or JPEG, a `data:` URL in an OpenAI-shaped message, a Hugging Face `datasets` Image
cell (`{"bytes": ..., "path": ...}`), a screenshot a tool returns. `as_image` turns each into an
`ImageBlob`: the picture as RGB, encoded once as PNG (lossless), and its id, the SHA-256 of the
decoded pixels and their size, so the same picture has the same id whatever file format or
encoder it came through. Episodes keep images by this id (`Episode.images`); the bytes travel
with the episode to the trainer and are written once per run under `RUN/images/` (`ImageDir`),
where the replay tool and the dashboard read them back.

Messages carry images as content parts in the OpenAI shape. `normalize_messages` accepts
`{"type": "image", "image": ...}` (the Hugging Face / Qwen form), `{"type": "image_url",
"image_url": {"url": ...}}` (OpenAI's) and a bare `{"type": "image"}` that takes the next image
of the row's `images` (or `image`) column (TRL's convention for vision datasets); each becomes
`{"type": "image", "image": ImageBlob}`, which every vision chat template renders as its image
placeholder.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Largest picture accepted, in pixels: a decompression bomb (a tiny file that decodes to
# gigapixels) is refused before it is decoded. 64 megapixels is far above what a vision model's
# processor keeps (Qwen2-VL resizes to at most ~1 megapixel by default).
MAX_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be read: the message says which and why."""


@dataclass(frozen=True, eq=False)
class ImageBlob:
    """One picture: RGB, its PNG encoding and its content id."""

    id: str  # sha256 hex of "WxH:" + the RGB bytes: the same picture, the same id
    png: bytes
    width: int
    height: int
    _pil: list = field(default_factory=list, repr=False, compare=False)  # decoded once, on demand

    def pil(self):
        """The picture as a PIL image (RGB); decoded once per blob."""
        if not self._pil:
            from PIL import Image

            img = Image.open(io.BytesIO(self.png))
            img.load()
            self._pil.append(img.convert("RGB"))
        return self._pil[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageBlob) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __getstate__(self):  # the decoded picture stays behind: the PNG is what travels
        return {"id": self.id, "png": self.png, "width": self.width, "height": self.height}

    def __setstate__(self, state) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_pil", [])


def image_id(rgb) -> str:
    """The content id of a PIL image in RGB mode."""
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def from_pil(img) -> ImageBlob:
    """An ImageBlob of a PIL image (converted to RGB; transparency over white)."""
    from PIL import Image

    if img.width * img.height > MAX_PIXELS:
        raise ImageError(f"image of {img.width}x{img.height} pixels is larger than {MAX_PIXELS} pixels")
    if img.mode in ("RGBA", "LA", "P") and (img.mode != "P" or "transparency" in img.info):
        rgba = img.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
    else:
        rgb = img.convert("RGB")
    buf = io.BytesIO()
    rgb.save(buf, format="PNG")
    blob = ImageBlob(image_id(rgb), buf.getvalue(), rgb.width, rgb.height)
    blob._pil.append(rgb)
    return blob


def from_bytes(data: bytes, where: str = "image") -> ImageBlob:
    """An ImageBlob of encoded image bytes (PNG, JPEG, GIF, WebP, ...)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise ImageError(f"{where}: {img.width}x{img.height} pixels is larger than {MAX_PIXELS} pixels")
        img.load()
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises several kinds for a bad file
        raise ImageError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return from_pil(img)


def as_image(value: Any, where: str = "image", base_dir: str | Path | None = None) -> ImageBlob:
    """An ImageBlob of any accepted shape: ImageBlob, PIL image, bytes, a file path, a `data:`
    URL, or a `datasets` Image cell ({"bytes", "path"}). Relative paths are read from
    `base_dir` (a dataset's directory) or the working directory. Raises ImageError naming
    `where` and the reason."""
    if isinstance(value, ImageBlob):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return from_bytes(bytes(value), where)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return from_bytes(bytes(value["bytes"]), where)
        if value.get("path"):
            return as_image(str(value["path"]), where, base_dir)
        if "url" in value:
            return as_image(value["url"], where, base_dir)
        raise ImageError(f"{where}: an image dict needs `bytes`, `path` or `url`, got keys {sorted(value)}")
    if isinstance(value, (str, os.PathLike)):
        text = str(value)
        if text.startswith("data:"):
            head, _, payload = text.partition(",")
            if ";base64" not in head:
                raise ImageError(f"{where}: a data URL must be base64-encoded ({head[:40]!r})")
            try:
                data = base64.b64decode(payload, validate=True)
            except ValueError as e:
                raise ImageError(f"{where}: bad base64 in the data URL ({e})") from None
            return from_bytes(data, where)
        if text.startswith(("http://", "https://")):
            raise ImageError(f"{where}: images are read from local files, bytes or data URLs; tidal fetches nothing "
                             f"from the network ({text[:80]!r})")
        path = Path(text.removeprefix("file://"))
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ImageError(f"{where}: image file `{path}` does not exist")
        return from_bytes(path.read_bytes(), f"{where} (`{path}`)")
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(value, Image.Image):
        return from_pil(value)
    raise ImageError(f"{where}: cannot read an image from a {type(value).__name__}")


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image")


def _part_value(part: dict[str, Any]) -> Any:
    """The payload of an image part, or None for a bare placeholder."""
    if part.get("type") == "image_url" or "image_url" in part:
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "image_url", "path", "url", "bytes"):
        if part.get(key) is not None:
            return part[key]
    return None


def normalize_messages(messages: Iterable[dict[str, Any]], row_images: list[Any] | None = None,
                       where: str = "messages", base_dir: str | Path | None = None
                       ) -> tuple[list[dict[str, Any]], list[ImageBlob]]:
    """The messages with every image part as `{"type": "image", "image": ImageBlob}` (text
    parts and string contents unchanged), and the images in the order they appear. A bare
    `{"type": "image"}` takes the next of `row_images` (the row's `images` column)."""
    out: list[dict[str, Any]] = []
    images: list[ImageBlob] = []
    pending = list(row_images or [])
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if not is_image_part(part):
                parts.append(part)
                continue
            value = _part_value(part)
            here = f"{where}, message {i}, part {j}"
            if value is None:
                if not pending:
                    raise ImageError(f"{here}: an image placeholder with no image (no payload, and the row's "
                                     "`images` column has no image left for it)")
                value = pending.pop(0)
            blob = as_image(value, here, base_dir)
            images.append(blob)
            parts.append({"type": "image", "image": blob})
        out.append({**m, "content": parts})
    if pending:
        raise ImageError(f"{where}: the row's `images` column has {len(pending)} image(s) that no "
                         "{\"type\": \"image\"} part of the prompt takes")
    return out, images


def message_images(messages: Iterable[dict[str, Any]]) -> list[ImageBlob]:
    """The ImageBlobs of already normalized messages, in order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and isinstance(p.get("image"), ImageBlob)]


class ImageDir:
    """A run's images on disk, by id: `ROOT/ab/abcdef....png`. Written once (content-addressed),
    through a temporary file and a rename, so a reader never sees half a file."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, image_id_: str) -> Path:
        return self.root / image_id_[:2] / f"{image_id_}.png"

    def put(self, blob: ImageBlob) -> Path:
        p = self.path(blob.id)
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
            tmp.write_bytes(blob.png)
            tmp.replace(p)
        return p

    def get(self, image_id_: str) -> ImageBlob:
        p = self.path(image_id_)
        if not p.is_file():
            raise ImageError(f"image {image_id_} is not in {self.root}")
        blob = from_bytes(p.read_bytes(), str(p))
        if blob.id != image_id_:
            raise ImageError(f"{p}: its pixels do not match its id (the file was changed)")
        return blob
