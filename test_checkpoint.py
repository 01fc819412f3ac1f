"""Checkpoints: kill -9 and resume, an unfinished save, another mesh, HF out and in."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (HERE, _config_error_lines, _torchrun, again_if_a_rank_died_of_a_signal, free_port, small_config,
                      join_gloo, spawn)
from config import ConfigError, read_hf_folder, validate
from data import load_stdlib_bytes, random_windows


SMALL = ("--model.num_hidden_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--data.max_bytes", "1000000", "--validation.steps", "1", "--metrics.measure_cpu_peak", "false")  # 1 s
CKPT_STEPS = 20


def _ckpt_args(folder: Path, *extra: str, local_batch: int = 2) -> list[str]:
    return [*SMALL, "--training.local_batch_size", str(local_batch), "--training.steps", str(CKPT_STEPS),
            "--checkpoint.enable", "true", "--checkpoint.folder", str(folder), "--checkpoint.interval", "5", *extra]


def _launch(nproc: int, args: list[str], *torchrun_args: str) -> subprocess.Popen:
    """train.py on `nproc` ranks (1: a plain process), output unbuffered into a pipe, in a session
    of its own (as a scheduler's job or a terminal's foreground group)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", *torchrun_args] if nproc > 1 else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([*launcher, str(HERE / "train.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _train(nproc: int, args: list[str]) -> str:
    folder = Path(args[args.index("--checkpoint.folder") + 1]) if "--checkpoint.folder" in args else None
    fresh = folder is not None and not folder.exists()  # a new run's folder: emptied before a rerun

    def launch():
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)
        proc = _launch(nproc, args)
        out = proc.communicate(timeout=600)[0]
        return subprocess.CompletedProcess(proc.args, proc.returncode, out)
    proc = again_if_a_rank_died_of_a_signal(launch, fresh_each_time=fresh)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _step_values(out: str, name: str = "loss") -> dict[int, float]:
    """{step: value} of the step lines' `| loss ` or `| grad norm ` field."""
    return {int(line.split()[1]): float(line.split(f"| {name} ")[1].split()[0])
            for line in out.splitlines() if line.startswith("step ") and f"| {name} " in line}


