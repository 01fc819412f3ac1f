"""Train an HF Llama (the debugmodel, or yours) with FSDP2 x TP + SP, activation checkpointing and per-block compile.

    torchrun --nproc_per_node=2 train.py [--config config.toml] [--section.key value ...]
    torchrun --nproc_per_node=4 train.py --parallelism.dp_shard 2    # FSDP 2 x TP 2
    python train.py                                                   # one process
    torchrun --nproc_per_node=2 train.py --checkpoint.enable true --checkpoint.initial_load_in_hf true \
        --checkpoint.initial_load_path LLAMA_FOLDER --data.path DOCS.jsonl   # your Llama, your text

Any config key can be overridden, torchtitan-style (--training.steps 20): each value is a TOML
literal (2, -1, 8e-4, true, "text") or else plain text (paths need no quotes), checked as the file's.
"""

import time

T_START = time.perf_counter()  # time to first step counts the imports too

import collections
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import checkpoint
import hf_export
import report
from config import (ConfigError, check_resources, global_batch_size, load_config, parse_args,
                    prepare_checkpoint_folder, tasks_without_torchrun, writable_folder)
from data import IGNORED, DataError, held_out_batches, prepare, training_batches
from materialize import build_on_meta, materialize
from model import build_model, forward_logits
from parallelize import autocast, build_parallel_dims, parallelize
from preemption import agreed_signal, note_stop_signals
from workarounds import (clip_grad_norm_, exit_without_finalizing, set_comm_timeout, several_nodes_restart_problem,
                         store_for_this_restart)


def main() -> None:
    launch = launch_env()
    cfg, corpus = config_or_exit(sys.argv[1:], launch)
    t, ckpt = cfg["training"], cfg["checkpoint"]
    log = print if launch.rank == 0 else (lambda *a, **k: None)
    device = init_distributed(launch, cfg["comm"]["init_timeout_seconds"])
    torch.set_float32_matmul_precision(t["float32_matmul_precision"])  # TF32 on a GPU below "highest"
    try:
        log(report.run_line(cfg, launch.world_size, device))
        peak = report.peak_flops(device, cfg)
        parallel_dims = build_parallel_dims(cfg, launch.world_size, device.type)
        if cfg["parallelism"]["tp"] > 1:
            report.log_tp_groups(parallel_dims, launch.node, log)
        dp_mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims else None

        data, position = training_batches(corpus, cfg, dp_mesh)  # position: what a checkpoint saves
        log(report.data_line(cfg, corpus, position))
        model, optimizer, scheduler = build_training(cfg, device, parallel_dims, draw=not checkpoint.loads_weights(cfg))
        start_step = checkpoint.resume(cfg, model, optimizer, scheduler, position, log) if ckpt["enable"] else 0
        if start_step >= t["steps"]:
            log(f"checkpoint: step {start_step} is the last of training.steps = {t['steps']}; nothing to train")
            return

        validate = lambda signals: evaluate(  # noqa: E731
            model, held_out_batches(corpus, cfg, dp_mesh), cfg, device, dp_mesh, signals)
        run = train_loop(model, optimizer, scheduler, data, range(start_step + 1, t["steps"] + 1), cfg, device,
                         dp_mesh, launch.rank, log, position=position, validate=validate,
                         metrics=report.tensorboard(cfg, model, device, peak, launch.rank))
        exit_if_signalled(run, device, launch.rank, f"after step {t['steps']}")  # a signal in the last save
        if ckpt["last_save_in_hf"]:
            hf_export.save_hf(cfg, t["steps"], model, corpus.tokenizer, log)
            exit_if_signalled(run, device, launch.rank, "after the HF export")
        held_out_loss = validate(run.signals)
        exit_if_signalled(run, device, launch.rank, "in the held-out loss")
        report.log_summary(cfg, run, held_out_loss, model, optimizer, device, log, peak)
    except checkpoint.CheckpointError as e:  # a changed [model] or data at resume, a full disk
        exit_with(f"error: {e}", launch.rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------
# launch: torchrun's environment, the config, the process group

Launch = collections.namedtuple("Launch", "rank world_size local_rank local_world_size node")


def launch_env() -> Launch:
    """torchrun's variables; without them, one process. The node is GROUP_RANK: two torchrun
    agents on one machine count as two nodes."""
    defaults = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1, "GROUP_RANK": 0}
    return Launch(*(int(os.environ.get(name, default)) for name, default in defaults.items()))


