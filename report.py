"""What a run reports: its set-up line, TP groups by node, the summary. Every rank gathers; rank 0 logs."""

import datetime
import resource
import statistics
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.tools.utils import get_peak_flops

from config import global_batch_size
from data import kind, vocabulary_size
from parallelize import bfloat16_by


def mesh_name(cfg: dict) -> str:
    return f"dp_shard {cfg['parallelism']['dp_shard']} × tp {cfg['parallelism']['tp']}"


def tokens_per_step(cfg: dict) -> int:  # the global batch: every data-parallel rank's microbatches
    return global_batch_size(cfg) * cfg["training"]["seq_len"]


def run_line(cfg: dict, world_size: int, device: torch.device) -> str:
    p, comp, t = cfg["parallelism"], cfg["compile"], cfg["training"]
    compute = t["mixed_precision_param"] + (f" by {by}" if (by := bfloat16_by(cfg)) else "")
    return (f"torch {torch.__version__} | {world_size} rank(s) on {device.type} | mesh {mesh_name(cfg)} | "
            f"layer={p['decoder_layer']} | gather={p['attention_gather']} | AC={cfg['activation_checkpoint']['mode']} | "
            f"compile={'per-block ' + comp['backend'] if comp['enable'] else 'off'} | "
            f"compute {compute}, reduce {t['mixed_precision_reduce']}, float32 matmuls {t['float32_matmul_precision']}")


def data_line(cfg: dict, corpus, position) -> str:
    """What trains (data.Corpus, packed by `position`), its tokens and targets, what was skipped, cut, held out, where."""
    if isinstance(corpus.train, torch.Tensor):
        return f"data: {len(corpus.train):,} train bytes, {len(corpus.held_out):,} held-out bytes of the Python stdlib"
    d, n, train, held = cfg["data"], cfg["training"]["seq_len"], corpus.train, corpus.held_out
    tokens, targets, cut, lost = train.trained(n)
    built = "read from the tokenized copy" if train.tokens.built is None else f"tokenized in {train.tokens.built:.1f} s into"
    held_out = (f"{len(held):,} {kind(held)}, {corpus.held_out_from}" if held
                else f"none ({corpus.held_out_from} of {len(train):,}: set validation.path)")
    cut = f"; {cut:,} over seq_len cut to it, {lost:,} left out: no target in it" if train.conversations() else ""
    return (f"data: {len(train):,} {kind(train)}, {tokens:,} tokens ({targets / tokens:.1%} targets) of {d['path']} "
            f"({d['split']}; {train.tokens.skipped:,} {kind(train, 'skipped')}{cut}), {built} {d['cache_folder']}/"
            f"{train.tokens.key} by {corpus.source}'s tokenizer ({vocabulary_size(corpus.tokenizer):,} ids); held out: "
            f"{held_out}; {position.packed(tokens)}, shuffled each epoch by training.seed; block-causal masks of "
            f"{cfg['training']['local_batch_size'] * n ** 2 / 2**20:,.1f} MiB a step")


def log_tp_groups(parallel_dims, node: int, log) -> None:
    """Each TP group with its ranks' nodes; a group across nodes would run TP over slow links."""
    mine = (tuple(parallel_dims.get_mesh("tp").mesh.flatten().tolist()), node)
    groups = {}
    for group, where in gather_from_ranks(mine):
        groups.setdefault(group, set()).add(where)
    log("TP groups: " + " | ".join(f"{list(g)} on node {', '.join(map(str, sorted(n)))}"
                                   for g, n in sorted(groups.items())))
    if any(len(nodes) > 1 for nodes in groups.values()):
        log("warning: a TP group spans nodes; set parallelism.tp to the GPUs per node")