def _step_losses(out: str) -> dict[int, float]:
    return _step_values(out, "loss")


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (torchrun's workers), from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def _run_killed_after(nproc: int, args: list[str], line: str, *torchrun_args: str) -> tuple[int, str]:
    """Start training, kill -9 one rank as soon as rank 0 logs `line`: (return code, output)."""
    proc = _launch(nproc, args, *torchrun_args)
    out = []
    for text in proc.stdout:
        out.append(text)
        if text.startswith(line):
            workers = _children(proc.pid) if nproc > 1 else [proc.pid]
            os.kill(workers[-1], signal.SIGKILL)
            break
    out.append(proc.communicate(timeout=600)[0])
    return proc.returncode, "".join(out)


@functools.cache
def uninterrupted(tmp_root: str, nproc: int, dp_shard: int) -> tuple[str, Path]:
    folder = Path(tmp_root) / f"ckpt-full-{nproc}"
    return _train(nproc, _ckpt_args(folder, "--parallelism.dp_shard", str(dp_shard), "--checkpoint.keep_latest_k", "2",
                                    "--checkpoint.last_save_in_hf", "true")), folder


def _assert_one_graph(out: str) -> None:
    assert "compiled graphs      1 for 2 blocks" in out and "recompiles           0" in out, out[-3000:]


def test_a_killed_rank_restarts_by_itself_with_the_uninterrupted_numbers(tmp_root, tmp_path, nproc=2, dp_shard=1):
    """torchrun --max-restarts 1: kill -9 of one rank after step 10's save, and the agent's new
    group (workarounds.store_for_this_restart) resumes from step 10 and finishes. On TP 2;
    test_tp_checkpoint_resumes_on_four_ranks loads its saves on 2D."""
    full, full_folder = uninterrupted(tmp_root, nproc, dp_shard)
    assert sorted(p.name for p in full_folder.iterdir()) == ["step-15", "step-20", "step-20-hf"], "keep_latest_k 2"
    folder = tmp_path / "ckpt"
    returncode, out = _run_killed_after(nproc, _ckpt_args(folder), "checkpoint: saved step 10 ", "--max-restarts", "1")
    assert returncode == 0, out[-4000:]
    killed, resumed = out.split(f"checkpoint: loaded step 10 from {folder / 'step-10'}")
    assert "step  20" not in killed and "connectFullMesh" not in out, out[-4000:]
    for name, tolerance in (("loss", dict(abs=1e-6, rel=0)), ("grad norm", dict(abs=0, rel=1e-5))):
        expected = {s: v for s, v in _step_values(full, name).items() if s > 10}  # every resumed step
        assert _step_values(resumed, name) == pytest.approx(expected, **tolerance), name
    _assert_one_graph(resumed)
    # A warm start: the killed group left its compiled graph in the (shared) inductor cache.
    [caches] = [line for line in resumed.splitlines() if line.startswith("  compile caches ")]
    assert re.search(r"AOTAutograd [1-9]\d* hit, 0 missed; FX graph [1-9]\d* hit, 0 missed on every rank", caches), caches


def _two_agents(folder: Path, args: list[str], own_store: bool) -> list[tuple[subprocess.Popen, Path]]:
    """train.py under two torchrun agents on this machine, as two nodes of one rank each, with
    --max-restarts 1; `own_store`: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. [(agent, its output file)]."""
    port, logs = free_port(), []
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents",
                "--max-restarts", "1"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if own_store else {}))
    folder.parent.mkdir(parents=True, exist_ok=True)
    for node in (0, 1):
        log = folder.parent / f"agent-{node}.log"
        proc = subprocess.Popen([*launcher, str(HERE / "train.py"), *args], stdout=log.open("w"),
                                stderr=subprocess.STDOUT, env=env)
        logs.append((proc, log))
    return logs


