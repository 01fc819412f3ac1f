"""config.toml and `--section.key value` overrides: every key, its type, and the checks on it,
all made before any process group starts, so a bad value stops the run with one line."""

import logging
import math
import os
import shutil
import tomllib
from pathlib import Path

import torch
from torch._dynamo import list_backends
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hub_folder
from checkpoint import MARKER, checkpoint_state
from model import DECODER_LAYERS, build_model, hf_config

DTYPES = ("float32", "bfloat16")  # FSDP2's MixedPrecisionPolicy, else autocast's (parallelize.autocast)
SCHEMA = {  # every key and its type, or the values it may take, in config.toml's order
    "model": dict(hidden_size=int, num_hidden_layers=int, num_attention_heads=int, num_key_value_heads=int,
                  intermediate_size=int, vocab_size=int, tie_word_embeddings=bool, rms_norm_eps=float,
                  max_position_embeddings=int, attn_implementation=str,
                  rope_parameters=dict),  # any RoPE transformers' Llama takes, checked by LlamaConfig
    "training": dict(steps=int, local_batch_size=int, global_batch_size=int, seq_len=int, max_norm=float, seed=int,
                     mixed_precision_param=DTYPES, mixed_precision_reduce=DTYPES,
                     float32_matmul_precision=("highest", "high", "medium")),  # torch's names
    "optimizer": dict(lr=float, beta1=float, beta2=float, eps=float, weight_decay=float),  # torchtitan's names
    "lr_scheduler": dict(warmup_steps=int, decay_ratio=float, decay_type=("linear", "sqrt", "cosine"), min_lr_factor=float),
    "parallelism": dict(dp_shard=int, tp=int, decoder_layer=tuple(DECODER_LAYERS),
                        attention_gather=("pre_hook", "norm_output"),  # parallelize.block_plan
                        loss_parallel=bool),
    "activation_checkpoint": dict(mode=("full", "selective", "none"), selective_ac_option=str),
    "compile": dict(enable=bool, backend=str, fail_on_recompile=bool),
    "data": dict(path=str, split=str, text_field=str, tokenizer=str, cache_folder=str, max_bytes=int),
    "validation": dict(enable=bool, freq=int, steps=int, path=str),
    "metrics": dict(measure_cpu_peak=bool, log_freq=int, enable_tensorboard=bool, save_tb_folder=str),
    "checkpoint": dict(enable=bool, folder=str, interval=int, keep_latest_k=int,  # torchtitan's names
                       initial_load_path=str, initial_load_in_hf=bool, last_save_in_hf=bool, hf_max_shard_mb=int),
    "comm": dict(init_timeout_seconds=int, train_timeout_seconds=int),
}

# Every number is positive (a float finite too) but these, which may be 0 or -1: checked where they are used.
ZERO_OR_LESS = ("optimizer.beta1", "optimizer.beta2", "optimizer.weight_decay", "lr_scheduler.decay_ratio",
                "lr_scheduler.min_lr_factor", "lr_scheduler.warmup_steps", "training.global_batch_size", "training.seed",
                "parallelism.dp_shard", "parallelism.tp", "validation.steps", "checkpoint.keep_latest_k")


class ConfigError(ValueError):
    pass


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def parse_args(argv: list[str]) -> tuple[str | None, dict[str, object]]:
    """(`--config` path or None, {"section.key": value}) from the command line."""
    path, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        require(arg.startswith("--"), f"unexpected argument {arg!r}: overrides are written --section.key value")
        name, eq, text = arg[2:].partition("=")
        require(name == "config" or "." in name, f"unknown option --{name}: write --config PATH or --section.key value")
        if not eq:
            require(i + 1 < len(argv), f"--{name} needs a value")
            text, i = argv[i + 1], i + 1
        i += 1
        if name == "config":
            path = text
            continue
        try:  # a TOML literal (2, -1, 8e-4, true, "x"), else the text itself
            overrides[name] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[name] = text
    return path, overrides


