"""The trainer's paths end to end: torchrun, two nodes, the benchmark, selective AC, FSDP
alone, fail_on_recompile, bfloat16 by FSDP and by autocast, and one GPU where the host has one."""

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from conftest import (DP_SHARD, GLOBAL_BATCH, GPU_ENV, HERE, TP, _losses, _torchrun, _torchrun_cmd,
                      again_if_a_rank_died_of_a_signal, assert_every_gradient_matches, free_port, run_2d, run_one,
                      run_ranks, run_tp)
from harness import gradient_differences


def test_torchrun_trains_with_one_graph_and_falling_loss():
    proc = _torchrun("--training.steps", "12", "--model.num_hidden_layers", "4", "--training.seq_len", "128")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.count("| loss ") == 12, out
    assert "compiled graphs      1 for 4 blocks" in out, out
    assert "recompiles           0" in out, out
    losses = _losses(out)
    assert losses[-1] < losses[0] - 0.5, losses
    mfu = re.search(r"MFU (\d+)% of a measured 2 x (\d+) GFLOP/s CPU float32 matmul peak", out)
    assert mfu and 0 < int(mfu[1]) <= 100 and int(mfu[2]) > 0, out


def test_two_nodes_keep_every_tp_group_inside_one_node():
    """Two torchrun agents on this machine act as two nodes of 2 ranks (c10d rendezvous);
    with tp 2 each TP group must be the two ranks of one node."""
    def two_agents() -> subprocess.CompletedProcess:
        launcher = ("--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=two-nodes")
        cmd = _torchrun_cmd("--parallelism.tp", "2", "--parallelism.dp_shard", "-1", "--training.steps", "4",
                            "--model.num_hidden_layers", "2", "--training.seq_len", "64",
                            "--training.local_batch_size", "2", "--metrics.measure_cpu_peak", "false", launcher=launcher)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_LOGS="recompiles")
        nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(2)]
        outputs = [node.communicate(timeout=600) for node in nodes]
        return subprocess.CompletedProcess(cmd, next((n.returncode for n in nodes if n.returncode), 0),
                                           "".join(o for o, _ in outputs), "".join(e for _, e in outputs))

    proc = again_if_a_rank_died_of_a_signal(two_agents)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "Recompiling function" not in out + proc.stderr
    [groups_line] = [line for line in out.splitlines() if line.startswith("TP groups: ")]
    groups = {}
    for group in groups_line[len("TP groups: "):].split(" | "):
        ranks, where = group.split("] on node ")
        groups[tuple(int(r) for r in ranks.strip("[").split(", "))] = [int(n) for n in where.split(", ")]
    assert sorted(groups) == [(0, 1), (2, 3)], groups_line
    assert all(len(nodes) == 1 for nodes in groups.values()), f"a TP group spans nodes: {groups_line}"
    assert sorted(n for nodes in groups.values() for n in nodes) == [0, 1], groups_line
    assert "mesh                 dp_shard 2 × tp 2" in out, out
    assert "compiled graphs      1 for 2 blocks" in out, out
    assert "recompiles           0" in out, out
    [memory] = [line for line in out.splitlines() if "params + optimizer" in line]
    share = float(memory.split("(")[1].split("%")[0])
    assert share <= 30, memory


def test_bench_reports_torchtitan_and_transformers_tp_with_one_graph_and_the_one_process_losses():
    """The table's columns, on the titan and native variants (each is a cold compile); the loss
    gap is each variant's largest per-step difference from bench's one-process run."""
    cmd = [sys.executable, str(HERE / "bench.py"), "--steps", "3", "--warm-rounds", "0", "--seq-len", "64",
           "--batch", "2", "--layers", "2", "--variants", "titan,native"]
    proc = again_if_a_rank_died_of_a_signal(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=900))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for variant in ("titan", "native"):
        [cells] = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
                   if line.startswith(f"| {variant} ")]
        assert cells[7:9] == ["1", "0"], f"{variant} graphs/recompiles {cells[7:9]}\n{proc.stdout}"
        assert 0 < float(cells[5].rstrip("%")) <= 100, f"MFU {cells[5]}"
        assert re.fullmatch(r"\d+\.\d{3} -> \d+\.\d{3}", cells[9]), cells[9]
        assert float(cells[10]) <= 1e-5, f"{variant}'s loss gap to one process {cells[10]}"
    assert re.search(r"MFU of one peak for every row: \d+ GFLOP/s, the median of 2 runs' .*"
                     r"the first run's: a measured 2 x ", proc.stdout), proc.stdout


