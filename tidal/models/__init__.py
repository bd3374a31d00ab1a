"""Load Hugging Face causal LMs and their tokenizers.

`model.path` is a local HF model directory (the tiny default, SmolLM2, Qwen2.5-0.5B on a GPU
box), a tidal checkpoint, a peft adapter directory, a name of an embedded model, or a Hugging
Face Hub id (`Qwen/Qwen3-0.6B`): an id is resolved as transformers resolves it, downloaded
into the Hub cache with a network and read from that cache offline (tidal/models/hub.py). A
local directory of that name wins over the id, as in transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tidal import cache_root
from tidal.models.hub import HubModelError, looks_like_hub_id, snapshot_dir
from tidal.models.vision import is_vision_config, read_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The embedded models that ship with tidal (package data), each rebuilt by its recipe in tidal/recipes/:
ASSETS_DIR = Path(__file__).parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-arith"  # `tidal build-default-model` (recipes/tiny.py)
DEFAULT_VLM_DIR = ASSETS_DIR / "tiny-vlm"  # `tidal build-default-vlm` (recipes/vlm_build.py)
TOOL_MODEL_DIR = ASSETS_DIR / "tiny-tool"  # `tidal build-tool-model` (recipes/tool_model.py)
GENERAL_TOOL_MODEL_DIR = ASSETS_DIR / "tiny-tool-general"  # `tidal build-general-tool-model` (general_tool_model.py)
BROWSER_MODEL_DIR = ASSETS_DIR / "tiny-browser"  # `tidal build-browser-model` (recipes/browser_model.py)
MOE_MODEL_DIR = ASSETS_DIR / "tiny-moe"  # `tidal build-moe` (recipes/moe_model.py)
NAMED_MODELS = {"default": DEFAULT_MODEL_DIR, "default-vlm": DEFAULT_VLM_DIR, "default-moe": MOE_MODEL_DIR,
                "default-tool": GENERAL_TOOL_MODEL_DIR}


class ModelLoadError(ValueError):
    pass


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory, or the `model/` folder inside a tidal checkpoint directory, or a peft
    LoRA adapter directory (`merged_adapter_dir`), or a Hugging Face Hub id (its snapshot in the
    Hub cache: tidal/models/hub.py). `default` names the embedded text model, `default-vlm` the
    embedded vision-language model, `default-moe` the embedded mixture of experts, `default-tool`
    the embedded tool model that calls tools from their schemas (`tiny-tool-general`)."""
    p = Path(path)
    if str(path) in NAMED_MODELS:
        p = NAMED_MODELS[str(path)]
    elif isinstance(path, str) and looks_like_hub_id(path):
        try:
            p = snapshot_dir(path)
        except HubModelError as e:
            raise ModelLoadError(str(e)) from None
    if (p / "model" / "config.json").is_file():
        p = p / "model"
    if not p.is_dir():
        raise ModelLoadError(f"model directory `{path}` does not exist (model.path takes a local directory, a "
                             "tidal checkpoint, `default`, `default-vlm` or a Hugging Face Hub id such as "
                             "Qwen/Qwen3-0.6B)")
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        p = merged_adapter_dir(p)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"`{p}` has no config.json: it is not a Hugging Face model directory")
    return p


def merged_adapter_dir(adapter: Path) -> Path:
    """A peft LoRA adapter directory (adapter_config.json, no config.json: what `train.lora`
    checkpoints hold in `adapter/`) as a plain model directory, so every engine and reader takes
    it: the adapter merged into its base (`base_model_name_or_path`, a local model directory),
    with the adapter's tokenizer or else the base's. Merged once, cached by the adapter's
    content and the base's files (path, size, mtime) under $TIDAL_CACHE_DIR (default
    ~/.cache/tidal)/merged/."""
    import hashlib
    import json
    import shutil
    import tempfile

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    base = cfg.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ModelLoadError(f"adapter `{adapter}`: its base model `{base}` (adapter_config.json's base_model_name_or_path) "
                             "is not a local directory")
    base_dir = resolve_model_dir(base)
    digest = hashlib.sha256(str(base_dir.resolve()).encode())
    for f in sorted(base_dir.iterdir()):  # a base rebuilt in place is another base
        if f.is_file():
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for f in sorted(adapter.iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + f.read_bytes())
    cache = cache_root() / "merged"
    out = cache / digest.hexdigest()[:24]
    if (out / "config.json").is_file():
        return out
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText


    auto = AutoModelForImageTextToText if is_vision_config(read_config(base_dir)) else AutoModelForCausalLM
    model = auto.from_pretrained(str(base_dir), dtype="auto")
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    merged.save_pretrained(tmp, safe_serialization=True)
    tok_dir = adapter if (adapter / "tokenizer.json").is_file() or (adapter / "tokenizer_config.json").is_file() else base_dir
    for f in tok_dir.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template"))):
            shutil.copy2(f, tmp / f.name)
    if (base_dir / "preprocessor_config.json").is_file():  # a vision-language model's image processor
        shutil.copy2(base_dir / "preprocessor_config.json", tmp / "preprocessor_config.json")
    try:
        tmp.rename(out)  # whole or absent: a concurrent merge of the same adapter may have won
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = resolve_model_dir(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(
            f"`{p}` has no tokenizer (no tokenizer.json, tokenizer.model or vocab.json): "
            "save the tokenizer next to the model with tokenizer.save_pretrained(dir)"
        )
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.chat_template is None:
        raise ModelLoadError(f"the tokenizer in `{p}` has no chat template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu", attention: str | None = None):
    """A causal LM, or a vision-language model (Qwen2-VL family: tidal/models/vision.py) with its
    language-model head, from a local directory. `attention`: transformers' attn_implementation
    (None: its default)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging


    hf_logging.disable_progress_bar()  # tidal's own progress bar is the one on the console
    p = resolve_model_dir(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cls = AutoModelForImageTextToText if is_vision_config(read_config(p)) else AutoModelForCausalLM
    kwargs = {"attn_implementation": attention} if attention else {}
    model = cls.from_pretrained(str(p), dtype=DTYPES[dtype], **kwargs)
    return model.to(device)


def context_length(config: dict) -> int | None:
    """A model's longest context from its config.json (a dict): `max_position_embeddings`, or its
    text model's for a vision-language model (Qwen2-VL keeps it in `text_config`); None if absent."""
    n = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(n) if n else None


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end an assistant turn: EOS plus ChatML's <|im_end|> when present."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None))