def load_config(path: str, world_size: int, overrides: dict[str, object] | None = None) -> dict:
    """Read the config file, apply the overrides, check everything, resolve the -1 degrees."""
    try:
        cfg = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        why = {FileNotFoundError: "not found", IsADirectoryError: "is a folder, not a file",
               UnicodeDecodeError: "is not UTF-8 text", tomllib.TOMLDecodeError: f"is not valid TOML: {e}"}.get(type(e))
        raise ConfigError(f"config file {path!r} {why or f'cannot be read: {e.strerror}'}") from None
    for dotted, value in (overrides or {}).items():
        *tables, key = dotted.split(".")
        table = cfg
        for name in tables:
            table = table.setdefault(name, {})
            require(isinstance(table, dict), f"--{dotted}: {name} is not a table")
        table[key] = value  # an unknown name fails validation like the file's
    read_hf_folder(cfg, overrides or {})
    validate(cfg, world_size)
    return cfg


def read_hf_folder(cfg: dict, overrides: dict) -> None:
    """With checkpoint.initial_load_in_hf, [model] becomes the folder's (hub_folder.read); its problem in one line."""
    if problem := hub_folder.read(cfg, overrides):
        raise ConfigError(problem)


def validate(cfg: dict, world_size: int) -> None:
    """Raise ConfigError naming the first field that breaks a rule, section by section, in
    SCHEMA's order; resolve a -1 parallelism degree and data.tokenizer's "". [model] is config.toml's
    Llama keys, or an HF folder's config (read_hf_folder: any keys, its model_type). Nothing is written."""
    from_folder = isinstance(cfg.get("model"), dict) and "model_type" in cfg["model"]  # read_hf_folder's: any keys
    check_table(cfg, {**SCHEMA, "model": dict} if from_folder else SCHEMA)
    check_model(cfg["model"])
    check_training(cfg["training"], cfg["model"])
    check_optimizer(cfg["optimizer"], cfg["lr_scheduler"])
    check_parallelism(cfg, world_size)
    check_activation_checkpoint(cfg["activation_checkpoint"])
    check_compile(cfg["compile"])
    c = cfg["checkpoint"]
    if not cfg["data"]["tokenizer"] and c["initial_load_in_hf"]:  # the HF folder's tokenizer
        cfg["data"]["tokenizer"] = c["initial_load_path"]
    require(cfg["data"]["max_bytes"] >= 1_000_000, f"data.max_bytes = {cfg['data']['max_bytes']} must be >= 1000000")
    require(cfg["validation"]["steps"] >= 0, f"validation.steps = {cfg['validation']['steps']} must be >= 0")
    check_checkpoint(cfg["checkpoint"], cfg["model"])


def check_table(values: dict, fields: dict, prefix: str = "") -> None:
    """Every key of `fields` present with its type (a dict: a table checked the same way; a tuple: one of
    its values), no other key. An int is taken where a float is asked for."""
    what = lambda key: f"key {prefix}{key}" if prefix else f"section [{key}]"  # noqa: E731 (top level: sections)
    for key in values:
        require(key in fields, f"unknown {what(key)}; known: {', '.join(fields)}")
    for key, typ in fields.items():
        name = f"{prefix}{key}"
        kind = "table" if isinstance(typ, dict) or typ is dict else "str" if isinstance(typ, tuple) else typ.__name__
        require(key in values, f"missing {what(key)}" + (f" ({kind})" if prefix else ""))
        value = values[key]
        if isinstance(typ, tuple):
            require(value in typ, f"{name} = {value!r} must be one of {list(typ)}")
            continue
        if kind == "table":
            require(isinstance(value, dict), f"{name} = {value!r} must be a table")
            if isinstance(typ, dict):
                check_table(value, typ, name + ".")
            continue
        if typ in (float, str) and isinstance(value, int) and not isinstance(value, bool):
            values[key] = value = typ(value)  # 8 as 8.0; selective_ac_option = 2 as "2"
        require(isinstance(value, typ) and not (typ is int and isinstance(value, bool)),
                f"{name} = {value!r} must be of type {kind}")
        positive = name not in ZERO_OR_LESS
        require(typ is not int or value > 0 or not positive, f"{name} = {value} must be positive")
        require(typ is not float or (math.isfinite(value) and (value > 0 or not positive)),
                f"{name} = {value} must be finite" + " and > 0" * positive)


