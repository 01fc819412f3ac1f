"""Train the HF Llama debugmodel with TP + SP, activation checkpointing and per-block compile.

    torchrun --nproc_per_node=2 train.py [--config config.toml]
    python train.py                      # one process, no TP

CPU ranks use gloo, GPU ranks nccl; the choice is made from what the machine has.
"""

import time

T_START = time.perf_counter()  # time to first step counts the imports too

import argparse
import math
import os
import resource
import statistics
import sys
import sysconfig
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.distributed.utils import clip_grad_norm_

from model import DECODER_LAYERS, build_model, forward_logits
from parallelize import build_tp_mesh, parallelize

# -----------------------------------------------------------------------------
# configuration: every key of config.toml, its type, and the checks on its value

SCHEMA = {
    "model": {
        "hidden_size": int,
        "num_hidden_layers": int,
        "num_attention_heads": int,
        "num_key_value_heads": int,
        "intermediate_size": int,
        "vocab_size": int,
        "rope_theta": float,
        "rms_norm_eps": float,
        "max_position_embeddings": int,
        "attn_implementation": str,
    },
    "training": {
        "steps": int,
        "local_batch_size": int,
        "seq_len": int,
        "lr": float,
        "warmup_steps": int,
        "max_norm": float,
        "seed": int,
    },
    "parallelism": {"tp": int, "decoder_layer": str},
    "activation_checkpoint": {"mode": str, "selective_ac_option": str},
    "compile": {"enable": bool, "backend": str, "fail_on_recompile": bool},
    "data": {"max_bytes": int, "eval_batches": int},
}


class ConfigError(ValueError):
    pass


def load_config(path: str, world_size: int) -> dict:
    """Read config.toml, check every key and value, and resolve `parallelism.tp`."""
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    validate(cfg, world_size)
    return cfg


def validate(cfg: dict, world_size: int) -> None:
    """Raise ConfigError naming the first field that breaks a rule; resolve `parallelism.tp`."""
    check_keys_and_types(cfg)
    check_values(cfg, world_size)


def check_keys_and_types(cfg: dict) -> None:
    for section in cfg:
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SCHEMA)}")
    for section, fields in SCHEMA.items():
        values = cfg.get(section)
        if not isinstance(values, dict):
            raise ConfigError(f"missing section [{section}]")
        for key in values:
            if key not in fields:
                raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(fields)}")
        for key, typ in fields.items():
            if key not in values:
                raise ConfigError(f"missing key {section}.{key} ({typ.__name__})")
            value = values[key]
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                values[key] = value = float(value)
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise ConfigError(f"{section}.{key} = {value!r} must be of type {typ.__name__}")