def test_restarts_on_several_nodes_without_their_own_store_are_refused_before_any_group(tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a restart on several nodes hung with nothing
    printed (workarounds.several_nodes_restart_problem): now one line, before any process group."""
    agents = _two_agents(tmp_path / "ckpt", _ckpt_args(tmp_path / "ckpt"), own_store=False)
    outs = []
    for proc, log in agents:
        proc.wait(timeout=300)
        outs.append(log.read_text())
    assert [proc.returncode for proc, _ in agents] == [1, 1], outs
    refusals = [line for out in outs for line in out.splitlines() if line.startswith("config error: torchrun")]
    assert refusals and set(refusals) == {"config error: torchrun --max-restarts on several nodes needs "
                                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node: a restarted group "
                                          "would meet the failed one's keys in the agents' shared store and hang"}
    assert "step   1" not in "".join(outs)


def test_a_killed_rank_on_one_of_two_nodes_restarts_with_the_uninterrupted_numbers(tmp_root, tmp_path):
    """Two agents as two nodes with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (README's line): kill -9
    of rank 1 after step 10's save; both agents restart and finish with the uninterrupted losses."""
    full, _ = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    agents = _two_agents(folder, _ckpt_args(folder), own_store=True)
    deadline = time.time() + 300
    while not any("checkpoint: saved step 10 " in log.read_text() for _, log in agents):
        assert time.time() < deadline and all(proc.poll() is None for proc, _ in agents), [
            log.read_text()[-2000:] for _, log in agents]
        time.sleep(0.2)
    rank_1 = next(proc for proc, log in agents if "checkpoint: saved step 10 " not in log.read_text())
    os.kill(_children(rank_1.pid)[-1], signal.SIGKILL)
    for proc, _ in agents:
        proc.wait(timeout=600)
    outs = [log.read_text() for _, log in agents]
    assert [proc.returncode for proc, _ in agents] == [0, 0], [out[-3000:] for out in outs]
    resumed = next(out for out in outs if "checkpoint: loaded step 10" in out and "| loss " in out)
    resumed = resumed.split("checkpoint: loaded step 10")[1]
    expected = {s: v for s, v in _step_values(full).items() if s > 10}
    assert _step_values(resumed) == pytest.approx(expected, abs=1e-6, rel=0)


def test_unfinished_save_is_skipped_for_the_previous_complete_one(tmp_root, tmp_path):
    full, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    for name in ("step-15", "step-20"):
        shutil.copytree(full_folder / name, folder / name)
    # step-20 as a save killed half-way leaves it: no marker, .metadata and a shard cut short.
    newest = folder / "step-20"
    (newest / "complete.json").unlink()
    for name in (".metadata", "__0_0.distcp"):
        data = (newest / name).read_bytes()
        (newest / name).write_bytes(data[: len(data) // 2])
    out = _train(1, _ckpt_args(folder))  # one process, from a 2-rank checkpoint: DCP reshards
    assert f"checkpoint: skipped {newest}: incomplete" in out, out[-3000:]
    assert f"checkpoint: loaded step 15 from {folder / 'step-15'}" in out, out[-3000:]
    assert_resumed_losses(out, full, after=15)
    assert (folder / "step-20" / "complete.json").exists(), "the resumed run saves step 20 anew"


def test_completeness_check_rejects_cut_files_and_markers(tmp_root, tmp_path):
    from checkpoint import checkpoint_state

    _, full_folder = uninterrupted(tmp_root, 2, 1)
    assert checkpoint_state(full_folder / "step-20") == "complete"
    for damage in ("marker", "shard"):
        path = tmp_path / damage
        shutil.copytree(full_folder / "step-20", path)
        target = path / ("complete.json" if damage == "marker" else "__1_0.distcp")
        target.write_bytes(target.read_bytes()[:-7])
        assert checkpoint_state(path) == "incomplete", damage


@pytest.mark.parametrize("stray", ["folder", "file"])
def test_hf_export_writes_over_an_unfinished_one(tmp_path, stray):
    """step-N-hf.tmp left by a killed export, as a folder or (by hand) a file: the export replaces
    it. A file once made save_pretrained raise AssertionError: a traceback, not one line."""
    from safetensors.torch import load_file

    from hf_export import save_hf
    from train import build_training

    cfg = small_config(**{"checkpoint.folder": str(tmp_path), "compile.enable": False})
    tmp = tmp_path / "step-4-hf.tmp"
    if stray == "folder":
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"cut")
    else:
        tmp.write_text("")
    model, *_ = build_training(cfg, torch.device("cpu"))
    save_hf(cfg, 4, model, "bytes", lambda line: None)
    assert not tmp.exists() and load_file(tmp_path / "step-4-hf" / "model.safetensors").keys() == model.state_dict().keys()


def assert_resumed_losses(out: str, full: str, after: int) -> None:
    """The resumed steps' losses are the uninterrupted run's: to 1e-4 right after the load; later
    the meshes' different reduction orders add up (1.3e-4 at step 20 on torch 2.10.0, 2 ranks)."""
    losses, expected = _step_losses(out), {s: v for s, v in _step_losses(full).items() if s > after}
    assert sorted(losses) == sorted(expected)
    first = sorted(expected)[:3]
    assert [losses[s] for s in first] == pytest.approx([expected[s] for s in first], abs=1e-4)
    assert losses == pytest.approx(expected, abs=5e-4)


def test_tp_checkpoint_resumes_on_four_ranks(tmp_root, tmp_path):
    """DCP reshards: TP 2's step-15 loads on dp_shard 2 x tp 2, the same global batch of 2
    windows (1 on each dp rank); on one process: test_unfinished_save_is_skipped_..."""
    full, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "on-4"
    shutil.copytree(full_folder / "step-15", folder / "step-15")
    out = _train(4, [*_ckpt_args(folder), "--parallelism.dp_shard", "2", "--training.local_batch_size", "1"])
    assert "checkpoint: loaded step 15" in out, out[-3000:]
    assert "checkpoint: resuming with training.local_batch_size 2 -> 1, parallelism.dp_shard 1 -> 2" in out
    assert_resumed_losses(out, full, after=15)
    _assert_one_graph(out)


HF_CHECK = r"""
import json, sys, sysconfig
from pathlib import Path
import torch, torch.nn.functional as F
from transformers import LlamaForCausalLM

folder, seq_len, batch, seed = sys.argv[1], 64, 2, 42
model = LlamaForCausalLM.from_pretrained(folder).eval()
root = Path(sysconfig.get_paths()["stdlib"])
files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
train, held_out, total = bytearray(), bytearray(), 0
for i, path in enumerate(files):
    text = path.read_bytes()
    (held_out if i % 10 == 0 else train).extend(text)
    total += len(text)
    if total >= 1_000_000:
        break

def loss_on_first_batch(data, seed):
    data = torch.frombuffer(data, dtype=torch.uint8).long()
    starts = torch.randint(len(data) - seq_len - 1, (batch,), generator=torch.Generator().manual_seed(seed))
    x = torch.stack([data[s : s + seq_len] for s in starts])
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts])
    with torch.no_grad():
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()

print(json.dumps({"held_out": loss_on_first_batch(held_out, seed + 1), "first_batch": loss_on_first_batch(train, seed),
                  "tied": model.lm_head.weight is model.model.embed_tokens.weight}))
"""


def test_hf_export_loads_in_stock_transformers_and_starts_a_new_run(tmp_root, tmp_path):
    full, full_folder = uninterrupted(tmp_root, 2, 1)
    export = full_folder / "step-20-hf"
    assert f"checkpoint: wrote the HF weights of step 20 to {export} (1 file(s), float32)" in full
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"  # the weights trained, with no source
    # A fresh process, no project code: the trainer's held-out loss (1 batch) from stock transformers.
    proc = subprocess.run([sys.executable, "-c", HF_CHECK, str(export)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = json.loads(proc.stdout.splitlines()[-1])
    held_out = float(full.split("(held-out ")[1].split(")")[0])
    assert stock["held_out"] == pytest.approx(held_out, abs=1e-4)
    out = _train(2, [*_ckpt_args(tmp_path / "new"), "--training.steps", "1", "--checkpoint.initial_load_path",
                     str(export), "--checkpoint.initial_load_in_hf", "true", "--data.tokenizer", "bytes"])
    assert "loaded the HF weights of" in out, out[-3000:]
    assert _step_losses(out)[1] == pytest.approx(stock["first_batch"], abs=1e-4)
    # The same weights from the run's own DCP checkpoint (model only), on one process.
    out = _train(1, [*_ckpt_args(tmp_path / "new-from-dcp"), "--training.steps", "1",
                     "--checkpoint.initial_load_path", str(full_folder / "step-20")])
    assert "loaded the DCP weights of" in out, out[-3000:]
    assert _step_losses(out)[1] == pytest.approx(stock["first_batch"], abs=1e-4)


def _stock_hf(folder: Path) -> dict:
    """HF_CHECK's numbers for `folder`, in a process with no project code."""
    proc = subprocess.run([sys.executable, "-c", HF_CHECK, str(folder)], capture_output=True, text=True,
                          timeout=300, cwd=folder.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_tied_hf_folder_from_stock_transformers_trains_and_exports_tied(tmp_path):
    """Llama 3.2's layout: tie_word_embeddings = true and no lm_head.weight in the safetensors."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    from model import hf_config

    cfg = small_config(**{"model.num_hidden_layers": 2, "model.tie_word_embeddings": True})
    stock_folder = tmp_path / "stock-tied"
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(cfg["model"])).save_pretrained(stock_folder)
    with safe_open(stock_folder / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    stock = _stock_hf(stock_folder)
    assert stock["tied"]
    folder = tmp_path / "run"
    out = _train(2, [*SMALL, "--model.tie_word_embeddings", "true", "--training.steps", "1", "--checkpoint.enable",
                     "true", "--checkpoint.folder", str(folder), "--checkpoint.initial_load_path", str(stock_folder),
                     "--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true", "--data.tokenizer", "bytes"])
    assert _step_losses(out)[1] == pytest.approx(stock["first_batch"], abs=1e-5)
    export = folder / "step-1-hf"
    with safe_open(export / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    exported = _stock_hf(export)
    assert exported["tied"], "stock transformers loads the export untied"
    assert exported["held_out"] == pytest.approx(float(out.split("(held-out ")[1].split(")")[0]), abs=1e-4)
    # An untied --model key names the difference in one line.
    with pytest.raises(ConfigError, match="--model.tie_word_embeddings = False, but .*config.json has "
                                          "tie_word_embeddings = True \\(as transformers reads it\\)"):
        read_hf_folder(small_config(**{"checkpoint.enable": True, "checkpoint.initial_load_path": str(stock_folder),
                                       "checkpoint.initial_load_in_hf": True}), {"model.tie_word_embeddings": False})


def test_bad_checkpoint_input_is_one_line(tmp_root, tmp_path):
    _, full_folder = uninterrupted(tmp_root, 2, 1)
    export = full_folder / "step-20-hf"
    wrong_shape = tmp_path / "wrong-shape"
    shutil.copytree(export, wrong_shape)
    from safetensors.torch import load_file, save_file

    weights = load_file(wrong_shape / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:128]
    save_file(weights, wrong_shape / "model.safetensors")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    small = {"model.num_hidden_layers": 2, "checkpoint.enable": True}
    cases = [
        ({"checkpoint.initial_load_path": str(tmp_path / "nope")}, "checkpoint.initial_load_path = '{}' does not exist"),
        ({"checkpoint.initial_load_path": str(a_file)}, "checkpoint.initial_load_path = '{}' is not a folder"),
        ({"checkpoint.initial_load_path": str(export), "checkpoint.initial_load_in_hf": True,
          "model.hidden_size": 128}, "--model.hidden_size = 128, but {}/config.json has hidden_size = 256"),
        ({"checkpoint.initial_load_path": str(wrong_shape), "checkpoint.initial_load_in_hf": True},
         "does not fit its config.json: model.norm.weight has shape [128] there, [256] for [model]"),
        ({"checkpoint.initial_load_path": str(export)}, "is not a complete DCP checkpoint"),
        ({"checkpoint.folder": str(a_file)}, "checkpoint.folder = '{}' is a file, not a folder"),
        ({"checkpoint.interval": 0}, "checkpoint.interval = 0 must be positive"),
        ({"checkpoint.hf_max_shard_mb": 0}, "checkpoint.hf_max_shard_mb = 0 must be positive"),
        ({"checkpoint.folder": " "}, "checkpoint.folder is empty"),
        ({"checkpoint.enable": False, "checkpoint.last_save_in_hf": True}, "checkpoint.last_save_in_hf needs"),
    ]
    for overrides, message in cases:
        path = overrides.get("checkpoint.initial_load_path", overrides.get("checkpoint.folder", ""))
        with pytest.raises(ConfigError) as e:  # [model] keys as given on the command line
            cfg = small_config(**{**small, **overrides})
            read_hf_folder(cfg, {k: v for k, v in overrides.items() if "model." in k})
            validate(cfg, 2)
        assert message.format(path) in str(e.value), overrides
    # The launcher's view: one line, no step, nothing written.
    proc = _torchrun(*SMALL, "--checkpoint.enable", "true", "--checkpoint.folder", str(tmp_path / "unused"),
                     "--checkpoint.initial_load_path", str(wrong_shape), "--checkpoint.initial_load_in_hf", "true")
    assert proc.returncode != 0
    assert len(_config_error_lines(proc)) == 1 and "model.norm.weight has shape" in proc.stderr, proc.stderr
    assert "step " not in proc.stdout and not (tmp_path / "unused").exists()



# a folder that reads differently per rank, or fails to read once -------------------------

def _resume_main(rank: int, port: int, folder: str, out: str) -> None:
    """Two TP ranks resume from `folder`; rank 1 sees the newest checkpoint as not there yet,
    as a node with stale metadata on a shared filesystem would."""
    import torch
    import torch.distributed as dist

    import checkpoint
    import parallelize
    import train
    from conftest import small_config
    from config import validate

    join_gloo(rank, 2, port)
    if rank == 1:
        real_state = checkpoint.checkpoint_state
        checkpoint.checkpoint_state = lambda p: "incomplete" if p.name == f"step-{CKPT_STEPS}" else real_state(p)
    cfg = small_config(**{"model.num_hidden_layers": 2, "compile.enable": False, "checkpoint.enable": True,
                          "checkpoint.folder": folder})
    validate(cfg, 2)
    model, optimizer, scheduler = train.build_training(cfg, torch.device("cpu"), parallelize.build_parallel_dims(cfg, 2, "cpu"))
    step = checkpoint.resume(cfg, model, optimizer, scheduler, torch.Generator(), lambda *a: None)
    steps = [None, None]
    dist.all_gather_object(steps, step)
    if rank == 0:
        Path(out).write_text(json.dumps(steps))
    dist.destroy_process_group()


def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_root, tmp_path):
    _, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    for name in ("step-15", f"step-{CKPT_STEPS}"):
        shutil.copytree(full_folder / name, folder / name)
    out = tmp_path / "steps.json"
    spawn(_resume_main, lambda port: (port, str(folder), str(out)), 2, "two ranks resuming")
    assert json.loads(out.read_text()) == [CKPT_STEPS, CKPT_STEPS], "rank 1 must load rank 0's choice"


def test_prune_never_deletes_a_complete_checkpoint_it_failed_to_read(tmp_root, tmp_path, monkeypatch):
    from checkpoint import MARKER, prune

    _, full_folder = uninterrupted(tmp_root, 2, 1)
    folder = tmp_path / "ckpt"
    for name in ("step-15", f"step-{CKPT_STEPS}"):
        shutil.copytree(full_folder / name, folder / name)
    (folder / "step-10").mkdir()  # a save killed before its marker: known garbage
    real_read_text, failed = Path.read_text, []

    def read_text_failing_once(path, *args, **kwargs):
        if path == folder / "step-15" / MARKER and not failed:
            failed.append(path)
            raise OSError(5, "Input/output error")  # a transient EIO
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text_failing_once)
    removed = prune(folder, newest=CKPT_STEPS, keep_latest_k=0)
    assert failed, "the marker read must have failed once"
    assert removed == ["step-10"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-15", f"step-{CKPT_STEPS}"]


# fused projections (hf_layout.RowsByParts) under FSDP --------------------------

FUSED_FAMILIES = ("glm4", "phi3+mha")  # [gate; up]; phi3 also [q; k; v]


def _fused_family_main(rank: int, port: int, folder: str) -> None:
    """For each family on dp_shard 2 x tp 2 (eager): 4 steps with a DCP save after step 2, then a
    fresh model resumed from it for steps 3-4; step 4 saved too, the HF weights as save_hf gathers
    them, and the logits of the trained model; those weights loaded by slices (checkpoint.load_hf)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from hf_layout import in_hf_layout

    import checkpoint
    import parallelize
    import train
    from harness import build_family

    join_gloo(rank, 4, port)
    cfg = small_config(**{"parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.decoder_layer": "stock",
                          "parallelism.attention_gather": "norm_output", "compile.enable": False, "training.steps": 4})
    validate(cfg, 4)
    t, quiet = cfg["training"], lambda *a: None
    in_folder = lambda name: {**cfg, "checkpoint": {**cfg["checkpoint"], "folder": str(Path(folder, name))}}  # noqa: E731
    data, _ = load_stdlib_bytes(cfg["data"]["max_bytes"])
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    whole = lambda logits: logits.full_tensor() if isinstance(logits, DTensor) else logits  # noqa: E731
    results = {}
    for family in FUSED_FAMILIES:
        def build():
            torch.manual_seed(t["seed"])
            model = build_family(family, cfg["model"])
            parallel_dims = parallelize.build_parallel_dims(cfg, 4, "cpu")
            parallelize.parallelize(model, parallel_dims, cfg)
            return (model, *train.build_optimizer(model, cfg), parallel_dims.get_optional_mesh("batch"))

        def run(model, optimizer, scheduler, generator, dp_mesh, steps, save_after=None):
            batches = random_windows(data, t["local_batch_size"], t["seq_len"], generator, dp_mesh)
            losses = []
            for step in steps:
                losses.append(train.train_step(model, optimizer, scheduler, *next(batches)[:2], t["max_norm"], dp_mesh=dp_mesh)[0])
                if step == save_after:
                    checkpoint.save(in_folder(family), step, model, optimizer, scheduler, generator, quiet)
            return losses

        model, optimizer, scheduler, dp_mesh = build()
        generator = torch.Generator().manual_seed(t["seed"])
        uninterrupted = run(model, optimizer, scheduler, generator, dp_mesh, range(1, 5), 2)
        checkpoint.save(in_folder(family + "-end"), 4, model, optimizer, scheduler, generator, quiet)
        weights = {name: whole(w) for name, w in in_hf_layout(get_model_state_dict(model), model).items()}  # as save_hf's
        with torch.no_grad():
            logits = whole(train.forward_logits(model, x))
        hf = Path(folder, family + "-hf")
        if rank == 0:
            hf.mkdir()
            save_file({k: v.contiguous() for k, v in weights.items()}, hf / "model.safetensors")
            torch.save({"weights": weights, "logits": logits}, Path(folder, family + ".pt"))
        dist.barrier()
        model, optimizer, scheduler, dp_mesh = build()
        generator = torch.Generator()
        step = checkpoint.resume(in_folder(family), model, optimizer, scheduler, generator, quiet)
        resumed = run(model, optimizer, scheduler, generator, dp_mesh, range(step + 1, 5))
        imported = build()[0]
        checkpoint.load_hf(imported, hf)
        with torch.no_grad():
            imported_logits = whole(train.forward_logits(imported, x))
        results[family] = {"uninterrupted": uninterrupted, "resumed": resumed,
                           "import_logits_diff": (imported_logits - logits).abs().max().item()}
    if rank == 0:
        Path(folder, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_fused_families_resume_and_export_exact_on_dp_shard_and_tp(tmp_path):
    """glm4 and phi3 (MHA) on dp_shard 2 x tp 2: the fused weights' rows are held by parts on TP
    (hf_layout.RowsByParts) and Shard(1) on FSDP (family_plan.fsdp_shard_placement), saved and loaded by
    DCP in HF's order (hf_layout.in_hf_layout).
    A DCP resume gives the uninterrupted losses, and the last checkpoint loads into one process as
    the HF export's weights (HF's layout, on another mesh); the HF export loads into one process
    with the trained model's logits, and back by slices into dp_shard 2 x tp 2."""
    import torch.distributed.checkpoint as dcp

    from harness import build_family
    from model import forward_logits

    spawn(_fused_family_main, lambda port: (port, str(tmp_path)), 4, "fused families on dp_shard 2 x tp 2")
    results = json.loads((tmp_path / "results.json").read_text())
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for family in FUSED_FAMILIES:
        r, saved = results[family], torch.load(tmp_path / f"{family}.pt")
        assert r["resumed"] == r["uninterrupted"][2:], family
        one = build_family(family, small_config()["model"])
        one.load_state_dict(saved["weights"], strict=True)  # HF's names and layout
        with torch.no_grad():
            assert (forward_logits(one, x) - saved["logits"]).abs().max() < 1e-5, family
        assert r["import_logits_diff"] < 1e-5, family
        loaded = {"model": {name: torch.empty_like(w) for name, w in saved["weights"].items()}}
        dcp.load(loaded, checkpoint_id=tmp_path / f"{family}-end" / "step-4")
        assert all(torch.equal(loaded["model"][name], w) for name, w in saved["weights"].items()), family
