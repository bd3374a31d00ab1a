"""Model ids of the Hugging Face Hub (`model.path: Qwen/Qwen3-0.6B`), resolved as transformers does.

An id that names no local directory is looked up with huggingface_hub's `snapshot_download`,
the function transformers' own loading rests on, into the same cache (`HF_HUB_CACHE`, by
default ~/.cache/huggingface/hub, laid out `models--org--name/snapshots/<commit>/...` with
`refs/main` naming the commit): with a network the snapshot is downloaded (or brought up to
date) and cached; offline (`HF_HUB_OFFLINE=1`, or the Hub cannot be reached) the cached
snapshot is used. Either way every reader in tidal (engines, trainer, tokenizer, vLLM) gets
one local directory, so an id costs one lookup per process, not one per reader.

Only what loading a model needs is fetched (config, weights as safetensors, tokenizer and
template files, the image processor's config): not the ONNX, GGUF, TensorFlow or Flax copies
many repositories carry. A repository whose weights exist only as `pytorch_model*.bin` gets
those instead.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

# An id as the Hub spells it: `name` or `org/name`, letters, digits, `-`, `_` and `.`.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
BIN_WEIGHTS = ["pytorch_model*.bin", "*.json"]


class HubModelError(ValueError):
    """An id that is neither a local directory nor a model the Hub (or its cache) has."""


def looks_like_hub_id(path: str) -> bool:
    """`path` may be a Hub id: not an existing path, in the Hub's spelling (no `./`, no `..`)."""
    return bool(HUB_ID.fullmatch(path)) and ".." not in path and not Path(path).exists()


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub (and so transformers) read it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot_dir(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of the Hub model `repo_id`: downloaded into the cache with a network,
    the cached snapshot without one; HubModelError naming the id and the cache when neither is
    there. Looked up once per process (per id, revision, cache and offline setting)."""
    return _snapshot_dir(repo_id, revision, hub_cache_dir(), is_offline())


@functools.lru_cache(maxsize=64)
def _snapshot_dir(repo_id: str, revision: str | None, cache: Path, offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = (f"`{repo_id}` is not a local directory, and as a Hugging Face Hub id it is not in the Hub cache "
             f"{cache}")
    try:
        out = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES,
                                     local_files_only=offline, etag_timeout=30))
        if not any(out.glob("*.safetensors")) and (out / "config.json").is_file() and not offline:
            out = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=BIN_WEIGHTS,
                                         etag_timeout=30))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise HubModelError(f"{where}, and the Hub does not have it or refuses access (a gated or private model "
                            f"needs `hf auth login` or HF_TOKEN): {type(e).__name__}") from None
    except RevisionNotFoundError:
        raise HubModelError(f"{where}: the Hub has no revision `{revision}` of it") from None
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set: download it where there is a network (`hf download "
               f"{repo_id}`) into that cache, or point model.path at a local directory") if offline else (
            f"and the Hub could not be reached ({str(e).splitlines()[0][:200]})")
        raise HubModelError(f"{where}; {why}") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubModelError(f"{where}; fetching it failed: {type(e).__name__}: {str(e)[:300]}") from None
    if not (out / "config.json").is_file():
        raise HubModelError(f"the Hub snapshot of `{repo_id}` at {out} has no config.json: it is not a transformers "
                            "model repository")
    return out
