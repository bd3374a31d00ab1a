"""The HF `model/` directory written from the shards: no rank gathers the model.

`tidal eval`, the engines and `Trainer(model_dir)` read a checkpoint's `model/` as a normal
Hugging Face directory (config.json, safetensors files, model.safetensors.index.json). A sharded
trainer writes it in two passes of torch's own parts (torch.distributed.checkpoint.hf_storage):

1. `dcp.save` with `HuggingFaceStorageWriter(save_distributed=True)`: every rank writes the
   pieces it holds (its FSDP / tensor-parallel shards; a replicated piece once) to safetensors
   files of its own under `model/sharded/`, each piece with its offsets in the whole tensor;
2. `consolidate_safetensors_files_on_every_rank`: the output files are divided among the ranks
   (file i to rank i mod world), and each rank assembles the whole tensors of its files from
   the pieces on disk, one tensor at a time, and writes them. Rank 0 writes the index json.

So a rank holds its own shards and, at most, one whole tensor (the largest of its files) at a
time, never the model. The tensors are cut into at least one file per rank (more where a file
would pass `max_file_bytes`), in the state dict's order and balanced by bytes, so every rank
writes about 1/world of the bytes. The directory needs to be visible to every rank (as the
shards of a resume are).

The names and the set of tensors are save_pretrained's: a tied alias is left out (the head
tied to the embedding) and a weight that transformers renames on saving (Qwen2-VL's
`model.language_model.*` -> `model.*`) is written under its saved name. A model whose saving
converts weights rather than renaming them (a mixture-of-experts model's fused experts, split
per expert on saving) is not handled here: `hf_names` returns None and the caller gathers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tidal.trainer.distributed import _full_options, is_sharded, rank, reshard

SHARDED = "sharded"  # HuggingFaceStorageWriter's own name for the pieces' directory


def hf_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str] | None:
    """{own name: saved name} of the tensors of `state` (the model's state dict, sharded or not)
    that save_pretrained writes, tied aliases left out; None if saving converts some weight (not
    a pure renaming). Run by save_pretrained's own functions on meta tensors of the same shapes."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # meta tensors: the tied aliases are found by their parameter (one object under two names)
    probe = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    kept = remove_tied_weights_from_state_dict(dict(probe), model)
    own = {id(v): k for k, v in kept.items()}
    out = revert_weight_conversion(model, kept)
    if len(out) != len(kept) or any(id(v) not in own for v in out.values()):
        return None  # a converter made new tensors (split, fused, transposed)
    return {own[id(v)]: k for k, v in out.items()}


def file_index(sizes: dict[str, int], ranks: int, max_file_bytes: int) -> dict[str, int]:
    """{name: file number, 1..K} for tensors of `sizes` bytes in order: K = at least `ranks`
    files (fewer if there are fewer tensors) and enough that none passes `max_file_bytes` (a
    tensor larger than that gets a file of its own), contiguous runs of about equal bytes."""
    total = sum(sizes.values())
    k = min(max(ranks, -(-total // max_file_bytes)), len(sizes))
    index, done, file = {}, 0, 1
    for name, size in sizes.items():
        # the next file starts where this tensor would pass its equal share of the bytes
        if file < k and done > 0 and done + size / 2 > file * total / k:
            file += 1
        index[name] = file
        done += size
    return index


def save_hf_sharded(model: nn.Module, path: Path, max_file_bytes: int = 5 * 2**30) -> bool:
    """Write `model` (FSDP / tensor-parallel DTensors) as an HF directory at `path` from every
    rank's shards. A collective. False (nothing written) if the model's saving converts weights
    (`hf_names`): the caller gathers instead."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)
    state = get_model_state_dict(model)
    names = hf_names(model, state)
    if names is None:
        return False
    state = {names[k]: v for k, v in state.items() if k in names}
    index = file_index({k: v.numel() * v.element_size() for k, v in state.items()}, dist.get_world_size(),
                       max_file_bytes)
    pieces = path / SHARDED
    if dist.get_rank() == 0:  # what an earlier save left: stale pieces would be consolidated, stale files read
        shutil.rmtree(pieces, ignore_errors=True)
        for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
        pieces.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(pieces), fqn_to_index_mapping=index,
                                                                save_distributed=True))
    consolidate_safetensors_files_on_every_rank(str(pieces), str(path), index)  # ends in a barrier
    if dist.get_rank() == 0:
        shutil.rmtree(pieces)
        write_config(model, path)
    dist.barrier()  # the directory is whole when any rank returns
    return True


def write_config(model: nn.Module, path: Path) -> None:
    """config.json (and generation_config.json) as save_pretrained writes them: the dtype and the
    architecture (FSDP2's wrapper class renamed back) recorded in the config first."""
    cfg = model.config
    cfg.dtype = str(model.dtype).split(".")[1]
    cfg.architectures = [type(model).__name__.removeprefix("FSDP")]
    cfg.save_pretrained(path)
    if model.can_generate():
        model.generation_config.save_pretrained(path)


def save_hf(model: nn.Module, path) -> None:
    """Write `model` as a normal HF directory. Sharded: a collective (every rank calls it); each
    rank writes its part from its shards (`save_hf_sharded`), or, for a model
    whose saving converts weights (fused MoE experts), rank 0 gathers the full state dict on CPU
    and writes it."""
    if not is_sharded(model):
        model.save_pretrained(path, safe_serialization=True)
        return
    if not save_hf_sharded(model, Path(path)):
        _save_hf_gathered(model, path)


def _save_hf_gathered(model: nn.Module, path) -> None:
    """Rank 0 gathers the whole state dict on CPU and writes it (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)
    state = get_model_state_dict(model, options=_full_options(cpu_offload=True))  # empty off rank 0
    if rank() == 0:
        model.save_pretrained(path, state_dict=state, safe_serialization=True)
