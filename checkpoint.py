"""Checkpoints that survive a killed rank, on any mesh, and Hugging Face weights in (out: hf_export.py).

    folder/step-N/                DCP: model, optimizer, LR schedule, step, data position
    folder/step-N/complete.json   written last, once every rank's shards are on disk

DCP reshards on load (a TP 2 checkpoint loads on dp_shard 2 x tp 2 or one process); `get_state_dict` uses
the plain HF names, without the compile and AC wrappers' prefixes.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

import hub_folder
from hf_layout import in_hf_layout, in_plan_layout
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


# Keys a resume refuses to change, as any [model], [optimizer] or [lr_scheduler] key: a data position is into
# these documents (data.tokenized: the hash of data.path's files and tokenizer, tokens.fingerprint).
REFUSED = ("training.seed", "data.path", "data.split", "data.text_field", "data.tokenizer", "data.tokenized")


def run_record(cfg: dict, position=None) -> dict:
    """What complete.json records of the run that wrote it (require_same_run), as JSON reads it back
    (an HF config's id2label has int keys); `position`: the data's."""
    t, p, d = cfg["training"], cfg["parallelism"], cfg["data"]
    return json.loads(json.dumps({"model": cfg["model"], "optimizer": cfg["optimizer"], "lr_scheduler": cfg["lr_scheduler"],
            "training": {k: t[k] for k in ("seed", "steps", "local_batch_size", "global_batch_size", "seq_len")},
            "parallelism": {"dp_shard": p["dp_shard"], "tp": p["tp"]},
            "data": {"path": d["path"], "split": d["split"], "text_field": d["text_field"], "tokenizer": d["tokenizer"],
                     "tokenized": getattr(position, "key", None)}}))


# -----------------------------------------------------------------------------
# save and resume

def training_state(model, optimizer, scheduler, position, step: int) -> dict:
    """Everything a resume needs; also the template that DCP loads into. Fused weights as Shard:
    HF's layout, which DCP takes (hf_layout.in_hf_layout). `position`: the data's
    (data.training_batches), with get_state/set_state as a torch.Generator."""
    model_sd, optim_sd = in_hf_layout(get_state_dict(model, optimizer), model)
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
        failure = decided_on_rank0(lambda: write_marker(path, step, run_record(cfg, position)))
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


def loads_weights(cfg: dict) -> bool:
    """Whether resume will load every weight (a complete checkpoint, or initial_load_path): then the build
    need not draw them (pytorch/torchtitan#628 discussed the same)."""
    c = cfg["checkpoint"]
    return c["enable"] and bool(c["initial_load_path"] or decided_on_rank0(
        lambda: latest_complete(Path(c["folder"]), log=lambda *_: None)))


def resume(cfg: dict, model, optimizer, scheduler, position, log) -> int:
    """Load the latest complete checkpoint in `folder` and return its step; without one,
    load `initial_load_path`'s weights (or nothing) and return 0."""
    ckpt = cfg["checkpoint"]
    folder = Path(ckpt["folder"])
    latest = decided_on_rank0(lambda: latest_complete(folder, log))
    start = time.perf_counter()
    if latest is not None:
        step, path = latest
        require_same_run(path, cfg, log, position=position)
        state = training_state(model, optimizer, scheduler, position, step)
        dcp.load(state, checkpoint_id=path)
        model_sd, optim_sd = in_plan_layout((state["model"], state["optim"]), model)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
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
            state = {"model": in_hf_layout(get_model_state_dict(model), model)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, in_plan_layout(state["model"], model))
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


def require_same_run(path: Path, cfg: dict, log, every_key: bool = True, position=None) -> None:
    """The marker's record (`run_record`) against this run's, on rank 0: a changed [model] key (or with
    `every_key`, a REFUSED one) is one line, not DCP's size mismatch; a changed steps, batch or mesh is logged."""
    def compare():
        saved, now = json.loads((path / MARKER).read_text()).get("run"), run_record(cfg, position)
        if saved is None:
            return None, f"checkpoint: {path} records no run (an older train.py): [model] and training not checked"
        changed = [(f"{part}.{key}", saved.get(part, {}).get(key), value) for part in now if every_key or part == "model"
                   for key, value in now[part].items() if saved.get(part, {}).get(key) != value]
        refused = [c for c in changed if c[0].startswith(("model.", "optimizer.", "lr_scheduler.")) or c[0] in REFUSED]
        return refused[:1], changed and "checkpoint: resuming with " + ", ".join(f"{k} {a} -> {b}" for k, a, b in changed)
    refused, note = decided_on_rank0(compare)
    if refused:
        [(key, was, value)] = refused
        raise CheckpointError(f"{path} was written with {key} = {was!r}, this run has {value!r}: resume with the "
                              "same [model], [optimizer], [lr_scheduler], training.seed and [data] (data.tokenized: its files and "
                              "tokenizer, unchanged), or use another checkpoint.folder")
    if note:
        log(note)


# -----------------------------------------------------------------------------
# Hugging Face weights in and out

def load_hf(model, path: Path) -> None:
    """This rank's piece of every tensor of [model]'s in an HF folder's *.safetensors (a composite's text
    model: hub_folder.tensors), read by DCP's HuggingFaceStorageReader (slices, cast to the parameters'
    dtype); a tied lm_head is the embedding."""
    state = get_model_state_dict(model)  # HF's names -> this rank's shards, sharing the parameters' storage
    plain = in_hf_layout(state, model)  # DCP reads into Shard rows of HF's layout
    if model.config.tie_word_embeddings:
        del plain["lm_head.weight"]  # the embedding's parameter: loaded with it
    names, _ = hub_folder.tensors(path)
    dcp.load({names[name]: value for name, value in plain.items()}, storage_reader=HuggingFaceStorageReader(str(path)))
    if any(plain[name] is not state[name] for name in plain):  # fused weights, rows by heads: copies, set back
        set_model_state_dict(model, in_plan_layout(plain, model),
                             options=StateDictOptions(strict=False))  # a tied lm_head is not in plain
