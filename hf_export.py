"""The HF export: folder/step-N-hf/ as the Hub takes it (last_save_in_hf): the source folder's config, dtype,
generation config and tokenizer, in save_pretrained's files, each rank writing its own shards.
"""

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import hub_folder
from checkpoint import CheckpointError, is_rank0, why_save_failed
from hf_layout import in_hf_layout
from model import hf_config
from workarounds import set_comm_timeout


def save_hf(cfg: dict, step: int, model, tokenizer, log) -> None:
    """step-N-hf/: the weights in the source folder's dtype, with its config, generation config and
    `tokenizer` (data.Corpus's), in files as save_pretrained splits them, under the source's names. Each rank
    writes its shards (DCP's HuggingFaceStorageWriter), then joins some of the Hub's files from every rank's:
    no rank holds more than one whole tensor. The source's other tensors (a composite's vision tower and
    projector) are copied as they are, into files of their own. Built in step-N-hf.tmp, renamed once whole."""
    start, path = time.perf_counter(), Path(cfg["checkpoint"]["folder"]) / f"step-{step}-hf"
    tmp = path.with_name(path.name + ".tmp")
    set_comm_timeout(cfg["comm"]["init_timeout_seconds"])  # the others wait while rank 0 writes
    config, source = export_config(cfg, tokenizer)
    weights = in_hf_layout(get_model_state_dict(model), model)
    if model.config.tie_word_embeddings:
        del weights["lm_head.weight"]  # as HF saves a tied model
    names, found = hub_folder.tensors(source) if source else ({}, {})
    weights = {names.get(name, name): w.detach().to(config.dtype) for name, w in weights.items()}
    others = {name: nbytes for name, (_, nbytes, _) in found.items() if name not in names.values()}
    max_bytes = cfg["checkpoint"]["hf_max_shard_mb"] * 10**6
    sizes = {name: w.numel() * w.element_size() for name, w in weights.items()}
    files = hub_files(sizes, max_bytes)
    files |= hub_files(others, max_bytes, first=max(files.values()) + 1)
    size = sum(sizes.values()) + sum(others.values())
    try:  # each step on every rank, then every rank hears of any rank's failure
        on_every_rank(tmp, remove, tmp, rank0_only=True)  # an unfinished export's, or a stray file
        on_every_rank(tmp, dcp.save, weights, storage_writer=HuggingFaceStorageWriter(  # a file per Hub file
            str(tmp / "sharded"), fqn_to_index_mapping={name: files[name] for name in weights}, save_distributed=True))
        on_every_rank(tmp, join_shards, tmp, files, weights)
        on_every_rank(tmp, copy_others, source, tmp, files, found, others)
        on_every_rank(tmp, finish_hf_folder, tmp, path, files, size, config, source, tokenizer, rank0_only=True)
    except ExportFailed as failure:
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"step {step}: writing the HF weights to {path} failed: {failure}; "
                              f"{path.with_name(f'step-{step}')} is complete") from None
    set_comm_timeout(cfg["comm"]["train_timeout_seconds"])
    log(f"checkpoint: wrote the HF weights of step {step} to {path} ({max(files.values())} file(s), "
        f"{str(config.dtype).removeprefix('torch.')}) in {time.perf_counter() - start:.1f} s")


def export_config(cfg: dict, tokenizer):
    """(transformers config, source folder or None): the source's config.json as transformers reads it (bos/eos,
    RoPE: all that is not trained) with its weights' dtype; without one, [model]'s in float32, with
    the tokenizer's bos/eos."""
    from safetensors import safe_open
    from transformers import AutoConfig

    c = cfg["checkpoint"]
    if not c["initial_load_in_hf"]:
        config = hf_config(cfg["model"])
        config.dtype = torch.float32  # the weights trained here
        if tokenizer != "bytes":
            config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        return config, None
    source = Path(c["initial_load_path"])
    config = AutoConfig.from_pretrained(source)
    with safe_open(sorted(source.glob("*.safetensors"))[0], "pt") as f:
        config.dtype = f.get_slice(next(iter(f.keys())))[:1].dtype  # as stored, whatever config.json says
    return config, source