def config_or_exit(argv: list[str], launch: Launch) -> tuple[dict, object]:
    """The checked config and data (data.Corpus), or exit 2 with one line (rank 0), before any
    process group exists."""
    if {"-h", "--help"} & set(argv):
        if launch.rank == 0:
            print(__doc__)
        sys.exit(0)
    try:
        path, overrides = parse_args(argv)
        cfg = load_config(path or str(Path(__file__).with_name("config.toml")), launch.world_size, overrides)
        check_resources(cfg, launch.local_world_size)
        if problem := tasks_without_torchrun() or several_nodes_restart_problem(launch):
            raise ConfigError(problem)
        corpus = prepare(cfg["data"], cfg["validation"]["path"], cfg["model"]["vocab_size"], global_batch_size(cfg),
                         cfg["training"]["seq_len"])
        if warning := prepare_checkpoint_folder(cfg["checkpoint"], cfg["model"], rank0=launch.rank == 0):
            print(warning, file=sys.stderr)  # on a shared filesystem, rank 0 checks for all
        if cfg["metrics"]["enable_tensorboard"] and launch.rank == 0:  # its one writer
            writable_folder(cfg["metrics"]["save_tb_folder"], "metrics.save_tb_folder")
        return cfg, corpus
    except (ConfigError, DataError) as e:
        exit_with(f"config error: {e}", launch.rank, code=2)


def exit_with(line: str, rank: int, code: int = 1) -> None:
    """Rank 0 prints the line; the others exit a moment later, so that torchrun (which stops
    every rank once one exits) cannot cut rank 0 off before it prints."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    sys.exit(code)


def init_distributed(launch: Launch, timeout_s: int) -> torch.device:
    """gloo + CPU, or nccl + this rank's GPU; no process group for one process."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", launch.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if launch.world_size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=datetime.timedelta(seconds=timeout_s), **store_for_this_restart(launch))
    return device


# -----------------------------------------------------------------------------
# the model, its optimizer and one step

def build_training(cfg: dict, device: torch.device, parallel_dims=None, draw: bool = True):
    """The model built on meta, parallelized over `parallel_dims` (None: one process), then each rank's
    shards filled with the weights one seeded process builds (materialize.py), unless a load will fill
    them (`draw` False); optimizer, LR schedule."""
    model, init_ops = build_on_meta(lambda: build_model(cfg["model"], cfg["parallelism"]["decoder_layer"]))
    parallelize(model, parallel_dims, cfg)
    materialize(model, init_ops, device, cfg["training"]["seed"], draw)
    model.train()
    return model, *build_optimizer(model, cfg)


def build_optimizer(model, cfg: dict):
    """AdamW ([optimizer]) and torchtitan's warm-up, stable, decay schedule ([lr_scheduler]) over training.steps."""
    o, s, steps = cfg["optimizer"], cfg["lr_scheduler"], cfg["training"]["steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                                  weight_decay=o["weight_decay"])
    warmup = min(s["warmup_steps"], steps)
    decay_steps = steps - warmup if s["decay_ratio"] == -1 else min(round(steps * s["decay_ratio"]), steps - warmup)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=warmup, decay_start=steps - decay_steps, decay_steps=decay_steps, decay_type=s["decay_type"],
        min_lr_factor=s["min_lr_factor"]))


