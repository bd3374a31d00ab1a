"""Small patches that let transformers' and vLLM's Qwen2-VL code run where torchvision cannot.

torchvision is not usable everywhere tidal runs: PyPI has no CPU build of it, its CUDA build fails
to import next to torch+cpu (`operator torchvision::nms does not exist`), so `make setup-vllm`
leaves it out. transformers' and vLLM's Qwen2-VL code imports a few torchvision-based pieces even
for images, which its PIL code path does not need. Each patch below names what breaks without it;
all are applied only where torchvision cannot be imported, are idempotent (vLLM loads plugins more
than once per process) and change nothing for a model that runs without them.

tidal itself needs none of them: `Vision` builds transformers' PIL image processor directly and the
model classes import no torchvision. They are for vLLM:

- `apply_transformers_shims()`: (1) `transformers.models.qwen2_vl.image_processing_qwen2_vl` (the
  torchvision image processor's module) is answered by its PIL twin; (2) the Qwen2-VL and Qwen2.5-VL
  processors are image-only (no video processor in their `__init__` signature).
- `apply_vllm_shims()`: those, and (3) vLLM reads the video processor's kwargs only where the
  processor has one.

vLLM inspects a model's class in a fresh subprocess (`python -m vllm.model_executor.models.registry`),
where patches made in tidal's process do not apply; it does load `vllm.general_plugins` entry points
there, in its server and in its engine-core processes. So `vllm_plugin` is declared as one in
pyproject.toml (`pip install -e .` registers it) and the vLLM engine also applies the shims itself.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from typing import get_type_hints

PLUGIN_NAME = "tidal_vision_shims"
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


@functools.cache
def torchvision_usable() -> bool:
    """Whether `import torchvision` works here (it can be installed and still fail to import)."""
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - ModuleNotFoundError, or the CUDA build's RuntimeError next to torch+cpu
        return False
    return True


def apply_transformers_shims() -> bool:
    """Patches (1) and (2) of the module docstring, where torchvision cannot be imported.
    Returns whether they are in effect."""
    if torchvision_usable():
        return False
    # (1) vLLM's qwen2_vl.py does `from transformers.models.qwen2_vl.image_processing_qwen2_vl
    # import smart_resize`; that module imports torchvision at its top, so without this the model
    # class does not import ("ModuleNotFoundError: No module named 'torchvision'") and vLLM refuses
    # the model ("Model architectures ['Qwen2VLForConditionalGeneration'] failed to be inspected").
    # The PIL module holds the same `smart_resize`, and the PIL processor is what transformers
    # itself falls back to for `Qwen2VLImageProcessor` without torchvision.
    if _TORCHVISION_MODULE not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        alias = types.ModuleType(_TORCHVISION_MODULE, "tidal.models.vision_shims: the PIL image processor's module, "
                                 "standing in for the torchvision one (torchvision cannot be imported here)")
        alias.smart_resize = pil.smart_resize
        alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        sys.modules[_TORCHVISION_MODULE] = alias
    # (2) `Qwen2VLProcessor.from_pretrained` (vLLM builds the model's processor with it) loads
    # every sub-processor its __init__ signature names, the video processor among them, and
    # Qwen2VLVideoProcessor needs torchvision ("ImportError: Qwen2VLVideoProcessor requires the
    # Torchvision library"). Without `video_processor` in the signature the processor is built
    # from the image processor and the tokenizer alone; `__call__` with images never touches it.
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    for cls in (Qwen2VLProcessor, Qwen2_5_VLProcessor):
        init = cls.__init__
        sig = inspect.signature(init)
        if "video_processor" in sig.parameters:
            init.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items()
                                                         if n != "video_processor"])
    return True


def apply_vllm_shims() -> bool:
    """All three patches of the module docstring, where torchvision cannot be imported. Returns
    whether they are in effect. Imports only what vLLM has already imported when it loads plugins."""
    if not apply_transformers_shims():
        return False
    # (3) vLLM's `BaseProcessingInfo.get_supported_mm_processor_kwargs` reads
    # `processor.video_processor.valid_kwargs` for every model that supports video (Qwen2-VL's
    # limits always list it), which an image-only processor (2) lacks: vLLM fails at start-up
    # while sizing its encoder budget ("AttributeError: 'Qwen2VLProcessor' object has no attribute
    # 'video_processor'"). Where the processor has no video processor, only the text and image
    # kwargs are listed; elsewhere vLLM's own method runs unchanged.
    from vllm.multimodal.processing.context import BaseProcessingInfo

    original = BaseProcessingInfo.get_supported_mm_processor_kwargs
    if getattr(original, "_tidal_images_only", False):
        return True

    @functools.wraps(original)
    def supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        processor = self.get_hf_processor()
        if hasattr(processor, "video_processor"):
            return original(self)
        # vLLM 0.32's method without its video branch (vllm/multimodal/processing/context.py).
        kwargs = get_type_hints(processor.valid_processor_kwargs)
        supported = {"text_kwargs": set(kwargs["text_kwargs"].__annotations__)}
        if "image" in self.supported_mm_limits:
            supported["images_kwargs"] = set(processor.image_processor.valid_kwargs.__annotations__)
        if "audio" in self.supported_mm_limits:
            supported["audio_kwargs"] = set(kwargs["audio_kwargs"].__annotations__)
        return supported

    supported_mm_processor_kwargs._tidal_images_only = True
    BaseProcessingInfo.get_supported_mm_processor_kwargs = supported_mm_processor_kwargs
    return True


def vllm_plugin() -> None:
    """The `vllm.general_plugins` entry point (pyproject.toml): vLLM calls it in each of its
    processes, the model-inspection subprocess included."""
    apply_vllm_shims()


def plugin_registered() -> bool:
    """Whether this installation declares `vllm_plugin` to vLLM (`pip install -e .` registers it)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group="vllm.general_plugins"))
