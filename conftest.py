"""Shared by the tests: harness.py's training on gloo ranks, cached; torchrun launches; the
`recompile_proof` and `gpu` markers.

On any host, GPUs or none, every test runs on CPU and gloo: CUDA is hidden from this process and
from every process it launches (torchrun, mp.spawn, bench.py), before torch is imported. Only the
tests marked `gpu` launch train.py with the host's GPUs (GPU_ENV); without a GPU they skip.

Multi-rank cases run gloo ranks on CPU (torch.multiprocessing.spawn): 2 for TP, 4 for
dp_shard 2 x tp 2, through the real builders: parallelize.build_parallel_dims, train.build_training
(model.py + parallelize.py) and train.train_step. Compile counts are read from Dynamo itself
(report.dynamo_compile_counts). A test file's RUNS_TOGETHER run one after another on the same ranks.
"""

import faulthandler
import functools
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

GPU_ENV = dict(os.environ)  # the host's CUDA_VISIBLE_DEVICES, for the `gpu` tests' launches
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: no test process sees a GPU

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

import parallelize
from harness import (HERE, NUM_BLOCKS, STEPS, forget_the_last_model, free_port, gradient_differences, join_gloo,  # noqa: F401 (the tests import them here)
                     run_training, small_config)
from workarounds import exit_without_finalizing


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "recompile_proof: proves the fix where the bug lives; CI also runs these on torch 2.10.0")
    config.addinivalue_line("markers", "gpu: launches train.py on the host's GPU; skipped on a host without one")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip where torch, asked in a process that sees the host's GPUs, counts none."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if gpu_tests and host_gpus() == 0:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="no GPU on this host"))