def hub_files(sizes: dict[str, int], max_bytes: int, first: int = 1) -> dict[str, int]:
    """Tensor name -> file `first`, ..., as save_pretrained's max_shard_size splits: in order, a new file
    where the next tensor (of `sizes` bytes) would pass `max_bytes` (a larger tensor is a file alone)."""
    number, size, files = first, 0, {}
    for name, nbytes in sizes.items():
        if size and size + nbytes > max_bytes:
            number, size = number + 1, 0
        files[name], size = number, size + nbytes
    return files


def hub_file_name(number: int, files: dict) -> str:
    last = max(files.values())
    return "model.safetensors" if last == 1 else f"model-{number:05d}-of-{last:05d}.safetensors"


def join_shards(tmp: Path, files: dict[str, int], weights: dict) -> None:
    """This rank's share of the Hub's files (every world-size-th), each tensor joined from every rank's
    shards in tmp/sharded. Not torch's consolidate_safetensors_files_on_every_rank: it writes no index on
    torch 2.10 (pytorch/torchtitan#2137) and on 2.15 only with a process group, and a rank whose write
    fails leaves the others in its barrier until the timeout; here every rank hears of it (on_every_rank)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {tensor: hub_file_name(n, files) for tensor, n in files.items() if (n - 1) % world == rank and tensor in weights}
    if mine:
        _consolidate_safetensors_files(str(tmp / "sharded"), str(tmp), mine, num_threads=1)


def copy_others(source: Path | None, tmp: Path, files: dict[str, int], found: dict, others: dict) -> None:
    """This rank's share of the files holding the source's other tensors, each read and written as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for number in sorted({files[name] for name in others if (files[name] - 1) % world == rank}):
        tensors = {}
        for name in (name for name in others if files[name] == number):
            with safe_open(source / found[name][2], "pt") as f:
                tensors[name] = f.get_tensor(name)
        save_file(tensors, tmp / hub_file_name(number, files), metadata={"format": "pt"})


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


class ExportFailed(RuntimeError):
    pass


def on_every_rank(path: Path, work, *args, rank0_only: bool = False, **kwargs) -> None:
    """work(*args, **kwargs) on every rank (on rank 0 alone with `rank0_only`); then on every rank,
    ExportFailed with the first rank's failure in words (why_save_failed), if any rank failed."""
    try:
        if is_rank0() or not rank0_only:
            work(*args, **kwargs)
        failure = None
    except (OSError, CheckpointException) as e:  # DCP's raises on every rank
        failure = why_save_failed(e, path)
    failures = [failure]
    if dist.is_initialized():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    if failure := next((f for f in failures if f), None):
        raise ExportFailed(failure)


def keep_source_keys(written: Path, source: Path) -> None:
    """The source's config.json keys that transformers 5 no longer writes (rope_theta, rope_scaling,
    torch_dtype) beside its own: transformers <= 4.57 reads a Llama 3 export without them as RoPE theta
    10,000 and no llama3 scaling, a different model with no error. transformers 5 reads it the same."""
    ours = json.loads(written.read_text())
    theirs = {key: value for key, value in json.loads(source.read_text()).items() if key not in ours}
    written.write_text(json.dumps({**ours, **theirs}, indent=2, sort_keys=True) + "\n")


def finish_hf_folder(tmp: Path, path: Path, files: dict, size: int, config, source: Path | None, tokenizer) -> None:
    """Rank 0, once the safetensors are joined: their index (for several), config.json, the source's
    generation_config.json (or one from config), the tokenizer's files; then the folder renamed to `path`."""
    from transformers import GenerationConfig

    shutil.rmtree(tmp / "sharded")
    if max(files.values()) > 1:
        index = {"metadata": {"total_size": size}, "weight_map": {t: hub_file_name(n, files) for t, n in files.items()}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    if source:
        keep_source_keys(tmp / "config.json", source / "config.json")
    if source and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", tmp / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if tokenizer != "bytes":
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
