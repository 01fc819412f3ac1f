"""Train the HF Llama debugmodel with FSDP2 x TP + SP, activation checkpointing and per-block compile.

    torchrun --nproc_per_node=2 train.py [--config config.toml] [--section.key value ...]
    torchrun --nproc_per_node=4 train.py --parallelism.dp_shard 2    # FSDP 2 x TP 2
    python train.py                                                   # one process

CPU ranks use gloo, GPU ranks nccl; the choice is made from what the machine has.
"""

import time

T_START = time.perf_counter()  # time to first step counts the imports too

import contextlib
import math
import os
import resource
import statistics
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import clip_grad_norm_

import checkpoint
from config import USAGE, ConfigError, check_resources, load_config, parse_args
from model import build_model, forward_logits
from parallelize import build_parallel_dims, parallelize

# -----------------------------------------------------------------------------
# data: bytes of the Python standard library's own source, on every machine, no download


def load_stdlib_bytes(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out) byte tensors. Files are read in sorted order; every 10th goes to
    held_out. Third-party packages are skipped so the text is the same for one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    train, held_out, total = bytearray(), bytearray(), 0
    for i, path in enumerate(files):
        text = path.read_bytes()
        (held_out if i % 10 == 0 else train).extend(text)
        total += len(text)
        if total >= max_bytes:
            break
    return torch.frombuffer(train, dtype=torch.uint8).long(), torch.frombuffer(held_out, dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator,
            dp_rank: int = 0, dp_size: int = 1):
    """Endless (inputs, targets) of random windows. Every rank draws the global batch's window
    starts from the same seeded generator and keeps the `batch_size` of its data-parallel rank,
    so the TP ranks of one group get the same windows, and one process with batch_size x
    dp_size sees exactly the global batch. The generator's state is the data position that a
    checkpoint saves."""
    while True:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size * dp_size,), generator=generator)
        starts = starts[dp_rank * batch_size : (dp_rank + 1) * batch_size]
        x = torch.stack([data[s : s + seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts])
        yield x, y


# -----------------------------------------------------------------------------
# distributed set-up: gloo + CPU, or nccl + the rank's GPU


def init_distributed() -> tuple[int, int, torch.device]:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    elif world_size > 1:
        dist.init_process_group("gloo")
    return rank, world_size, device


def build_mesh(cfg: dict, world_size: int, device: torch.device):
    """torchtitan's ParallelDims for (dp_shard, tp), or None for one process."""
    p = cfg["parallelism"]
    return build_parallel_dims(p["dp_shard"], p["tp"], device.type) if world_size > 1 else None


def gather_from_ranks(value, world_size: int) -> list:
    """[rank 0's value, rank 1's, ...]."""
    if world_size == 1:
        return [value]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def tp_groups_by_node(parallel_dims, world_size: int) -> dict[tuple[int, ...], list[int]]:
    """{TP group's global ranks: the nodes its ranks run on}. The node is torchrun's
    GROUP_RANK, so two torchrun processes on one machine count as two nodes."""
    tp_mesh = parallel_dims.get_mesh("tp")
    mine = (tuple(tp_mesh.mesh.flatten().tolist()), int(os.environ.get("GROUP_RANK", 0)))
    groups = {}
    for group, node in gather_from_ranks(mine, world_size):
        groups.setdefault(group, set()).add(node)
    return {group: sorted(nodes) for group, nodes in sorted(groups.items())}


def peak_memory_mib(device: torch.device) -> float:
    """This rank's peak: CUDA's max allocated, or on CPU the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def params_and_optimizer_mib(model, optimizer) -> tuple[float, float]:
    """(this rank's share, the unsharded total) of parameters + optimizer state, in MiB: what
    FSDP and TP shard, which a process's RSS hides. A DTensor's numel() is the global size,
    its local tensor this rank's shard."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    tensors = [*model.parameters(), *state]
    local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
    full = sum(t.numel() * t.element_size() for t in tensors)
    return local / 2**20, full / 2**20


def global_mean(value: torch.Tensor, dp_mesh) -> float:
    """A per-rank scalar averaged over the data-parallel ranks (the TP ranks of a group hold
    the same value). Every dp rank has the same batch size, so this is the global-batch mean."""
    if dp_mesh is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, group=dp_mesh.get_group())  # SUM: gloo has no AVG
    return value.item() / dp_mesh.size()


def dynamo_compile_counts() -> tuple[int, int]:
    """(graphs, recompiles) as Dynamo counted them. Only the blocks are compiled, so every
    graph is block code. Dynamo numbers each compile of a frame (the "1/2" in its compile ids);
    every compile after a frame's first is a recompile."""
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER
    from torch._dynamo.utils import counters

    recompiles = sum(n - 1 for n in FRAME_COMPILE_COUNTER.values() if n > 1)
    return counters["stats"]["unique_graphs"], recompiles


def compile_cache_counts() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(hits, misses, bypasses) of AOTAutograd's and of the FX-graph cache, Dynamo's counters.
    A warm restart hits both; a bypass is a graph that could not be cached at all."""
    from torch._dynamo.utils import counters

    return tuple(tuple(counters[group][f"{name}_cache_{event}"] for event in ("hit", "miss", "bypass"))
                 for group, name in (("aot_autograd", "autograd"), ("inductor", "fxgraph")))


def describe_compile_caches(per_rank: list) -> str:
    """One phrase for all ranks when they agree, else one per rank."""
    def text(counts):
        return "; ".join(f"{cache} {hit} hit, {miss} missed" + (f", {bypass} bypassed" if bypass else "")
                         for cache, (hit, miss, bypass) in zip(("AOTAutograd", "FX graph"), counts))
    if len(set(per_rank)) == 1:
        return text(per_rank[0]) + (" on every rank" if len(per_rank) > 1 else "")
    return " | ".join(f"rank {r}: {text(c)}" for r, c in enumerate(per_rank))


# -----------------------------------------------------------------------------


def lr_lambda(warmup_steps: int, steps: int):
    """Linear warm-up over `warmup_steps`, then linear decay to zero at `steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, 1 - (step - warmup_steps) / max(1, steps - warmup_steps))

    return factor


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: dict, device: torch.device, dp_mesh=None) -> float:
    """Mean loss on held-out batches (the global batch, split over the dp ranks as in
    training). Eager (force_eager) so that no_grad, which the compiled blocks were not traced
    under, does not compile another graph."""
    t = cfg["training"]
    dp_rank, dp_size = data_parallel_rank(dp_mesh)
    it = batches(data, t["local_batch_size"], t["seq_len"], torch.Generator().manual_seed(t["seed"] + 1), dp_rank, dp_size)
    losses = []
    model.eval()
    with torch.compiler.set_stance("force_eager"):
        for _ in range(cfg["data"]["eval_batches"]):
            x, y = (z.to(device) for z in next(it))
            losses.append(global_mean(cross_entropy(forward_logits(model, x), y), dp_mesh))
    model.train()
    return sum(losses) / max(1, len(losses))


def data_parallel_rank(dp_mesh) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number)."""
    return (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)


def build_training(cfg: dict, device: torch.device, parallel_dims=None):
    """The seeded model, parallelized over `parallel_dims` (None: one process), its optimizer
    and its LR schedule."""
    t = cfg["training"]
    torch.manual_seed(t["seed"])
    model = build_model(cfg["model"], cfg["parallelism"]["decoder_layer"]).to(device)
    parallelize(model, parallel_dims, cfg)
    model.train()
    return model, *build_optimizer(model, t)


def build_optimizer(model, t: dict):
    """AdamW with torchtitan's betas and weight decay, and the warm-up + linear-decay schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t["warmup_steps"], t["steps"]))
    return optimizer, scheduler


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # In float32 also when FSDP computes in bfloat16, as torchtitan's loss does.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(model, optimizer, scheduler, x, y, max_norm: float, forward=forward_logits,
               dp_mesh=None) -> tuple[float, float]:
    """One forward/backward/update; returns (global-batch mean loss, grad norm before clipping)."""
    loss = cross_entropy(forward(model, x), y)
    loss.backward()
    # torchtitan's clip_grad_norm_ reduces the norm of DTensor (TP/FSDP-sharded) gradients correctly.
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return global_mean(loss, dp_mesh), grad_norm.item()  # .item() also waits for the step to finish


@contextlib.contextmanager
def stop_on_recompile(step: int, rank: int):
    """After step 1 the stance is fail_on_recompile: a recompile raises in Dynamo with a long
    message whose last line is the guard that failed. Exit with that line, not a traceback."""
    try:
        yield
    except RuntimeError as e:
        if "stance is 'fail_on_recompile'" not in str(e):
            raise
        reason = str(e).strip().splitlines()[-1].strip(" -")
        exit_with(f"error: step {step} recompiled a block ({reason}); compile.fail_on_recompile = true stops the run",
                  rank)


def config_or_exit(argv: list[str]) -> dict:
    """The checked config, or exit 2 with one line (rank 0), before any process group exists."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if {"-h", "--help"} & set(argv):
        if rank == 0:
            print(__doc__ + "\n" + USAGE)
        sys.exit(0)
    try:
        path, overrides = parse_args(argv)
        cfg = load_config(path or str(Path(__file__).with_name("config.toml")), world_size, overrides)
        check_resources(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return cfg
    except ConfigError as e:
        exit_with(f"config error: {e}", rank, code=2)


def exit_with(line: str, rank: int, code: int = 1) -> None:
    """Rank 0 prints the line; the others exit a moment later, so that torchrun (which stops
    every rank once one exits) cannot cut rank 0 off before it prints."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    sys.exit(code)


def log_tp_groups(parallel_dims, world_size: int, log) -> None:
    """Each TP group with its nodes; a group across nodes would run TP over the slow links."""
    groups = tp_groups_by_node(parallel_dims, world_size)
    log("TP groups: " + " | ".join(f"{list(g)} on node {', '.join(map(str, n))}" for g, n in groups.items()))
    if any(len(nodes) > 1 for nodes in groups.values()):
        log("warning: a TP group spans nodes; set parallelism.tp to the GPUs per node")


def main() -> None:
    cfg = config_or_exit(sys.argv[1:])
    rank, world_size, device = init_distributed()
    log = print if rank == 0 else (lambda *a, **k: None)
    t, p, comp = cfg["training"], cfg["parallelism"], cfg["compile"]
    mesh = f"dp_shard {p['dp_shard']} × tp {p['tp']}"
    log(f"torch {torch.__version__} | {world_size} rank(s) on {device.type} | mesh {mesh} | "
        f"layer={p['decoder_layer']} | gather={p['attention_gather']} | AC={cfg['activation_checkpoint']['mode']} | "
        f"compile={'per-block ' + comp['backend'] if comp['enable'] else 'off'} | "
        f"params {t['mixed_precision_param']}, reduce {t['mixed_precision_reduce']}")

    parallel_dims = build_mesh(cfg, world_size, device)
    if p["tp"] > 1:
        log_tp_groups(parallel_dims, world_size, log)
    dp_mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims else None
    dp_rank, dp_size = data_parallel_rank(dp_mesh)

    train_data, held_out = load_stdlib_bytes(cfg["data"]["max_bytes"])
    log(f"data: {len(train_data):,} train bytes, {len(held_out):,} held-out bytes of the Python stdlib")
    model, optimizer, scheduler = build_training(cfg, device, parallel_dims)
    generator = torch.Generator().manual_seed(t["seed"])
    ckpt = cfg["checkpoint"]
    start_step = checkpoint.resume(ckpt, model, optimizer, scheduler, generator, log) if ckpt["enable"] else 0
    if start_step >= t["steps"]:
        log(f"checkpoint: step {start_step} is the last of training.steps = {t['steps']}; nothing to train")
        if world_size > 1:
            dist.destroy_process_group()
        return
    data_iter = batches(train_data, t["local_batch_size"], t["seq_len"], generator, dp_rank, dp_size)
    tokens_per_step = t["local_batch_size"] * dp_size * t["seq_len"]  # the global batch

    losses, step_times = [], []
    for step in range(start_step + 1, t["steps"] + 1):
        step_start = time.perf_counter()
        x, y = (z.to(device) for z in next(data_iter))
        with stop_on_recompile(step, rank):
            loss, grad_norm = train_step(model, optimizer, scheduler, x, y, t["max_norm"], dp_mesh=dp_mesh)
        if not math.isfinite(loss):  # the global mean: every rank stops here, before any save
            exit_with(f"error: step {step}: the loss is {loss}; check training.lr, training.max_norm and [model]"
                      + (f"; the last complete checkpoint stays in {ckpt['folder']}" if ckpt["enable"] else ""), rank)
        losses.append(loss)
        step_times.append(time.perf_counter() - step_start)
        if step == start_step + 1:
            time_to_first_step = time.perf_counter() - T_START
            if comp["enable"] and comp["fail_on_recompile"]:
                # Every block has now been compiled; any further compile is a recompile.
                torch.compiler.set_stance("fail_on_recompile")
        log(f"step {step:3d} | loss {loss:.6f} | grad norm {grad_norm:.6f} | "
            f"{tokens_per_step / step_times[-1]:7.0f} tokens/s | {time.perf_counter() - T_START:6.1f} s")
        if ckpt["enable"] and (step % ckpt["interval"] == 0 or step == t["steps"]):
            checkpoint.save(Path(ckpt["folder"]), step, ckpt["keep_latest_k"], model, optimizer, scheduler,
                            generator, log)
    if ckpt["last_save_in_hf"]:
        checkpoint.save_hf(Path(ckpt["folder"]), t["steps"], model, cfg["model"], log)

    held_out_loss = evaluate(model, held_out, cfg, device, dp_mesh) if cfg["data"]["eval_batches"] else None
    steady = step_times[2:] or step_times[1:] or step_times
    peaks = gather_from_ranks(peak_memory_mib(device), world_size)
    local_state, full_state = params_and_optimizer_mib(model, optimizer)
    states = gather_from_ranks(local_state, world_size)
    graphs, recompiles = dynamo_compile_counts()
    caches = gather_from_ranks(compile_cache_counts(), world_size)
    memory_kind = "max allocated" if device.type == "cuda" else "max RSS"
    log("summary:")
    log(f"  mesh                 {mesh}")
    log(f"  time to first step   {time_to_first_step:.1f} s")
    log(f"  compile caches       {describe_compile_caches(caches)}")
    log(f"  steady tokens/s      {tokens_per_step / statistics.median(steady):.0f} global "
        f"(median of steps {t['steps'] - len(steady) + 1}-{t['steps']})")
    log(f"  peak memory per rank {', '.join(f'{p:.0f}' for p in peaks)} MiB ({memory_kind})")
    log(f"  params + optimizer   {', '.join(f'{s:.1f}' for s in states)} MiB per rank, "
        f"{full_state:.1f} MiB unsharded ({max(states) / full_state:.0%} on the largest rank)")
    log(f"  compiled graphs      {graphs} for {cfg['model']['num_hidden_layers']} blocks")
    log(f"  recompiles           {recompiles}")
    notes = ([f"held-out {held_out_loss:.4f}"] if held_out_loss is not None else []) + (
        [f"steps {start_step + 1}-{t['steps']}"] if start_step else [])
    log(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f}" + (f" ({', '.join(notes)})" if notes else ""))
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