def test_bench_gives_rows_of_one_speed_one_mfu_whatever_peak_their_runs_timed(capsys):
    """Each run times its own peak (1.4x apart in one table); every row's MFU is against their median."""
    import bench

    row = dict(cold_ttfs=50.0, warm_ttfs=None, tokens_per_s=1000.0, model_flops=5e10, peak="a measured 2 x 50 GFLOP/s",
               peak_mib=1349, graphs=1, recompiles=0, first_loss=7.727, last_loss=5.27, loss_gap=1e-6)
    rows = {"patched": {**row, "peak_flops": [1.0e11, 1.1e11]}, "titan": {**row, "peak_flops": [1.4e11]}}
    bench.print_table(rows, types.SimpleNamespace(nproc=2, layers=6, batch=8, seq_len=512, ac="full", steps=8,
                                                     warm_rounds=1, override_args=[]))
    out = capsys.readouterr().out
    assert "MFU of one peak for every row: 110 GFLOP/s, the median of 3 runs' (100-140)" in out, out
    assert [line.split("|")[6].strip() for line in out.splitlines() if line.startswith("| ")][1:] == ["45.5%"] * 2, out


# selective activation checkpointing (full: the parity tests), FSDP alone --------------

SELECTIVE_OP = {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"}
EVERY_2ND = {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2"}
FSDP_ALONE = {"parallelism.dp_shard": DP_SHARD, "parallelism.tp": 1}
BF16 = {"training.mixed_precision_param": "bfloat16"}
TWO_D = {"parallelism.dp_shard": DP_SHARD}
RUNS_TOGETHER = {TP: [("llama", None, o) for o in (SELECTIVE_OP, EVERY_2ND, FSDP_ALONE, BF16, {})],  # FSDP alone: 2 ranks too
                 DP_SHARD * TP: [("llama", None, {**TWO_D, **BF16}), ("llama", None, TWO_D)]}


@pytest.mark.parametrize("ac, graphs", [(SELECTIVE_OP, 1), (EVERY_2ND, 2)], ids=["op", "every-2nd"])
def test_selective_ac_trains_tp_with_the_one_process_numbers(tmp_root, ac, graphs):
    """AC changes what backward recomputes, never the numbers. Every 2nd block checkpointed
    means two kinds of block, so two graphs (one per kind), and still no recompile."""
    r = run_tp(tmp_root, **ac)
    assert r["error"] is None, r["error"]
    assert (r["graphs"], r["recompiles"]) == (graphs, 0), r["recompile_reasons"]
    single = run_one()
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)


def test_fsdp_alone_trains_with_the_one_process_numbers(tmp_root):
    r = run_ranks(tmp_root, DP_SHARD, **FSDP_ALONE)
    assert r["error"] is None, r["error"]
    assert (r["graphs"], r["recompiles"]) == (1, 0), r["recompile_reasons"]
    assert "" in r["fsdp_modules"] and r["kwargs_hooks"], "FSDP2 wraps the model"
    single = run_one(**GLOBAL_BATCH)
    assert r["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)


def test_bfloat16_without_fsdp_autocasts_every_matmul_and_keeps_float32_weights(tmp_root):
    """TP 2 alone (SP, loss parallel, full AC, per-block compile) with bfloat16: torch.autocast
    around the forward. Every matmul inductor compiles is bfloat16, lm_head's weight stays float32,
    1 graph, 0 recompiles. Every step-1 gradient is within 2e-2 of one eager process under the same
    autocast (bfloat16 rounding in another order: 1.1e-2 measured; float32 TP: 1e-5), and the
    losses within 2e-3 of float32's (3e-4 measured)."""
    bf16, fp32 = run_tp(tmp_root, **BF16), run_tp(tmp_root)
    assert bf16["error"] is None, bf16["error"]
    assert (bf16["graphs"], bf16["recompiles"]) == (1, 0), bf16["recompile_reasons"]
    assert bf16["matmul_dtypes"] == ["torch.bfloat16"], bf16["matmul_dtypes"]
    assert bf16["forward_dtypes"] == ["torch.float32"] and bf16["logits_dtypes"] == ["torch.bfloat16"]
    assert_every_gradient_matches(bf16, run_one(**BF16), rel=2e-2)
    assert bf16["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
    assert bf16["losses"] != pytest.approx(fp32["losses"], abs=1e-5), "the same losses as float32"


def test_bfloat16_policy_computes_in_bfloat16_and_reduces_in_the_reduce_dtype(tmp_root):
    """dp_shard 2 x tp 2 with bfloat16 params, float32 reduce: inside forward lm_head's weight
    is bfloat16 (FSDP's unsharded copy), and the gradients FSDP reduce-scatters are float32,
    although backward computed them in bfloat16 (FSDP's default reduce dtype). Every step-1
    gradient is within 3e-2 of the float32 run's, none within 1e-3 (4.3e-3 to 1.2e-2 measured)."""
    bf16 = run_2d(tmp_root, **BF16)
    fp32 = run_2d(tmp_root)
    assert bf16["error"] is None, bf16["error"]
    assert (bf16["graphs"], bf16["recompiles"]) == (1, 0), bf16["recompile_reasons"]
    differences = gradient_differences(bf16["grads"], fp32["grads"])
    assert max(differences.values()) <= 3e-2 and min(differences.values()) > 1e-3, differences
    assert bf16["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
    assert bf16["forward_dtypes"] == ["torch.bfloat16"] and fp32["forward_dtypes"] == ["torch.float32"]
    assert bf16["reduce_scatter_dtypes"] == ["torch.float32"], bf16["reduce_scatter_dtypes"]


# fail_on_recompile stops the run ---------------------------------------------------

HALF_LENGTH_AFTER_STEP_ONE = """
import sys
sys.path.insert(0, {here!r})
import data
import train

full_length = data.random_windows

def batches(data, batch_size, seq_len, *args):
    it = full_length(data, batch_size, seq_len, *args)
    yield next(it)
    yield from full_length(data, batch_size, seq_len // 2, *args)  # a new shape from step 2 (32 per TP rank: 16)

data.random_windows = batches
train.exit_without_finalizing(train.main)
"""


def test_fail_on_recompile_stops_the_run_with_dynamos_reason(tmp_path):
    script = tmp_path / "half_length.py"
    script.write_text(textwrap.dedent(HALF_LENGTH_AFTER_STEP_ONE.format(here=str(HERE))))
    cmd = _torchrun_cmd("--training.steps", "4", "--model.num_hidden_layers", "2", "--training.seq_len", "64",
                        "--training.local_batch_size", "2", "--data.max_bytes", "1000000",
                        "--metrics.measure_cpu_peak", "false", script=script)
    proc = again_if_a_rank_died_of_a_signal(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                                                   env=dict(os.environ, OMP_NUM_THREADS="1")))
    assert proc.returncode != 0
    assert "step   1 | loss" in proc.stdout and "step   2" not in proc.stdout, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: step 2 recompiled")]
    assert len(errors) == 1 and "size mismatch at index 1. expected 32, actual 16" in errors[0], proc.stderr[-3000:]
    ranks_output = proc.stderr.split("failed (exitcode")[0]  # torchrun's own report follows
    assert "Traceback" not in ranks_output, ranks_output[-3000:]


# a non-finite loss stops the run at its step; selective_ac_option = 2; no held-out loss ----

NAN_FROM_STEP_THREE = """
import sys
sys.path.insert(0, {here!r})
import train

real_step, calls = train.train_step, []

def train_step(*args, **kwargs):
    loss, grad_norm = real_step(*args, **kwargs)
    calls.append(loss)
    return (float("nan") if len(calls) >= 3 else loss), grad_norm

train.train_step = train_step
train.exit_without_finalizing(train.main)
"""

QUICK = ("--model.num_hidden_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--data.max_bytes", "1000000", "--compile.enable", "false", "--metrics.measure_cpu_peak", "false")


def test_non_finite_loss_stops_at_its_step_and_keeps_the_last_checkpoint(tmp_path):
    script = tmp_path / "nan.py"
    script.write_text(textwrap.dedent(NAN_FROM_STEP_THREE.format(here=str(HERE))))
    folder = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), *QUICK, "--training.steps", "6", "--checkpoint.enable", "true",
                           "--checkpoint.folder", str(folder), "--checkpoint.interval", "1"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: step 3: the loss is nan; check optimizer.lr, training.max_norm and [model]; "
        f"the last complete checkpoint stays in {folder}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "step   4" not in proc.stdout and "summary" not in proc.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2"]


NAN_GRADIENT_AT_STEP_THREE = """
import sys
sys.path.insert(0, {here!r})
from torch.optim.optimizer import register_optimizer_step_pre_hook
import train

real_clip, calls = train.clip_grad_norm_, []

def clip_grad_norm_(parameters, max_norm):
    parameters = list(parameters)
    calls.append(1)
    if len(calls) == 3:  # a finite loss, one non-finite gradient element
        parameters[0].grad[0, 0] = float("nan")
    return real_clip(parameters, max_norm)

register_optimizer_step_pre_hook(lambda *_: print("optimizer step", flush=True))
train.clip_grad_norm_ = clip_grad_norm_
train.exit_without_finalizing(train.main)
"""


def test_non_finite_gradient_stops_before_the_update_and_the_save_and_keeps_the_last_checkpoint(tmp_path):
    """A NaN in one gradient at a saving step, the loss finite: no optimizer step and no save at
    that step; the step before stays complete and is not pruned (keep_latest_k = 1)."""
    from checkpoint import checkpoint_state

    script = tmp_path / "nan_gradient.py"
    script.write_text(textwrap.dedent(NAN_GRADIENT_AT_STEP_THREE.format(here=str(HERE))))
    folder = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), *QUICK, "--training.steps", "6", "--checkpoint.enable", "true",
                           "--checkpoint.folder", str(folder), "--checkpoint.interval", "1",
                           "--checkpoint.keep_latest_k", "1"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: step 3: the gradient norm is nan, not applied; check optimizer.lr, training.max_norm and [model]; "
        f"the last complete checkpoint stays in {folder}"), proc.stderr[-3000:]
    assert proc.stdout.count("optimizer step") == 2 and "step   3" not in proc.stdout, proc.stdout
    assert [p.name for p in folder.iterdir()] == ["step-2"] and checkpoint_state(folder / "step-2") == "complete"