def check_values(cfg: dict, world_size: int) -> None:
    m, t, p = cfg["model"], cfg["training"], cfg["parallelism"]
    ac, data = cfg["activation_checkpoint"], cfg["data"]

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    for key in ("steps", "local_batch_size", "seq_len"):
        require(t[key] > 0, f"training.{key} = {t[key]} must be positive")
    for key in ("lr", "max_norm"):
        require(t[key] > 0, f"training.{key} = {t[key]} must be positive")
    require(t["warmup_steps"] >= 0, f"training.warmup_steps = {t['warmup_steps']} must be >= 0")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings"):
        require(m[key] > 0, f"model.{key} = {m[key]} must be positive")
    require(m["hidden_size"] % m["num_attention_heads"] == 0,
            f"model.hidden_size = {m['hidden_size']} must be divisible by "
            f"model.num_attention_heads = {m['num_attention_heads']}")
    require(m["num_attention_heads"] % m["num_key_value_heads"] == 0,
            f"model.num_attention_heads = {m['num_attention_heads']} must be divisible by "
            f"model.num_key_value_heads = {m['num_key_value_heads']}")
    require(m["vocab_size"] >= 256, f"model.vocab_size = {m['vocab_size']} must be >= 256 (byte tokens)")
    require(t["seq_len"] <= m["max_position_embeddings"],
            f"training.seq_len = {t['seq_len']} must be <= model.max_position_embeddings = "
            f"{m['max_position_embeddings']}")
    require(m["attn_implementation"] == "sdpa",
            f"model.attn_implementation = {m['attn_implementation']!r} must be 'sdpa' "
            "(the sequence-parallel forward relies on SDPA's is_causal with no mask)")

    require(p["tp"] == -1 or p["tp"] >= 1, f"parallelism.tp = {p['tp']} must be -1 (all ranks) or >= 1")
    tp = world_size if p["tp"] == -1 else p["tp"]
    require(world_size % tp == 0,
            f"world size {world_size} must be divisible by parallelism.tp = {tp}")
    require(world_size == tp,
            f"world size {world_size} must equal parallelism.tp = {tp}: this example applies no "
            "data parallelism, so launch with --nproc_per_node equal to the TP degree")
    for section, key in (("model", "num_attention_heads"), ("model", "num_key_value_heads"),
                         ("model", "intermediate_size"), ("model", "vocab_size"), ("training", "seq_len")):
        value = cfg[section][key]
        require(value % tp == 0, f"{section}.{key} = {value} must be divisible by parallelism.tp = {tp}")
    p["tp"] = tp
    require(p["decoder_layer"] in DECODER_LAYERS,
            f"parallelism.decoder_layer = {p['decoder_layer']!r} must be one of {list(DECODER_LAYERS)}")

    require(ac["mode"] in ("full", "selective", "none"),
            f"activation_checkpoint.mode = {ac['mode']!r} must be 'full', 'selective' or 'none'")
    option = ac["selective_ac_option"]
    require(option == "op" or (option.isdigit() and int(option) > 0),
            f"activation_checkpoint.selective_ac_option = {option!r} must be 'op' or a positive integer")

    require(data["max_bytes"] >= 1_000_000, f"data.max_bytes = {data['max_bytes']} must be >= 1000000")
    require(data["eval_batches"] >= 0, f"data.eval_batches = {data['eval_batches']} must be >= 0")


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


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """Endless (inputs, targets) of random windows; the same on every TP rank."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=g)
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


def peak_memory_per_rank_mib(device: torch.device, world_size: int) -> list[float]:
    """Every rank's peak: CUDA's max allocated, or on CPU the process's max RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB
    if world_size == 1:
        return [peak]
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak)
    return peaks


def dynamo_compile_counts() -> tuple[int, int]:
    """(graphs, recompiles) as Dynamo counted them. Only the blocks are compiled, so every
    graph is block code. Dynamo numbers each compile of a frame (the "1/2" in its compile ids);
    every compile after a frame's first is a recompile."""
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER
    from torch._dynamo.utils import counters

    recompiles = sum(n - 1 for n in FRAME_COMPILE_COUNTER.values() if n > 1)
    return counters["stats"]["unique_graphs"], recompiles


# -----------------------------------------------------------------------------


def lr_lambda(warmup_steps: int, steps: int):
    """Linear warm-up over `warmup_steps`, then linear decay to zero at `steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, 1 - (step - warmup_steps) / max(1, steps - warmup_steps))

    return factor


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: dict, device: torch.device) -> float:
    """Mean loss on held-out batches. Eager (force_eager) so that no_grad, which the compiled
    blocks were not traced under, does not compile another graph."""
    t = cfg["training"]
    it = batches(data, t["local_batch_size"], t["seq_len"], t["seed"] + 1)
    losses = []
    model.eval()
    with torch.compiler.set_stance("force_eager"):
        for _ in range(cfg["data"]["eval_batches"]):
            x, y = (z.to(device) for z in next(it))
            losses.append(F.cross_entropy(forward_logits(model, x).flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / max(1, len(losses))


def build_training(cfg: dict, device: torch.device):
    """The seeded model, parallelized (TP over all ranks when there are several), its
    optimizer and its LR schedule."""
    t = cfg["training"]
    torch.manual_seed(t["seed"])
    model = build_model(cfg["model"], cfg["parallelism"]["decoder_layer"]).to(device)
    tp = cfg["parallelism"]["tp"]
    tp_mesh = build_tp_mesh(tp, device.type) if tp > 1 else None
    parallelize(model, tp_mesh, cfg)
    model.train()
    return model, *build_optimizer(model, t)


def build_optimizer(model, t: dict):
    """AdamW with torchtitan's betas and weight decay, and the warm-up + linear-decay schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t["warmup_steps"], t["steps"]))
    return optimizer, scheduler


