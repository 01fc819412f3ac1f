"""Checkpoints that survive a killed rank, on any mesh, and Hugging Face weights in and out.

    folder/step-N/                DCP: model, optimizer, LR schedule, step, data position
    folder/step-N/complete.json   written last, once every rank's shards are on disk
    folder/step-N-hf/             last_save_in_hf: safetensors, the source's config, tokenizer, generation config

DCP reshards on load (a TP 2 checkpoint loads on dp_shard 2 x tp 2 or one process); `get_state_dict` uses
the plain HF names, without the compile and AC wrappers' prefixes.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.utils._pytree import tree_map

from family_plan import without_strided_shards
from model import hf_config
from workarounds import set_comm_timeout

MARKER = "complete.json"
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A save or a resume that cannot go on; train.py exits with its one line."""


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# -----------------------------------------------------------------------------
# which checkpoints are complete

def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """Every step-N folder, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir())


def checkpoint_state(path: Path) -> str:
    """"complete": its marker (written last) names every file with its size, all there in full.
    "incomplete": known garbage (no marker: a killed save; a file cut short). "unreadable":
    reading failed otherwise (a transient I/O error), so nothing may be deleted."""
    try:
        files = json.loads((path / MARKER).read_text())["files"]
        sizes = {name: (path / name).stat().st_size for name in files}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return "incomplete"  # the marker is replaced atomically: a broken one was damaged since
    except OSError:
        return "unreadable"
    return "complete" if files and sizes == files else "incomplete"


def write_marker(path: Path, step: int, run: dict) -> str | None:
    """Rank 0, after dcp.save: the marker names every file DCP's .metadata lists (each rank's shards) with
    its size, and the run (`run_record`). None once written; else why not."""
    need, tmp = {".metadata": 0}, path / (MARKER + ".tmp")  # each file's size at least: its last item's end
    try:
        for item in dcp.FileSystemReader(path).read_metadata().storage_data.values():
            need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
        have = {name: (path / name).stat().st_size for name in need if (path / name).is_file()}
        if unseen := [name for name, size in need.items() if have.get(name, -1) < size]:
            return (f"rank 0 sees {len(need) - len(unseen)} of the {len(need)} files DCP wrote ({unseen[0]} is "
                    "missing or short): checkpoint.folder must be one file system that every node shares")
        tmp.write_text(json.dumps({"step": step, "files": have, "run": run}, indent=1))
        os.replace(tmp, path / MARKER)  # atomic: the marker is there whole or not at all
    except OSError as e:
        return e.strerror or str(e)
    return None


# Keys a resume refuses to change, as any [model] key: a data position is into these documents,
# one per dp rank (the standard library's bytes have one position, for any dp_shard).
REFUSED = ("training.lr", "training.warmup_steps", "training.seed", "data.path", "data.tokenizer")


def run_record(cfg: dict) -> dict:
    """What complete.json records of the run that wrote it (require_same_run)."""
    t, p, d = cfg["training"], cfg["parallelism"], cfg["data"]
    return {"model": cfg["model"],
            "training": {k: t[k] for k in ("lr", "warmup_steps", "seed", "steps", "local_batch_size", "seq_len")},
            "parallelism": {"dp_shard": p["dp_shard"], "tp": p["tp"]},
            "data": {"path": d["path"], "tokenizer": d["tokenizer"]}}


# -----------------------------------------------------------------------------
# save and resume

def training_state(model, optimizer, scheduler, position, step: int) -> dict:
    """Everything a resume needs; also the template that DCP loads into. Fused weights as Shard:
    HF's layout, which DCP takes (family_plan.without_strided_shards). `position`: the data's
    (data.training_batches), with get_state/set_state as a torch.Generator."""
    model_sd, optim_sd = tree_map(without_strided_shards, get_state_dict(model, optimizer))
    return {"model": model_sd, "optim": optim_sd,
            "train": {"step": step, "scheduler": scheduler.state_dict(), "data_position": position.get_state()}}


def save(cfg: dict, step: int, model, optimizer, scheduler, position, log) -> Path:
    """DCP save on every rank, then rank 0's marker, then old checkpoints pruned: a checkpoint
    is removed only once a newer one is complete. A failed save (a full disk, a shard rank 0
    cannot see) is removed and raised as CheckpointError on every rank. Returns its folder."""
    start, folder = time.perf_counter(), Path(cfg["checkpoint"]["folder"])
    path = folder / f"step-{step}"
    set_comm_timeout(cfg["comm"]["init_timeout_seconds"])  # the others wait while rank 0 writes and prunes
    if is_rank0():
        shutil.rmtree(path, ignore_errors=True)  # an earlier, unfinished save of this step
    if dist.is_initialized():
        dist.barrier()
    try:
        # dcp.save returns once rank 0 wrote .metadata, after every rank's shards; it raises on every rank.
        dcp.save(training_state(model, optimizer, scheduler, position, step), checkpoint_id=path)
        failure = decided_on_rank0(lambda: write_marker(path, step, run_record(cfg)))
    except (OSError, CheckpointException) as e:
        failure = decided_on_rank0(lambda: why_save_failed(e, path))
    if failure:
        if is_rank0():
            shutil.rmtree(path, ignore_errors=True)  # known garbage: its space comes back
        last = latest_complete(folder, lambda *_: None)  # for rank 0's line
        raise CheckpointError(f"step {step}: saving {path} failed: {failure}; "
                              + (f"{last[1]} stays the last complete checkpoint" if last else "no complete checkpoint"))
    removed = decided_on_rank0(lambda: prune(folder, step, cfg["checkpoint"]["keep_latest_k"]))
    set_comm_timeout(cfg["comm"]["train_timeout_seconds"])
    log(f"checkpoint: saved step {step} to {path} in {time.perf_counter() - start:.1f} s"
        + (f" (removed {', '.join(removed)})" if removed else ""))
    return path


def why_save_failed(error: BaseException, path: Path) -> str:
    """An OSError's words, from DCP's CheckpointException (every rank's error) or a cause. A full
    disk in torch.save's zip writer has none ("unexpected pos 704 vs 598"): then the free space."""
    errors = [error, *(wrapped[0] for wrapped in getattr(error, "failures", {}).values())]
    errors += [e.__context__ for e in errors if e.__context__ is not None]
    if found := next((e for e in errors if isinstance(e, OSError) and e.strerror), None):
        return found.strerror
    first = f"{type(errors[-1]).__name__}: {str(errors[-1]).strip().splitlines()[0]}"
    free = shutil.disk_usage(path.parent).free / 2**20
    return f"No space left on device ({free:.0f} MiB free; {first})" if free < 1 else f"{first} ({free:,.0f} MiB free)"


def prune(folder: Path, newest: int, keep_latest_k: int) -> list[str]:
    """Remove complete checkpoints beyond the latest `keep_latest_k` (0 keeps all) and
    unfinished ones older than `newest`."""
    states = [(step, p, checkpoint_state(p)) for step, p in step_dirs(folder)]
    complete = [p for _, p, state in states if state == "complete"]
    stale = complete[:-keep_latest_k] if keep_latest_k else []
    stale += [p for step, p, state in states if step < newest and state == "incomplete"]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


def resume(cfg: dict, model, optimizer, scheduler, position, log) -> int:
    """Load the latest complete checkpoint in `folder` and return its step; without one,
    load `initial_load_path`'s weights (or nothing) and return 0."""
    ckpt = cfg["checkpoint"]
    folder = Path(ckpt["folder"])
    latest = decided_on_rank0(lambda: latest_complete(folder, log))
    start = time.perf_counter()
    if latest is not None:
        step, path = latest
        require_same_run(path, cfg, log)
        state = training_state(model, optimizer, scheduler, position, step)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        position.set_state(state["train"]["data_position"])
        log(f"checkpoint: loaded step {step} from {path} in {time.perf_counter() - start:.1f} s")
        return step
    if ckpt["initial_load_path"]:
        path, hf = Path(ckpt["initial_load_path"]), ckpt["initial_load_in_hf"]
        if hf:
            load_hf(model, path)
        else:  # the model part of another run's DCP checkpoint; optimizer and schedule start fresh
            require_same_run(path, cfg, log, every_key=False)
            state = {"model": tree_map(without_strided_shards, get_model_state_dict(model))}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
        log(f"checkpoint: none complete in {folder}; loaded the {'HF' if hf else 'DCP'} weights of "
            f"{path} in {time.perf_counter() - start:.1f} s, starting from step 1")
        return 0
    log(f"checkpoint: none complete in {folder}; starting from step 1")
    return 0


def latest_complete(folder: Path, log) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint, logging each newer one skipped."""
    for step, path in reversed(step_dirs(folder)):
        state = checkpoint_state(path)
        if state == "complete":
            return step, path
        log(f"checkpoint: skipped {path}: {state}, no valid {MARKER} (a save that did not finish)"
            if state == "incomplete" else f"checkpoint: skipped {path}: {state}")
    return None


def decided_on_rank0(decide):
    """Rank 0's answer on every rank: on a shared filesystem some nodes see new files late."""
    answer = [decide() if is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def require_same_run(path: Path, cfg: dict, log, every_key: bool = True) -> None:
    """The marker's record (`run_record`) against this run's, on rank 0: a changed [model] key (or with
    `every_key`, a REFUSED one) is one line, not DCP's size mismatch; a changed steps, batch or mesh is logged."""
    def compare():
        saved, now = json.loads((path / MARKER).read_text()).get("run"), run_record(cfg)
        if saved is None:
            return None, f"checkpoint: {path} records no run (an older train.py): [model] and training not checked"
        changed = [(f"{part}.{key}", saved.get(part, {}).get(key), value) for part in now if every_key or part == "model"
                   for key, value in now[part].items() if saved.get(part, {}).get(key) != value]
        per_dp_rank = ("parallelism.dp_shard",) if cfg["data"]["path"] else ()
        refused = [c for c in changed if c[0].startswith("model.") or c[0] in REFUSED + per_dp_rank]
        return refused[:1], changed and "checkpoint: resuming with " + ", ".join(f"{k} {a} -> {b}" for k, a, b in changed)
    refused, note = decided_on_rank0(compare)
    if refused:
        [(key, was, value)] = refused
        raise CheckpointError(f"{path} was written with {key} = {was!r}, this run has {value!r}: resume with the "
                              "same [model], training.lr, warmup_steps, seed, [data] documents and their dp_shard, "
                              "or use another checkpoint.folder")
    if note:
        log(note)


# -----------------------------------------------------------------------------
# Hugging Face weights in and out

def load_hf(model, path: Path) -> None:
    """This rank's piece of every tensor in an HF folder's *.safetensors, read by DCP's
    HuggingFaceStorageReader (slices, cast to the parameters' dtype); a tied lm_head is the embedding."""
    state = get_model_state_dict(model)  # HF's names -> this rank's shards, sharing the parameters' storage
    plain = tree_map(without_strided_shards, state)  # DCP reads into Shard, not _StridedShard
    if model.config.tie_word_embeddings:
        del plain["lm_head.weight"]  # the embedding's parameter: loaded with it
    dcp.load(plain, storage_reader=HuggingFaceStorageReader(str(path)))
    if any(plain[name] is not state[name] for name in plain):  # fused weights: copies, set into the strided shards
        set_model_state_dict(model, plain, options=StateDictOptions(strict=False))  # a tied lm_head is not in plain


def save_hf(cfg: dict, step: int, model, tokenizer, log) -> None:
    """step-N-hf/: the weights in the source folder's dtype, with its config, generation config and
    `tokenizer` (data.Corpus's), in files as save_pretrained splits them. Each rank writes its shards
    (DCP's HuggingFaceStorageWriter), then joins some of the Hub's files from every rank's: no rank
    holds more than one whole tensor. Built in step-N-hf.tmp, renamed once whole."""
    start, path = time.perf_counter(), Path(cfg["checkpoint"]["folder"]) / f"step-{step}-hf"
    tmp = path.with_name(path.name + ".tmp")
    set_comm_timeout(cfg["comm"]["init_timeout_seconds"])  # the others wait while rank 0 writes
    config, source = export_config(cfg, tokenizer)
    weights = tree_map(without_strided_shards, get_model_state_dict(model))
    if model.config.tie_word_embeddings:
        del weights["lm_head.weight"]  # as HF saves a tied model
    weights = {name: w.detach().to(config.dtype) for name, w in weights.items()}
    files = hub_files(weights, cfg["checkpoint"]["hf_max_shard_mb"] * 10**6)
    size = sum(w.numel() * w.element_size() for w in weights.values())
    steps = (lambda: is_rank0() and remove(tmp),  # an unfinished export's, or a stray file
             lambda: dcp.save(weights, storage_writer=HuggingFaceStorageWriter(  # a file per Hub file: one at a time
                 str(tmp / "sharded"), fqn_to_index_mapping=files, save_distributed=True)),
             lambda: join_shards(tmp, files),
             lambda: is_rank0() and finish_hf_folder(tmp, path, files, size, config, source, tokenizer))
    if failure := next((f for work in steps if (f := failure_on_any_rank(work, tmp))), None):
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"step {step}: writing the HF weights to {path} failed: {failure}; "
                              f"{path.with_name(f'step-{step}')} is complete")
    set_comm_timeout(cfg["comm"]["train_timeout_seconds"])
    log(f"checkpoint: wrote the HF weights of step {step} to {path} ({max(files.values())} file(s), "
        f"{str(config.dtype).removeprefix('torch.')}) in {time.perf_counter() - start:.1f} s")


def export_config(cfg: dict, tokenizer):
    """(LlamaConfig, source folder or None): the source's config.json as transformers reads it (bos/eos,
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


def hub_files(weights: dict, max_bytes: int) -> dict[str, int]:
    """Tensor name -> file 1, 2, ..., as save_pretrained's max_shard_size splits: in order, a new file
    where the next tensor would pass `max_bytes` (a larger tensor is a file alone)."""
    number, size, files = 1, 0, {}
    for name, w in weights.items():
        nbytes = w.numel() * w.element_size()
        if size and size + nbytes > max_bytes:
            number, size = number + 1, 0
        files[name], size = number, size + nbytes
    return files


def hub_file_name(number: int, files: dict) -> str:
    last = max(files.values())
    return "model.safetensors" if last == 1 else f"model-{number:05d}-of-{last:05d}.safetensors"


def join_shards(tmp: Path, files: dict[str, int]) -> None:
    """This rank's share of the Hub's files (every world-size-th), each tensor joined from every rank's
    shards in tmp/sharded. Not torch's consolidate_safetensors_files_on_every_rank: it writes no index on
    torch 2.10 (pytorch/torchtitan#2137) and on 2.15 only with a process group, and a rank whose write
    fails leaves the others in its barrier until the timeout; here every rank hears of it (failure_on_any_rank)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {tensor: hub_file_name(n, files) for tensor, n in files.items() if (n - 1) % world == rank}
    if mine:
        _consolidate_safetensors_files(str(tmp / "sharded"), str(tmp), mine, num_threads=1)


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def failure_on_any_rank(work, path: Path) -> str | None:
    """work() on every rank, then the first rank's failure in words (why_save_failed), on every rank."""
    try:
        work()
        failure = None
    except (OSError, CheckpointException) as e:  # DCP's raises on every rank
        failure = why_save_failed(e, path)
    failures = [failure]
    if dist.is_initialized():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    return next((f for f in failures if f), None)


def finish_hf_folder(tmp: Path, path: Path, files: dict, size: int, config, source: Path | None, tokenizer) -> None:
    """Rank 0, once the safetensors are joined: their index (for several), config.json, the source's
    generation_config.json (or one from config), the tokenizer's files; then the folder renamed to `path`."""
    from transformers import GenerationConfig

    shutil.rmtree(tmp / "sharded")
    if max(files.values()) > 1:
        index = {"metadata": {"total_size": size}, "weight_map": {t: hub_file_name(n, files) for t, n in files.items()}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(tmp)
    if source and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", tmp / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if tokenizer != "bytes":
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