def test_one_process_in_bfloat16_with_every_second_block_checkpointed_and_no_eval():
    """`python train.py` in bfloat16 (autocast: one process has no FSDP) names that dtype in its
    set-up line and its MFU line; selective_ac_option "2" as an int; no held-out loss without eval."""
    proc = subprocess.run([sys.executable, str(HERE / "train.py"), *QUICK, "--training.steps", "3",
                           "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                           "2", "--validation.steps", "0", "--training.mixed_precision_param", "bfloat16",
                           "--metrics.measure_cpu_peak", "true"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [loss_line] = [line for line in proc.stdout.splitlines() if line.startswith("  loss ")]
    assert "->" in loss_line and "held-out" not in loss_line, loss_line
    assert "AC=selective" in proc.stdout and "compute bfloat16 by autocast, reduce float32" in proc.stdout
    assert re.search(r"MFU \d+% of a measured 1 x \d+ GFLOP/s CPU bfloat16 matmul peak", proc.stdout), proc.stdout


# a GPU host: train.py on one GPU (conftest: only `gpu` tests see it) -------------------------

TINY = ("--model.num_hidden_layers", "2", "--model.hidden_size", "64", "--model.intermediate_size", "128",
        "--model.vocab_size", "256", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", "4", "--data.max_bytes", "1000000", "--validation.steps", "1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, peak", [("float32", "TF32 matmul peak"), ("bfloat16", "bfloat16 (torchtitan's table)")])
def test_one_gpu_trains_with_one_graph_mfu_in_its_dtype_and_peak_memory_without_the_probe(dtype, peak):
    """One process on the host's GPU 0: 1 graph, 0 recompiles, the MFU line against the peak of the
    dtype the matmuls run in (float32 under the default "high" precision: TF32), and a peak that
    leaves out the float32 probe (its 4096² matrix and product: 128 MiB; this model, its AdamW state
    and cuBLAS's workspace take far less)."""
    proc = subprocess.run([sys.executable, str(HERE / "train.py"), *TINY, "--training.mixed_precision_param", dtype],
                          capture_output=True, text=True, timeout=600, env=GPU_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "1 rank(s) on cuda" in out and "compiled graphs      1 for 2 blocks" in out, out
    assert "recompiles           0" in out, out
    mfu = re.search(r"MFU (\d+)% of (.*)", out)
    assert mfu and int(mfu[1]) <= 100 and peak in mfu[2], out
    [memory] = re.findall(r"peak memory per rank (\d+) MiB \(max allocated\)", out)
    assert int(memory) < 100, f"{memory} MiB: the MFU probe counted"


@pytest.mark.parametrize("gpu, source", [("NVIDIA H200", "1 x NVIDIA H200's 989 TFLOP/s bfloat16 (torchtitan's table)"),
                                         ("NVIDIA A100-SXM4-80GB", "1 x NVIDIA A100-SXM4-80GB's 312 TFLOP/s bfloat16"),
                                         ("NVIDIA L4", "a measured 1 x 100 TFLOP/s NVIDIA L4 bfloat16 matmul peak")])
def test_bfloat16_mfu_on_a_gpu_torchtitans_table_lacks_is_against_a_measured_peak(monkeypatch, gpu, source):
    """report.peak_flops' choice on a GPU, on this CPU host: torchtitan's bf16 table where it lists the
    GPU; for another it returns its A100 figure (312e12), so the bfloat16 matmul is timed instead (the
    timer, the CUDA calls and torchtitan's get_peak_flops stubbed; the timed peak: 100 TFLOP/s)."""
    import torch
    import torch.utils.benchmark

    import report
    from config import load_config

    table = {"NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}
    monkeypatch.setattr(report, "get_peak_flops", lambda name: table.get(name, 312e12))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: gpu)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device, dtype: randn(*shape, dtype=dtype))
    class Timer:  # torch's Timer, at 100 TFLOP/s for a 4096² matmul
        def __init__(self, *args, **kwargs):
            pass

        def blocked_autorange(self, min_run_time):
            return types.SimpleNamespace(median=2 * 4096**3 / 100e12)
    monkeypatch.setattr(torch.utils.benchmark, "Timer", Timer)
    cfg = load_config(str(HERE / "config.toml"), 1, {"training.mixed_precision_param": "bfloat16"})
    peak, text = report.peak_flops(torch.device("cuda", 0), cfg)
    assert source in text, text
    assert peak == pytest.approx(table.get(gpu, 100e12))