def lr_factor(step: int, warmup: int, decay_start: int, decay_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """torchtitan 0.2.2's linear_warmup_stable_decay, but for the warm-up's (step + 1) / (warmup + 1): its
    / warmup changes the default run's losses. `step` counts from 0; at training.steps the decay ends."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, max(0.0, step - decay_start) / max(1, decay_steps))
    decay = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress), "cosine": (1 + math.cos(math.pi * progress)) / 2}
    return min_lr_factor + (1 - min_lr_factor) * decay[decay_type]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum over target tokens (IGNORED: none), in float32 also when FSDP computes in bfloat16, as torchtitan's."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum", ignore_index=IGNORED)


def vocab_parallel(logits: torch.Tensor):
    """torch's loss_parallel(), around the loss and its backward, for vocabulary-sharded logits."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def global_sum(value: torch.Tensor, dp_mesh) -> torch.Tensor:
    """A per-rank scalar summed over the dp ranks (loss_parallel's loss is a DTensor)."""
    value = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    if dp_mesh is not None:
        dist.all_reduce(value, group=dp_mesh.get_group())
    return value


def train_step(model, optimizer, scheduler, x, y, max_norm: float, forward=forward_logits, dp_mesh=None,
               amp=contextlib.nullcontext(), position_ids=None, microbatch: int | None = None) -> tuple[float, float]:
    """One update from this rank's rows, run `microbatch` rows at a time (gradients accumulate); returns
    (the global batch's mean loss per target token, grad norm before clipping). Ranks and microbatches
    may hold different counts of targets: each backward is its sum over the global count, times the dp
    size that FSDP's gradient average divides by. As torchtitan, FSDP2 reduce-scatters each microbatch's."""
    targets, losses = global_sum((y != IGNORED).sum(), dp_mesh).item(), []
    for rows in microbatches(len(x), microbatch):
        with amp:  # parallelize.autocast: bfloat16 matmuls without FSDP
            logits = forward(model, x[rows]) if position_ids is None else forward(model, x[rows], position_ids[rows])
        with vocab_parallel(logits):
            loss = cross_entropy(logits, y[rows])
            (loss * (dp_mesh.size() if dp_mesh is not None else 1) / targets).backward()
        losses.append(loss.detach())
    # torchtitan's, which reduces the norm of DTensor (TP/FSDP-sharded) gradients (workarounds.py).
    grad_norm = clip_grad_norm_(model.parameters(), max_norm).item()  # of all ranks' gradients, on every rank
    if math.isfinite(grad_norm):  # else no update: train_loop stops the run before any save
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return (global_sum(sum(losses), dp_mesh) / targets).item(), grad_norm


# -----------------------------------------------------------------------------
# the loop and the held-out loss

@dataclasses.dataclass
class Run:
    steps: range
    losses: list[float]
    step_times: list[float]
    lrs: list[float] = dataclasses.field(default_factory=list)  # the rate each step's update used
    time_to_first_step: float = 0.0  # from the process's start: imports, data, build, compile
    signals: list[int] = dataclasses.field(default_factory=list)  # SIGTERM/SIGINT noted, to act on after the loop


def microbatches(rows: int, size: int | None):
    """Slices of `size` rows (None: all of them), in order."""
    return (slice(start, start + (size or rows)) for start in range(0, rows, size or rows))


def train_loop(model, optimizer, scheduler, data, steps: range, cfg: dict, device, dp_mesh=None, rank: int = 0,
               log=print, forward=forward_logits, position=None, t_start: float = T_START, validate=None,
               metrics=None) -> Run:
    """Train `steps`, timing and logging each; the held-out loss by `validate(signals)` every validation.freq
    steps if validation.enable; TensorBoard by `metrics` (report.tensorboard); saves on [checkpoint]'s
    interval. A non-finite loss or gradient norm, a recompile after step 1 or SIGTERM stops the run in one line."""
    t, v = cfg["training"], cfg["validation"]
    run, amp = Run(steps, [], [], signals=note_stop_signals()), autocast(cfg, device.type)
    for step in steps:
        step_start, lr = time.perf_counter(), scheduler.get_last_lr()[0]  # the rate this step's update uses
        x, y, position_ids = (z if z is None else z.to(device) for z in next(data))
        with stop_on_recompile(step, rank):
            loss, grad_norm = train_step(model, optimizer, scheduler, x, y, t["max_norm"], forward, dp_mesh, amp,
                                         position_ids, t["local_batch_size"])
        stop_unless_finite(step, loss, grad_norm, cfg, rank)
        run.losses.append(loss)
        run.lrs.append(lr)
        run.step_times.append(time.perf_counter() - step_start)
        if step == steps[0]:
            after_first_step(run, cfg, t_start)
        log(f"step {step:3d} | loss {loss:.6f} | grad norm {grad_norm:.6f} | lr {lr:.6g} | "
            f"{report.tokens_per_step(cfg) / run.step_times[-1]:7.0f} tokens/s | {time.perf_counter() - t_start:6.1f} s")
        held_out = validate(run.signals) if validate and v["enable"] and step % v["freq"] == 0 else None
        if held_out is not None:
            log(f"validation: step {step} | loss {held_out:.6f}")
        if metrics:
            metrics(step, loss, lr, grad_norm, run.step_times[-1], held_out)
        save_or_stop(run, step, cfg, model, optimizer, scheduler, position, device, rank, log)
    return run


def stop_unless_finite(step: int, loss: float, grad_norm: float, cfg: dict, rank: int) -> None:
    """Both are global: every rank stops here, before any save."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}, not applied"
        exit_with(f"error: step {step}: {what}; check optimizer.lr, training.max_norm and [model]" + (
            f"; the last complete checkpoint stays in {cfg['checkpoint']['folder']}" if cfg["checkpoint"]["enable"] else ""),
            rank)


def after_first_step(run: Run, cfg: dict, t_start: float) -> None:
    """Every block is compiled: from now on a recompile fails, and collectives get the training timeout."""
    run.time_to_first_step = time.perf_counter() - t_start
    if cfg["compile"]["enable"] and cfg["compile"]["fail_on_recompile"]:
        torch.compiler.set_stance("fail_on_recompile")
    set_comm_timeout(cfg["comm"]["train_timeout_seconds"])  # as torchtitan, after step 1


def save_or_stop(run: Run, step: int, cfg: dict, model, optimizer, scheduler, position, device, rank: int, log) -> None:
    """A save on [checkpoint]'s interval, at the last step, or on a stop signal any rank received; then that stop."""
    ckpt, signum, saved = cfg["checkpoint"], agreed_signal(run.signals, device), None
    if ckpt["enable"] and (step % ckpt["interval"] == 0 or step == cfg["training"]["steps"] or signum):
        saved = checkpoint.save(cfg, step, model, optimizer, scheduler, position, log)
    if signum:
        exit_with(f"stopped by {signal.Signals(signum).name} after step {step}; "
                  + (f"saved {saved}" if saved else "checkpoints are off: nothing saved"), rank, code=128 + signum)


def exit_if_signalled(run: Run, device: torch.device, rank: int, when: str) -> None:
    """After the loop, a stop signal noted since ends the run in one line, before the HF export or
    the held-out loss outlasts a scheduler's grace period (a write in progress finishes first)."""
    if signum := agreed_signal(run.signals, device):
        exit_with(f"stopped by {signal.Signals(signum).name} {when}; skipped what was left", rank,
                  code=128 + signum)


@contextlib.contextmanager
def stop_on_recompile(step: int, rank: int):
    """Under the fail_on_recompile stance Dynamo raises with a long message whose last line is
    the guard that failed: exit with that line, not a traceback."""
    try:
        yield
    except RuntimeError as e:
        if "stance is 'fail_on_recompile'" not in str(e):
            raise
        reason = str(e).strip().splitlines()[-1].strip(" -")
        exit_with(f"error: step {step} recompiled a block ({reason}); compile.fail_on_recompile = true stops the run",
                  rank)


@torch.no_grad()
def evaluate(model, held_out, cfg: dict, device: torch.device, dp_mesh=None, signals=()) -> float | None:
    """The mean loss per target token of validation.steps global held-out batches (data.held_out_batches;
    None for none); None if a stop signal in `signals` cuts it short. Eager, so that no_grad, which the
    compiled blocks were not traced under, compiles no other graph."""
    total = targets = 0
    model.eval()
    with torch.compiler.set_stance("force_eager"):
        for _ in range(cfg["validation"]["steps"] if held_out is not None else 0):
            if agreed_signal(signals, device):
                total = targets = 0
                break
            x, y, position_ids, losses = *(z if z is None else z.to(device) for z in next(held_out)), []
            for rows in microbatches(len(x), cfg["training"]["local_batch_size"]):
                with autocast(cfg, device.type):
                    logits = forward_logits(model, x[rows], None if position_ids is None else position_ids[rows])
                with vocab_parallel(logits):
                    losses.append(cross_entropy(logits, y[rows]))
            total += global_sum(sum(losses), dp_mesh).item()
            targets += global_sum((y != IGNORED).sum(), dp_mesh).item()
    model.train()
    return total / targets if targets else None


if __name__ == "__main__":
    exit_without_finalizing(main)