def train_step(model, optimizer, scheduler, x, y, max_norm: float, forward=forward_logits) -> tuple[float, float]:
    """One forward/backward/update; returns (loss, grad norm before clipping)."""
    logits = forward(model, x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    # torchtitan's clip_grad_norm_ reduces the norm of DTensor (TP-sharded) gradients correctly.
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grad_norm.item()  # .item() also waits for the step to finish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).with_name("config.toml")))
    args = parser.parse_args()

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg = load_config(args.config, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)

    rank, world_size, device = init_distributed()
    log = print if rank == 0 else (lambda *a, **k: None)
    t, comp = cfg["training"], cfg["compile"]
    log(f"torch {torch.__version__} | {world_size} rank(s) on {device.type} | TP={cfg['parallelism']['tp']} | "
        f"layer={cfg['parallelism']['decoder_layer']} | AC={cfg['activation_checkpoint']['mode']} | "
        f"compile={'per-block ' + comp['backend'] if comp['enable'] else 'off'}")

    train_data, held_out = load_stdlib_bytes(cfg["data"]["max_bytes"])
    log(f"data: {len(train_data):,} train bytes, {len(held_out):,} held-out bytes of the Python stdlib")
    model, optimizer, scheduler = build_training(cfg, device)
    data_iter = batches(train_data, t["local_batch_size"], t["seq_len"], t["seed"])
    tokens_per_step = t["local_batch_size"] * t["seq_len"]

    losses, step_times = [], []
    for step in range(1, t["steps"] + 1):
        step_start = time.perf_counter()
        x, y = (z.to(device) for z in next(data_iter))
        loss, grad_norm = train_step(model, optimizer, scheduler, x, y, t["max_norm"])
        losses.append(loss)
        step_times.append(time.perf_counter() - step_start)
        if step == 1:
            time_to_first_step = time.perf_counter() - T_START
            if comp["enable"] and comp["fail_on_recompile"]:
                # Every block has now been compiled; any further compile is a recompile.
                torch.compiler.set_stance("fail_on_recompile")
        log(f"step {step:3d} | loss {loss:.4f} | grad norm {grad_norm:.3f} | "
            f"{tokens_per_step / step_times[-1]:7.0f} tokens/s | {time.perf_counter() - T_START:6.1f} s")

    held_out_loss = evaluate(model, held_out, cfg, device)
    steady = step_times[2:] or step_times[1:] or step_times
    peaks = peak_memory_per_rank_mib(device, world_size)
    graphs, recompiles = dynamo_compile_counts()
    memory_kind = "max allocated" if device.type == "cuda" else "max RSS"
    log("summary:")
    log(f"  time to first step   {time_to_first_step:.1f} s")
    log(f"  steady tokens/s      {tokens_per_step / statistics.median(steady):.0f} "
        f"(median of steps {t['steps'] - len(steady) + 1}-{t['steps']})")
    log(f"  peak memory per rank {', '.join(f'{p:.0f}' for p in peaks)} MiB ({memory_kind})")
    log(f"  compiled graphs      {graphs} for {cfg['model']['num_hidden_layers']} blocks")
    log(f"  recompiles           {recompiles}")
    log(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f} (held-out {held_out_loss:.4f})")
    if world_size > 1:
        dist.destroy_process_group()
    if not all(math.isfinite(v) for v in losses):
        sys.exit("error: non-finite loss during training")


if __name__ == "__main__":
    main()