def host_gpus() -> int:
    count = [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"]
    return int(subprocess.run(count, env=GPU_ENV, capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory) -> str:
    """One folder for the cached runs, shared by every test file."""
    return str(tmp_path_factory.mktemp("runs"))


TP = 2
DP_SHARD = 2
def torch_version() -> tuple[int, int]:
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


# Measured with these tests on CPU, 2 ranks (RESULTS.md, "Which torch versions have the bug"):
# 2.10 recompiles per block; 2.11 carries the Dynamo fix (pytorch/pytorch#172519).
HOOK_GUARD_BUG = torch_version() < (2, 11)

os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # every launched rank prints its stacks on a fatal signal


def _rank_main(rank: int, world_size: int, port: int, runs: list, float64: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints every thread's Python stack
    torch.set_num_threads(1)
    if float64:  # the model in float64, and FSDP's policy keeps it (its float32 one would cast)
        torch.set_default_dtype(torch.float64)
        parallelize.MixedPrecisionPolicy = lambda **_: MixedPrecisionPolicy()
    dist.init_process_group("gloo")
    for cfg, out, arch, window in runs:
        forget_the_last_model()
        result = run_training(cfg, world_size, arch=arch, window=window, grads_path=out + ".grads.pt")
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


_reports = {}  # run_ranks' cache: rank 0's report by (tmp_root, world_size, float64, arch, window, overrides)


def run_ranks(tmp_root: str, world_size: int, arch: str = "llama", float64: bool = False, window: int | None = None,
              **overrides) -> dict:
    """run_training on `world_size` gloo ranks with `small_config(**overrides)`, rank 0's report
    (cached); its "grads" names the file of every parameter's step-1 gradient."""
    run_together(tmp_root, world_size, [(arch, window, overrides)], float64)
    return _reports[_report_key(tmp_root, world_size, float64, arch, window, overrides)]


def _report_key(tmp_root: str, world_size: int, float64: bool, arch: str, window: int | None, overrides: dict) -> tuple:
    return tmp_root, world_size, float64, arch, window, tuple(sorted(overrides.items()))


def run_together(tmp_root: str, world_size: int, runs: list[tuple[str, int | None, dict]], float64: bool = False) -> None:
    """Each (arch, window, overrides) of `runs` that run_ranks has not run yet, one after another on
    the same `world_size` gloo ranks (a spawn costs a 2-rank run ~10 s), into run_ranks' cache."""
    keys = {_report_key(tmp_root, world_size, float64, *run): run for run in runs}
    todo = {key: run for key, run in keys.items() if key not in _reports}
    if not todo:
        return
    outs = {key: str(Path(tmp_root) / f"run-{abs(hash(key))}.json") for key in todo}
    jobs = [(small_config(**overrides), outs[key], arch, window) for key, (arch, window, overrides) in todo.items()]
    spawn(_rank_main, lambda port: (world_size, port, jobs, float64), world_size,
          f"{len(jobs)} run(s) on {world_size} ranks: {list(todo.values())}")
    for key, out in outs.items():
        _reports[key] = {**json.loads(Path(out).read_text()), "grads": out + ".grads.pt"}


@pytest.fixture(scope="module", autouse=True)
def _a_files_runs_together(request, tmp_root):
    """A test file's RUNS_TOGETHER, {world_size: [(arch, window, overrides), ...]}, before its first
    test: run_together, so that its tests' run_ranks calls find them cached. Not where no test
    selected from the file takes tmp_root (`pytest -k`): those launch no ranks of run_ranks'."""
    selected = [item.function for item in request.session.items if item.module is request.module]
    if any("tmp_root" in inspect.signature(test).parameters for test in selected):
        for world_size, runs in getattr(request.module, "RUNS_TOGETHER", {}).items():
            run_together(tmp_root, world_size, runs)


ATTEMPTS = 3  # launches of one test's ranks when one dies of a signal (spawn, again_if_a_rank_died_of_a_signal)


def spawn(main, args_for_port, nprocs: int, what: str) -> None:
    """mp.spawn(main, args_for_port(a free port), nprocs), run again (at most twice, with a warning)
    when a rank is killed by a signal with no Python error: the rare heap corruption gloo ranks
    still die of (RESULTS.md, faults). Each rank ends as train.py does (_then_exit). A Python error
    in any rank fails the test."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            mp.spawn(_then_exit, args=(main, *args_for_port(free_port())), nprocs=nprocs)
            return
        except mp.ProcessExitedException as e:
            if e.signal_name is None or attempt == ATTEMPTS:
                raise
            warnings.warn(f"{what}: {e}; running it again (attempt {attempt + 1} of {ATTEMPTS})")


def _then_exit(rank: int, main, *args) -> None:
    """A spawned rank: `main(rank, *args)`, then its exit as train.py's (workarounds.exit_without_finalizing)."""
    exit_without_finalizing(lambda: main(rank, *args))


def run_tp(tmp_root: str, arch: str = "llama", window: int | None = None, **overrides) -> dict:
    """TP over 2 ranks."""
    return run_ranks(tmp_root, TP, arch, window=window, **overrides)


def run_2d(tmp_root: str, **overrides) -> dict:
    """dp_shard 2 x tp 2 over 4 ranks (TP innermost: ranks {0, 1} and {2, 3} are TP groups)."""
    return run_ranks(tmp_root, DP_SHARD * TP, **{"parallelism.dp_shard": DP_SHARD, **overrides})



def _torchrun_cmd(*train_args: str, launcher: tuple[str, ...] = (), script: Path = HERE / "train.py") -> list[str]:
    """torchrun of `script` (train.py, or a test's patched copy), on 2 ranks unless `launcher` says otherwise."""
    launcher = launcher or (f"--nproc_per_node={TP}", f"--master_port={free_port()}")
    return [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), *train_args]


def _torchrun(*train_args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return again_if_a_rank_died_of_a_signal(lambda: subprocess.run(
        _torchrun_cmd(*train_args, launcher=launcher), capture_output=True, text=True, env=env, timeout=600))


ROOT_CAUSE_SIGNAL = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*-(\d+)", re.S)


def again_if_a_rank_died_of_a_signal(launch, fresh_each_time: bool = False) -> subprocess.CompletedProcess:
    """run_ranks' rule for torchrun: `launch()` again (at most twice, with a warning) while
    torchrun's first failing rank was killed by a signal (its report's "exitcode : -6") before
    any checkpoint was saved, or after one where `launch` empties its checkpoint folder first
    (`fresh_each_time`): a rerun then starts the same. The heap corruption's cause is unknown
    (RESULTS.md, faults): what each dead rank printed (faulthandler's stacks, PYTHONFAULTHANDLER)
    goes into the warning and, when every attempt died, at the end of the returned stdout."""
    died_before = []
    for attempt in range(1, ATTEMPTS + 1):
        proc = launch()
        out = proc.stdout + (proc.stderr or "")
        died = ROOT_CAUSE_SIGNAL.search(out)
        if proc.returncode == 0 or not died or ("checkpoint: saved" in out and not fresh_each_time):
            return proc
        evidence = [line for line in out.splitlines()
                    if re.search(r"terminate|malloc|free\(\)|corrupt|Fatal Python|[Tt]hread 0x|  File ", line)]
        died_before.append(f"attempt {attempt}: a rank died of {signal.Signals(int(died.group(1))).name}. "
                           "It printed:\n" + "\n".join(evidence[:60]))
        if attempt < ATTEMPTS:
            warnings.warn(died_before[-1] + "\nrunning it again")
    proc.stdout += "\n\n" + "\n\n".join(died_before)
    return proc


def _killed_after_save(step: int, *train_args: str) -> int:
    """torchrun of train.py, every process of it killed by SIGKILL once rank 0 logs that `step` is saved: its
    return code (-9 when killed then)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with subprocess.Popen(_torchrun_cmd(*train_args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=env, start_new_session=True) as proc:
        for line in proc.stdout:
            if f"checkpoint: saved step {step}" in line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    return proc.returncode


def _config_error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("config error:")]


def _losses(out: str) -> list[float]:
    return [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines()
            if line.startswith("step ") and "| loss " in line]  # not the "validation: step N | loss" lines



@functools.cache
def run_one(arch: str = "llama", window: int | None = None, float64: bool = False, **overrides) -> dict:
    """run_training on this process, eager (one process: no TP, no compile), cached; its "grads"
    names the file of every parameter's step-1 gradient."""
    grads = str(Path(tempfile.mkdtemp(prefix="one-process-")) / "grads.pt")
    torch.set_default_dtype(torch.float64 if float64 else torch.float32)
    try:
        cfg = small_config(**{"compile.enable": False, "parallelism.tp": 1, **overrides})
        return {**run_training(cfg, world_size=1, arch=arch, window=window, grads_path=grads), "grads": grads}
    finally:
        torch.set_default_dtype(torch.float32)


def assert_every_gradient_matches(run: dict, single: dict, rel: float = 1e-4) -> None:
    """Every parameter's step-1 gradient (L2, relative) against one process: a wrong norm weight
    hides in the total norm."""
    differences = gradient_differences(run["grads"], single["grads"])
    worst = max(differences, key=differences.get)
    assert differences[worst] <= rel, f"{worst}'s step-1 gradient is {differences[worst]:.1e} off one process"


GLOBAL_BATCH = {"training.local_batch_size": 2 * DP_SHARD}  # small_config's local batch is 2