def check_model(m: dict) -> None:
    for a, b in (("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_key_value_heads")):
        require(m[a] % m[b] == 0, f"model.{a} = {m[a]} must be divisible by model.{b} = {m[b]}")
    if "model_type" not in m:  # config.toml's Llama keys; transformers has read a folder's RoPE
        rope, types = m["rope_parameters"], ["default", *ROPE_INIT_FUNCTIONS]
        require(rope.get("rope_type") in types, f"model.rope_parameters.rope_type = {rope.get('rope_type')!r} must be "
                f"one of transformers' {types}")
        theta = rope.get("rope_theta")
        require(type(theta) in (int, float) and math.isfinite(theta) and theta > 0,
                f"model.rope_parameters.rope_theta = {theta} must be finite and > 0")
        if problem := rope_problem(m):
            raise ConfigError(f"model.rope_parameters = {rope}: {problem}")
    require(m["attn_implementation"] != "flex_attention", "model.attn_implementation = 'flex_attention' is refused: "
            "torch 2.15 has no FlexAttention backward on CPU, and it has not trained on a GPU here; use 'sdpa'")
    require(m["attn_implementation"] in ("sdpa", "eager"), f"model.attn_implementation = {m['attn_implementation']!r} "
            "must be one of ['sdpa', 'eager'] (the masks model.forward_logits builds for the whole sequence)")


def rope_problem(m: dict) -> str | None:
    """transformers' check of [model]'s RoPE keys and values, whose warnings (a factor < 1, an
    unknown key) are errors here."""
    warnings, handler = [], logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        hf_config(m)
    except (KeyError, ValueError, TypeError) as e:
        return str(e).strip('"')
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    return next((w for w in warnings if "rope" in w.lower()), None)


def check_training(t: dict, m: dict) -> None:
    require(t["seq_len"] <= m["max_position_embeddings"],
            f"training.seq_len = {t['seq_len']} must be <= model.max_position_embeddings = "
            f"{m['max_position_embeddings']}")


def check_optimizer(o: dict, s: dict) -> None:
    require(0 <= o["beta1"] < 1 and 0 <= o["beta2"] < 1, f"optimizer.beta1, beta2 = {o['beta1']}, {o['beta2']} must be in [0, 1)")
    require(o["eps"] > 0 and o["weight_decay"] >= 0, f"optimizer.eps = {o['eps']} must be > 0, weight_decay >= 0")
    require(s["warmup_steps"] >= 0, f"lr_scheduler.warmup_steps = {s['warmup_steps']} must be >= 0")
    require(s["decay_ratio"] == -1 or 0 < s["decay_ratio"] <= 1,
            f"lr_scheduler.decay_ratio = {s['decay_ratio']} must be in (0, 1], or -1 (every step after the warm-up)")
    require(0 <= s["min_lr_factor"] <= 1, f"lr_scheduler.min_lr_factor = {s['min_lr_factor']} must be in [0, 1]")


def global_batch_size(cfg: dict) -> int:
    """Windows a step trains on, all dp ranks' microbatches: training.global_batch_size, -1 resolved."""
    t = cfg["training"]
    return t["global_batch_size"] if t["global_batch_size"] > 0 else t["local_batch_size"] * cfg["parallelism"]["dp_shard"]


def check_parallelism(cfg: dict, world_size: int) -> None:
    """The mesh (resolving a -1 degree in place), what TP divides, and what needs FSDP."""
    p, t = cfg["parallelism"], cfg["training"]
    p["dp_shard"], p["tp"] = dp_shard, tp = resolve_mesh(p["dp_shard"], p["tp"], world_size)
    for section, key in (("model", "num_attention_heads"), ("model", "num_key_value_heads"),
                         ("model", "intermediate_size"), ("model", "vocab_size"), ("training", "seq_len")):
        value = cfg[section][key]
        require(value % tp == 0, f"{section}.{key} = {value} must be divisible by parallelism.tp = {tp}")
    per_microbatch = t["local_batch_size"] * dp_shard
    require(t["global_batch_size"] == -1 or (t["global_batch_size"] > 0 and t["global_batch_size"] % per_microbatch == 0),
            f"training.global_batch_size = {t['global_batch_size']} must be -1 or a multiple of training.local_batch_size "
            f"x parallelism.dp_shard = {per_microbatch}")
    # torchtitan ignores it without FSDP; a setting that would do nothing is an error here.
    require(t["mixed_precision_reduce"] == "float32" or dp_shard > 1, f"training.mixed_precision_reduce = "
            f"{t['mixed_precision_reduce']!r} needs parallelism.dp_shard > 1: FSDP2 reduce-scatters the gradients")