def gather_from_ranks(value) -> list:
    """[rank 0's value, rank 1's, ...]."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def flops_per_token(model, cfg: dict) -> int:
    """torchtitan's count, from its own function: 6 x non-embedding parameters + 6 x layers x
    heads x (q/k + v head dims) x seq_len. Its `model.children()` are torchtitan's modules. A tied
    lm_head is the embedding's parameter, listed once and subtracted as the embedding: its matmul
    (6 x vocabulary x hidden) is added back."""
    m, inner = cfg["model"], model.model
    as_titan = torch.nn.Sequential(inner.embed_tokens, inner.layers, inner.norm, model.lm_head)
    args = types.SimpleNamespace(n_layers=m["num_hidden_layers"], n_heads=m["num_attention_heads"])  # FLOPs: no tying
    head_dims = 2 * (m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"])  # qwen3: its own head_dim
    flops = get_dense_model_nparams_and_flops(args, as_titan, head_dims, cfg["training"]["seq_len"])[1]
    return flops + (6 * model.lm_head.weight.numel() if model.lm_head.weight is inner.embed_tokens.weight else 0)


def peak_flops(device: torch.device, cfg: dict) -> tuple[float, str] | None:
    """(every rank's peak FLOP/s together, its source) in the dtype the matmuls run in: bfloat16 with
    mixed_precision_param (FSDP2 or autocast), else float32 (TF32 on a GPU below "highest" precision).
    torchtitan's bf16 table on a GPU it lists (another gets its A100 fallback, 312e12), else a matmul of
    that dtype timed on all ranks at once; on CPU only with metrics.measure_cpu_peak. A GPU's peak
    memory is counted from after the probe."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    cuda, bf16 = device.type == "cuda", cfg["training"]["mixed_precision_param"] == "bfloat16"
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    if cuda and bf16 and ((peak := get_peak_flops(where)) != 312e12 or "A100" in where):
        return ranks * peak, f"{ranks} x {where}'s {peak / 1e12:.0f} TFLOP/s bfloat16 (torchtitan's table)"
    if not cuda and not cfg["metrics"]["measure_cpu_peak"]:
        return None
    from torch.utils.benchmark import Timer  # here: its import warns on a CPU host with a CUDA toolkit

    size = 4096 if cuda else 1024
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    if dist.is_initialized():
        dist.barrier()  # every rank's core busy at once, as in training
    # torch's Timer syncs a GPU, warms up while it sizes its blocks, then times blocks for 1 s (their median)
    timer = Timer("a @ a", globals={"a": a}, num_threads=torch.get_num_threads())
    peaks = gather_from_ranks(2 * size**3 / timer.blocked_autorange(min_run_time=1.0).median)
    del a
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # the probe's matrices are not the run's
    dtype = "bfloat16" if bf16 else "TF32" if cuda and torch.get_float32_matmul_precision() != "highest" else "float32"
    unit, scale = ("TFLOP/s", 1e12) if cuda else ("GFLOP/s", 1e9)
    return sum(peaks), f"a measured {ranks} x {statistics.mean(peaks) / scale:.0f} {unit} {where} {dtype} matmul peak"


def peak_memory_mib(device: torch.device) -> float:
    """This rank's peak: CUDA's max allocated, or on CPU the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def tensorboard(cfg: dict, model, device: torch.device, peak: tuple[float, str] | None, rank: int):
    """On rank 0 with metrics.enable_tensorboard, torchtitan's TensorBoardLogger in save_tb_folder/<date-time>/,
    as a function of a step's numbers: every log_freq steps its loss, lr, grad norm, tokens/s, MFU and peak
    memory; a validation loss at any step. Flushed each time: a killed run keeps what it logged."""
    m = cfg["metrics"]
    if not m["enable_tensorboard"] or rank != 0:
        return None
    from torchtitan.components.metrics import TensorBoardLogger

    logger = TensorBoardLogger(str(Path(m["save_tb_folder"]) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    flops = flops_per_token(model, cfg)

    def log(step: int, loss: float, lr: float, grad_norm: float, step_time: float, validation_loss: float | None):
        values = {} if validation_loss is None else {"validation_loss": validation_loss}
        if step % m["log_freq"] == 0:
            tokens_per_s = tokens_per_step(cfg) / step_time
            values.update(loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                          peak_memory_mib=peak_memory_mib(device), **({"mfu": flops * tokens_per_s / peak[0]} if peak else {}))
        if values:  # else nothing to write at this step
            logger.log(values, step)
            logger.writer.flush()
    return log


def params_and_optimizer_mib(model, optimizer) -> tuple[float, float]:
    """(this rank's share, the unsharded total) of parameters + optimizer state, in MiB: what TP
    and FSDP shard, which RSS hides. A DTensor's numel() is global, its local tensor the shard."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    tensors = [*model.parameters(), *state]
    local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
    full = sum(t.numel() * t.element_size() for t in tensors)
    return local / 2**20, full / 2**20


def dynamo_compile_counts() -> tuple[int, int]:
    """(graphs, recompiles) as Dynamo counted them; only blocks are compiled. Every compile of a
    frame after its first (the "1/2" in Dynamo's compile ids) is a recompile."""
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER
    from torch._dynamo.utils import counters

    recompiles = sum(n - 1 for n in FRAME_COMPILE_COUNTER.values() if n > 1)
    return counters["stats"]["unique_graphs"], recompiles


def describe_compile_caches() -> str:
    """Hits, misses and bypasses of AOTAutograd's and the FX-graph cache (Dynamo's counters): one
    phrase for all ranks when they agree, else one per rank."""
    from torch._dynamo.utils import counters

    per_rank = gather_from_ranks(tuple(tuple(counters[group][f"{name}_cache_{e}"] for e in ("hit", "miss", "bypass"))
                                       for group, name in (("aot_autograd", "autograd"), ("inductor", "fxgraph"))))

    def text(counts):
        return "; ".join(f"{cache} {hit} hit, {miss} missed" + (f", {bypass} bypassed" if bypass else "")
                         for cache, (hit, miss, bypass) in zip(("AOTAutograd", "FX graph"), counts))
    if len(set(per_rank)) == 1:
        return text(per_rank[0]) + (" on every rank" if len(per_rank) > 1 else "")
    return " | ".join(f"rank {r}: {text(c)}" for r, c in enumerate(per_rank))


def log_summary(cfg: dict, run, held_out_loss: float | None, model, optimizer, device: torch.device, log,
                peak: tuple[float, str] | None = None) -> None:
    """The summary block (README, "What a run prints"). `run` is train.train_loop's record,
    `peak` peak_flops'."""
    steady = run.step_times[2:] or run.step_times[1:] or run.step_times
    tokens_per_s = tokens_per_step(cfg) / statistics.median(steady)
    flops = flops_per_token(model, cfg) * tokens_per_s
    first, last = run.steps[0], run.steps[-1]
    peaks = gather_from_ranks(peak_memory_mib(device))
    local_state, full_state = params_and_optimizer_mib(model, optimizer)
    states = gather_from_ranks(local_state)
    caches = describe_compile_caches()
    graphs, recompiles = dynamo_compile_counts()
    notes = ([f"held-out {held_out_loss:.4f}"] if held_out_loss is not None else []) + (
        [f"steps {first}-{last}"] if first > 1 else [])
    log("summary:")
    log(f"  mesh                 {mesh_name(cfg)}")
    log(f"  time to first step   {run.time_to_first_step:.1f} s")
    log(f"  compile caches       {caches}")
    log(f"  steady tokens/s      {tokens_per_s:.0f} global (median of steps {last - len(steady) + 1}-{last})")
    log(f"  TFLOPS, MFU          {flops / 1e12:.3f} TFLOP/s of model FLOPs"
        + (f", MFU {flops / peak[0]:.0%} of {peak[1]}" if peak else " (no peak: metrics.measure_cpu_peak = false)"))
    log(f"  peak memory per rank {', '.join(f'{p:.0f}' for p in peaks)} MiB "
        f"({'max allocated' if device.type == 'cuda' else 'max RSS'})")
    log(f"  params + optimizer   {', '.join(f'{s:.1f}' for s in states)} MiB per rank, "
        f"{full_state:.1f} MiB unsharded ({max(states) / full_state:.0%} on the largest rank)")
    log(f"  compiled graphs      {graphs} for {cfg['model']['num_hidden_layers']} blocks")
    log(f"  recompiles           {recompiles}")
    log(f"  loss                 {run.losses[0]:.4f} -> {run.losses[-1]:.4f}" + (f" ({', '.join(notes)})" if notes else ""))
    log(f"  learning rate        {run.lrs[0]:.4g} at step {first}, {run.lrs[-1]:.4g} at step {last}, "
        f"{optimizer.param_groups[0]['lr']:.4g} after it (the schedule's end)")
