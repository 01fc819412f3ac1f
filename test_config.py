"""Config checks: every bad value is one line naming the field, before any process group."""

import os
import subprocess
import sys

import pytest

from conftest import HERE, _config_error_lines, _torchrun, small_config
from config import ConfigError, load_config, parse_args, validate


BAD_CONFIGS = [
    ({"training.steps": 0}, "training.steps = 0 must be positive"),
    ({"training.local_batch_size": -2}, "training.local_batch_size = -2 must be positive"),
    ({"training.seq_len": 63}, "training.seq_len = 63 must be divisible by parallelism.tp = 2"),
    ({"model.num_attention_heads": 6, "model.hidden_size": 192, "model.num_key_value_heads": 3},
     "model.num_key_value_heads = 3 must be divisible by parallelism.tp = 2"),
    ({"model.num_attention_heads": 9, "model.hidden_size": 288, "model.num_key_value_heads": 9},
     "model.num_attention_heads = 9 must be divisible by parallelism.tp = 2"),
    ({"model.intermediate_size": 769}, "model.intermediate_size = 769 must be divisible by parallelism.tp = 2"),
    ({"parallelism.tp": 3}, "parallelism.dp_shard = 1 × parallelism.tp = 3 must equal the world size 2"),
    ({"parallelism.tp": 3, "parallelism.dp_shard": -1}, "world size 2 must be divisible by parallelism.tp = 3"),
    ({"parallelism.tp": 1}, "parallelism.dp_shard = 1 × parallelism.tp = 1 must equal the world size 2"),
    ({"parallelism.dp_shard": -1}, "parallelism.dp_shard and parallelism.tp are both -1"),
    ({"parallelism.dp_shard": 0}, "parallelism.dp_shard = 0 must be -1 (the remaining ranks) or >= 1"),
    ({"parallelism.dp_shard": 3, "parallelism.tp": 2}, "parallelism.dp_shard = 3 × parallelism.tp = 2 must equal"),
    ({"training.mixed_precision_reduce": "bfloat16"},
     "training.mixed_precision_reduce = 'bfloat16' needs parallelism.dp_shard > 1: FSDP2 reduce-scatters"),
    ({"training.float32_matmul_precision": "tf32"},
     "training.float32_matmul_precision = 'tf32' must be one of ['highest', 'high', 'medium']"),
    ({"training.mixed_precision_reduce": "float16"},
     "training.mixed_precision_reduce = 'float16' must be one of ['float32', 'bfloat16']"),
    ({"optimizer.lr": "fast"}, "optimizer.lr = 'fast' must be of type float"),
    ({"lr_scheduler.decay_type": "step"}, "lr_scheduler.decay_type = 'step' must be one of ['linear', 'sqrt', 'cosine']"),
    ({"lr_scheduler.min_lr_factor": 1.5}, "lr_scheduler.min_lr_factor = 1.5 must be in [0, 1]"),
    ({"lr_scheduler.decay_ratio": 0.0}, "lr_scheduler.decay_ratio = 0.0 must be in (0, 1], or -1"),
    ({"optimizer.beta2": 1.0}, "optimizer.beta1, beta2 = 0.9, 1.0 must be in [0, 1)"),
    ({"training.global_batch_size": 5}, "training.global_batch_size = 5 must be -1 or a multiple of training.local_batch_size "
                                       "x parallelism.dp_shard = 2"),
    ({"validation.freq": 0}, "validation.freq = 0 must be positive"),
    ({"compile.enable": 1}, "compile.enable = 1 must be of type bool"),
    ({"training.warmup": 3}, "unknown key training.warmup"),
    ({"parallelism.decoder_layer": "patched"}, "parallelism.decoder_layer = 'patched' must be one of"),
    ({"parallelism.attention_gather": "norm"}, "parallelism.attention_gather = 'norm' must be one of ['pre_hook', 'norm_output']"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_bad_config_names_field_and_constraint(overrides, message):
    cfg = small_config(**{"model.num_hidden_layers": 6})
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert message in str(e.value)


@pytest.mark.parametrize("path, message", [
    (("data",), "missing section [data]"),
    (("training", "seed"), "missing key training.seed (int)"),
    (("model", "rope_parameters"), "missing key model.rope_parameters (table)"),
    (("model", "rope_parameters", "factor"), "model.rope_parameters = {'rope_type': 'llama3', 'rope_theta': 500000.0, "
     "'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}: Missing required "
     "keys in `rope_parameters` for 'rope_type'='llama3': {'factor'}"),  # transformers' check
])
def test_missing_section_or_key_is_named_with_its_type(path, message):
    cfg = small_config()
    *tables, key = path
    table = cfg
    for name in tables:
        table = table[name]
    del table[key]
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert str(e.value) == message


@pytest.mark.parametrize("world_size, dp_shard, tp, resolved", [
    (2, 1, -1, (1, 2)),   # the default: TP over all ranks
    (1, 1, -1, (1, 1)),   # python train.py
    (4, 2, -1, (2, 2)),
    (4, -1, 2, (2, 2)),
    (4, -1, 1, (4, 1)),   # FSDP alone
])
def test_minus_one_takes_the_ranks_the_other_degree_leaves(world_size, dp_shard, tp, resolved):
    cfg = small_config(**{"parallelism.dp_shard": dp_shard, "parallelism.tp": tp})
    validate(cfg, world_size)
    assert (cfg["parallelism"]["dp_shard"], cfg["parallelism"]["tp"]) == resolved


def test_command_line_overrides_are_toml_literals_or_text():
    path, overrides = parse_args(["--parallelism.dp_shard", "-1", "--optimizer.lr=1e-3", "--compile.enable",
                                  "false", "--training.mixed_precision_param", "bfloat16", "--config", "c.toml",
                                  "--validation.steps", "2", "--model.attn_implementation", '"sdpa"'])
    assert path == "c.toml"
    assert overrides == {"parallelism.dp_shard": -1, "optimizer.lr": 1e-3, "compile.enable": False,
                         "training.mixed_precision_param": "bfloat16", "validation.steps": 2,
                         "model.attn_implementation": "sdpa"}
    cfg = load_config(str(HERE / "config.toml"), 4, {"parallelism.dp_shard": 2, "training.steps": 7})
    assert (cfg["parallelism"]["dp_shard"], cfg["parallelism"]["tp"], cfg["training"]["steps"]) == (2, 2, 7)
    # A key inside a table of a section: the RoPE scaling, switched off.
    cfg = load_config(str(HERE / "config.toml"), 2, parse_args(["--model.rope_parameters.factor", "1"])[1])
    assert cfg["model"]["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 1.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("argv, message", [
    (["--training.warmup", "3"], "unknown key training.warmup; known: steps,"),
    (["--checkpoints.enable", "true"], "unknown section [checkpoints]"),
    (["--training.steps", "ten"], "training.steps = 'ten' must be of type int"),
    (["--training.steps", "2.5"], "training.steps = 2.5 must be of type int"),
    (["--training.steps"], "--training.steps needs a value"),
    (["training.steps", "3"], "unexpected argument 'training.steps'"),
    (["--steps", "3"], "unknown option --steps"),
    # transformers' RoPE check, whose warnings are errors here
    (["--model.rope_parameters.scale", "2.0"], "Unrecognized keys in `rope_parameters` for 'rope_type'='llama3': {'scale'}"),
    (["--model.rope_parameters.factor", "big"], "`rope_parameters`'s factor field must be a float or int >= 1, got big"),
    (["--model.rope_parameters.rope_type", "bogus"], "model.rope_parameters.rope_type = 'bogus' must be one of "
     "transformers' ['default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'"),
    (["--model.rope_parameters", "3"], "model.rope_parameters = 3 must be a table"),
    (["--model.hidden_size.x", "3"], "--model.hidden_size.x: hidden_size is not a table"),
])
def test_bad_override_is_the_same_one_line_error_as_the_file(argv, message):
    with pytest.raises(ConfigError) as e:
        path, overrides = parse_args(argv)
        load_config(str(HERE / "config.toml"), 2, overrides)
    assert message in str(e.value)


def test_bad_override_exits_before_training_with_one_line():
    """Under torchrun: one line from rank 0 for both ranks (the file's errors: _probes)."""
    proc = _torchrun("--parallelism.dp_shard", "3")
    assert proc.returncode != 0
    assert _config_error_lines(proc) == [
        "config error: world size 2 must be divisible by parallelism.dp_shard = 3"], proc.stderr
    assert "step " not in proc.stdout


# bad input found before any work: one line from `python train.py`, no traceback ----------

def _probes(tmp_path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes((HERE / "config.toml").read_text().replace("# The one", "# Caf\u00e9: the one").encode("latin-1"))
    not_a_table = tmp_path / "model-3.toml"
    text = (HERE / "config.toml").read_text()
    not_a_table.write_text("model = 3\n" + text[text.index("[training]"):])
    negative_steps = tmp_path / "steps.toml"
    negative_steps.write_text(text.replace("steps = 40", "steps = -1"))
    return [
        (["--config", str(tmp_path)], f"config file '{tmp_path}' is a folder, not a file"),
        (["--config", str(latin1)], f"config file '{latin1}' is not UTF-8 text"),
        (["--config", str(not_a_table)], "model = 3 must be a table"),
        (["--config", str(negative_steps)], "config error: training.steps = -1 must be positive"),
        (["--config", str(tmp_path / "nope.toml")], f"config error: config file '{tmp_path / 'nope.toml'}' not found"),
        (["--help-me"], "unknown option --help-me"),
        (["--compile.backend", "nosuchbackend"], "compile.backend = 'nosuchbackend' is not a torch.compile backend"),
        (["--model.vocab_size", "100000000000"], "[model] needs 2,288,818.5 GiB per process (shards 762,939.5, "),
        (["--model.hidden_size", "1048576", "--model.num_attention_heads", "16"], "GiB per process (shards 393,496.2"),
        # 6 TiB of activations: more than any host's memory, so the probe fails on every machine.
        (["--training.seq_len", "131072", "--training.local_batch_size", "1024"],
         "(shards 0.1, FSDP groups 0.0, activations 6,024.0) and 1/1 of this machine"),
        (["--checkpoint.enable", "true", "--checkpoint.folder", f"{a_file}/sub"],
         f"checkpoint.folder = '{a_file}/sub' cannot be created or written: Not a directory"),
        (["--checkpoint.enable", "true", "--checkpoint.folder", "/proc/nope"],
         "checkpoint.folder = '/proc/nope' cannot be created or written"),
        (["--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "/proc/nope"],
         "metrics.save_tb_folder = '/proc/nope' cannot be created or written"),
        (["--optimizer.lr", "inf"], "optimizer.lr = inf must be finite and > 0"),
        (["--model.rms_norm_eps", "-1.0"], "model.rms_norm_eps = -1.0 must be finite and > 0"),
        (["--model.rope_parameters.rope_theta", "0.0"], "model.rope_parameters.rope_theta = 0.0 must be finite and > 0"),
    ]


def test_every_bad_input_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """Each probe through train.config_or_exit, the first thing train.main does (before any
    process group), in this process: exit 2 and one line on stderr. Any other exception would
    be the traceback the probe must not give. The real `python train.py` path is
    test_every_bad_input_exits_2_from_python_train_py."""
    import train

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for argv, message in _probes(tmp_path):
        with pytest.raises(SystemExit) as exit:
            train.config_or_exit(argv, train.launch_env())
            pytest.fail(f"{argv} passed every check")
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert exit.value.code == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], (argv, err)
        assert out == "", argv


def test_every_bad_input_exits_2_from_python_train_py(tmp_path):
    """Two probes as a user runs them: the folder as --config (the file is read) and an
    unknown compile backend (torch is asked)."""
    probes = [p for p in _probes(tmp_path) if p[0] in (["--config", str(tmp_path)], ["--compile.backend", "nosuchbackend"])]
    assert len(probes) == 2
    procs = [subprocess.Popen([sys.executable, str(HERE / "train.py"), *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in probes]
    for (argv, message), proc in zip(probes, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (argv, err[-3000:])
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], (argv, err[-3000:])
        assert "step " not in out, argv


SCHEDULER_TASKS = ("config error: 2 tasks started without torchrun (SLURM_NTASKS or OMPI_COMM_WORLD_SIZE) would "
                   "each train alone; start one torchrun per node: srun --ntasks-per-node=1 torchrun --nnodes ")


def test_a_schedulers_tasks_without_torchrun_stop_in_one_line(monkeypatch, capsys):
    """`srun -n 2 python train.py` would start two one-process runs into one checkpoint folder: exit 2
    with one line naming torchrun. One task, or torchrun's WORLD_SIZE, goes on."""
    import train

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(HERE / "train.py")], env={**env, "SLURM_NTASKS": "2"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(_config_error_lines(proc)) == 1, proc.stderr[-3000:]
    assert _config_error_lines(proc)[0].startswith(SCHEDULER_TASKS), proc.stderr
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.config_or_exit([], train.launch_env())
    assert capsys.readouterr().err.startswith(SCHEDULER_TASKS)
    for tasks, world_size in (("1", None), ("2", "2")):
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", tasks)
        if world_size:
            monkeypatch.setenv("WORLD_SIZE", world_size)
        assert train.config_or_exit([], train.launch_env())[0]["parallelism"]["tp"] == int(world_size or 1)


def test_too_many_processes_for_the_gpus_is_a_config_error(monkeypatch):
    import torch

    from config import check_resources

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as e:
        check_resources(small_config(), local_world_size=2)
    assert "2 processes on this node (torchrun --nproc_per_node) but 1 GPU(s)" in str(e.value)


def _saved_activation_bytes(rank: int, port: int, kv_heads: int, tp: int, out: str | None) -> dict:
    """Bytes autograd saves in a forward and loss on this rank (its local shards; parameters aside),
    by AC mode: "none" keeps every block's; "full" keeps each block's input and, while backward
    recomputes it, the largest block's. Both add what is saved outside the blocks and the logits'
    gradient that backward makes while the log-softmax is held."""
    import json
    from pathlib import Path

    import torch
    from torch.distributed.tensor import DTensor

    import parallelize
    from harness import join_gloo
    from model import build_model, forward_logits
    from train import cross_entropy, vocab_parallel

    cfg = small_config(**{"model.num_key_value_heads": kv_heads, "parallelism.tp": tp, "parallelism.dp_shard": 1,
                          "activation_checkpoint.mode": "none", "compile.enable": False})
    model = build_model(cfg["model"])
    if tp > 1:
        join_gloo(rank, tp, port)
        parallelize.parallelize(model, parallelize.build_parallel_dims(cfg, tp, "cpu"), cfg)
    local = lambda tensor: tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # noqa: E731
    weights = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved, inputs, block = {}, {}, [None]  # {storage: (block index or None, bytes)}, {block: its input's bytes}

    def count(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in weights:
            saved.setdefault(storage.data_ptr(), (block[0], storage.nbytes()))
        return tensor

    def enter(i):
        def hook(_module, args):
            block[0] = i
            inputs.setdefault(i, local(args[0]).nbytes)  # what full AC keeps of the block
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(enter(i))
        layer.register_forward_hook(lambda *_: block.__setitem__(0, None))
    t = cfg["training"]
    x = torch.randint(0, 256, (t["local_batch_size"], t["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        logits = forward_logits(model, x)
        with vocab_parallel(logits):
            cross_entropy(logits, x)
    per_block = [sum(n for b, n in saved.values() if b == i) for i in inputs]
    outside = sum(n for b, n in saved.values() if b is None) + 4 * x.numel() * cfg["model"]["vocab_size"] // tp
    measured = {"none": outside + sum(per_block), "full": outside + sum(inputs.values()) + max(per_block)}
    if rank == 0 and out:
        Path(out).write_text(json.dumps(measured))
    return measured


@pytest.mark.parametrize("kv_heads, tp", [(16, 1), (4, 1), (4, 2)])
def test_peak_per_rank_counts_the_activations_backward_keeps(kv_heads, tp, tmp_path):
    """config.peak_per_rank's activation term with AC off and full, on one process and on TP 2
    (sequence parallel, loss parallel): the tensors autograd saves in a forward and loss on a rank,
    within 2% (the estimate leaves out a few per-token scalars)."""
    import json

    from config import peak_per_rank
    from conftest import spawn

    if tp == 1:
        measured = _saved_activation_bytes(0, 0, kv_heads, tp, None)
    else:
        spawn(_saved_activation_bytes, lambda port: (port, kv_heads, tp, str(tmp_path / "saved.json")), tp, "saved")
        measured = json.loads((tmp_path / "saved.json").read_text())
    for mode in ("none", "full"):
        cfg = small_config(**{"model.num_key_value_heads": kv_heads, "parallelism.tp": tp, "parallelism.dp_shard": 1,
                              "activation_checkpoint.mode": mode})
        assert abs(peak_per_rank(cfg)["activations"] / measured[mode] - 1) < 0.02, (mode, peak_per_rank(cfg), measured)