def check_activation_checkpoint(ac: dict) -> None:
    option = ac["selective_ac_option"]
    require(option == "op" or (option.isdigit() and int(option) > 0),
            f"activation_checkpoint.selective_ac_option = {option!r} must be 'op' or a positive integer")


def check_compile(comp: dict) -> None:
    backend = comp["backend"]
    require(backend in list_backends(exclude_tags=()),
            f"compile.backend = {backend!r} is not a torch.compile backend ({', '.join(list_backends())}, ...)")


def check_checkpoint(c: dict, model_cfg: dict) -> None:
    """[checkpoint]'s values, and whether initial_load_path fits [model]; nothing is written."""
    require(c["keep_latest_k"] >= 0, f"checkpoint.keep_latest_k = {c['keep_latest_k']} must be >= 0 (0 keeps all)")
    for key in ("initial_load_path", "initial_load_in_hf", "last_save_in_hf"):
        require(c["enable"] or not c[key], f"checkpoint.{key} needs checkpoint.enable = true")
    require(c["initial_load_path"] or not c["initial_load_in_hf"],
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path")
    if not c["enable"]:
        return
    require(c["folder"].strip() != "", "checkpoint.folder is empty: name a folder for the step-N/ checkpoints")
    folder = Path(c["folder"])
    require(not folder.exists() or folder.is_dir(), f"checkpoint.folder = {c['folder']!r} is a file, not a folder")
    if not c["initial_load_path"]:
        return
    path, name = Path(c["initial_load_path"]), f"checkpoint.initial_load_path = {c['initial_load_path']!r}"
    require(path.exists(), f"{name} does not exist")
    require(path.is_dir(), f"{name} is not a folder")
    require(os.access(path, os.R_OK | os.X_OK), f"{name} cannot be read")
    if c["initial_load_in_hf"]:  # [model] is its config.json: the tensors must fit it
        problem = hub_folder.mismatch(path, model_cfg)
        require(problem is None, f"{name} does not fit its config.json: {problem}")
    else:
        require(checkpoint_state(path) == "complete", f"{name} is not a complete DCP checkpoint (no valid {MARKER})")


def prepare_checkpoint_folder(c: dict, model_cfg: dict, rank0: bool = True) -> str | None:
    """After validate: the folder created and written to now, not at the first save; then rank 0
    checks the room. No room for one checkpoint is an error; for keep_latest_k + 1 (or 2: those on
    disk while a save replaces the oldest), a warning, returned."""
    if not c["enable"]:
        return None
    folder = writable_folder(c["folder"], "checkpoint.folder")
    if not rank0:
        return None
    one, free = 12.12 * count_parameters(model_cfg)[0] + 2**20, shutil.disk_usage(folder).free  # measured: 12 bytes + 1%
    kept, mib = c["keep_latest_k"] + 1 if c["keep_latest_k"] else 2, lambda n: f"{n / 2**20:,.0f} MiB"
    require(free >= one, f"checkpoint.folder = {c['folder']!r} has {mib(free)} free, less than one checkpoint of "
            f"[model] ({mib(one)}: 12 bytes per parameter for the weights and AdamW's two moments)")
    return (f"warning: checkpoint.folder = {c['folder']!r} has {mib(free)} free, room for {int(free // one)} checkpoint(s) "
            f"of {mib(one)}, not the {kept} that keep_latest_k = {c['keep_latest_k']} needs during a save: that save "
            "will fail") if free < kept * one else None


def writable_folder(path: str, key: str) -> Path:
    """The folder of config key `key`, created and written to now, not at its first write."""
    folder, probe = Path(path), Path(path) / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key} = {path!r} cannot be created or written: {e.strerror or e}") from None
    return folder


def resolve_mesh(dp_shard: int, tp: int, world_size: int) -> tuple[int, int]:
    """(dp_shard, tp) with a -1 replaced by the ranks the other degree leaves, as torchtitan's
    ParallelDims does; their product must be the world size."""
    for name, degree in (("dp_shard", dp_shard), ("tp", tp)):
        require(degree == -1 or degree >= 1, f"parallelism.{name} = {degree} must be -1 (the remaining ranks) or >= 1")
    require(not dp_shard == tp == -1,
            "parallelism.dp_shard and parallelism.tp are both -1: at most one may take the remaining ranks")
    if -1 in (dp_shard, tp):
        name, fixed = ("tp", tp) if dp_shard == -1 else ("dp_shard", dp_shard)
        require(world_size % fixed == 0, f"world size {world_size} must be divisible by parallelism.{name} = {fixed}")
        dp_shard, tp = (world_size // tp, tp) if dp_shard == -1 else (dp_shard, world_size // dp_shard)
    require(dp_shard * tp == world_size,
            f"parallelism.dp_shard = {dp_shard} × parallelism.tp = {tp} must equal the world size {world_size}")
    return dp_shard, tp


def tasks_without_torchrun() -> str | None:
    """A scheduler's tasks (srun, mpirun) without torchrun's variables would each train alone, into
    one checkpoint folder: the line that stops them."""
    tasks = max(int(os.environ.get(name, 1)) for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if tasks == 1 or "WORLD_SIZE" in os.environ:
        return None
    return (f"{tasks} tasks started without torchrun (SLURM_NTASKS or OMPI_COMM_WORLD_SIZE) would each train "
            "alone; start one torchrun per node: srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES "
            "--nproc_per_node GPUS_PER_NODE --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py")


def check_resources(cfg: dict, local_world_size: int) -> None:
    """A GPU per process where there are GPUs, and memory for what `peak_per_rank` counts: the
    impossible, not the tight (it leaves out the interpreter, the allocator and the transients)."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        require(local_world_size <= gpus, f"{local_world_size} processes on this node (torchrun --nproc_per_node) "
                f"but {gpus} GPU(s): each process needs a GPU of its own")
        available, where = torch.cuda.get_device_properties(0).total_memory, "GPU 0 has"
    else:  # Linux's MemAvailable: free plus reclaimable cache
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024 / local_world_size
        where = f"1/{local_world_size} of this machine's free memory is"
    need = peak_per_rank(cfg)
    require(sum(need.values()) < available, f"[model] needs {sum(need.values()) / 2**30:,.1f} GiB per process ("
            + ", ".join(f"{part} {size / 2**30:,.1f}" for part, size in need.items()) + f") and {where} "
            f"{available / 2**30:,.1f} GiB: raise parallelism.tp or dp_shard, or lower training.local_batch_size or seq_len")


def peak_per_rank(cfg: dict) -> dict[str, float]:
    """Bytes one rank holds at its peak: its shards of the weights, gradients and AdamW's two
    moments; the largest FSDP group gathered with its gradient; the activations backward keeps,
    in float32 elements per token as counted by saved-tensor hooks (test_config.py)."""
    m, t, p = cfg["model"], cfg["training"], cfg["parallelism"]
    tp, layers, h, v, heads = p["tp"], m["num_hidden_layers"], m["hidden_size"], m["vocab_size"], m["num_attention_heads"]
    kv, i = h * m["num_key_value_heads"] // heads, m["intermediate_size"]
    block = (8 * h + 2 * kv + 4 * i + heads) / tp + 2 * h * (1 - 1 / tp)  # attention's and the MLP's inputs gathered
    head = 2 * h / tp + h + 2 * v / (tp if p["loss_parallel"] else 1)  # norm, lm_head's input, logits and their grad
    kept = block * layers if cfg["activation_checkpoint"]["mode"] == "none" else h / tp * layers + block  # AC: inputs
    params, largest = count_parameters(m)
    width = 2 if t["mixed_precision_param"] == "bfloat16" else 4
    masks = t["local_batch_size"] * t["seq_len"] ** 2 if cfg["data"]["path"] else 0  # block-causal: a bool per pair
    return {"shards": 16 * params / (tp * p["dp_shard"]), "FSDP groups": 2 * width * largest / tp * (p["dp_shard"] > 1),
            "activations": width * t["local_batch_size"] * t["seq_len"] * (kept + head) + masks}


def count_parameters(model_cfg: dict) -> tuple[int, int]:
    """The parameter count of [model]'s `*ForCausalLM`, and its largest FSDP group's (a block, or
    the final norm with lm_head), built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return count(model), max(count(model.model.layers[0]), count(model.model.norm) + count(model.lm_head))
