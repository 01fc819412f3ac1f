"""Whether each library workaround in workarounds.py is still needed on the installed torch:
each test shows what happens without one, and fails once the library no longer needs it. Two
more: test_caches.py (keep_device_mesh_hash_out_of_pickles) and test_readme.py (the embedding's
clone, materialize_embedding_output). RESULTS.md has them by torch version.
"""

import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims
import torchtitan.tools.utils
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.config.job_config import ActivationCheckpoint as ACConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

import parallelize
import workarounds
from conftest import HERE, _torchrun_cmd, free_port, small_config
from model import build_model, forward_logits


@contextlib.contextmanager
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine torchtitan's default device is right")
def test_without_the_device_type_workaround_torchtitan_builds_a_cuda_mesh_on_a_cpu_machine(monkeypatch):
    """workarounds.set_titan_mesh_device_type (torchtitan 0.2.2): its ParallelDims builds on the
    module-level device_type, "cuda" without a GPU: building the mesh or its first DTensor fails."""
    def first_dtensor():
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        dims.build_mesh()
        return distribute_tensor(torch.ones(2), dims.world_mesh)

    monkeypatch.setattr(torchtitan.distributed.parallel_dims, "device_type", torchtitan.tools.utils.device_type)
    with one_rank_group():
        # torch 2.10.0: ZeroDivisionError in init_device_mesh; from 2.11.0: "Found no NVIDIA driver"
        with pytest.raises((RuntimeError, ZeroDivisionError)):
            first_dtensor()
        workarounds.set_titan_mesh_device_type("cpu")
        assert first_dtensor().device.type == "cpu"


SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _sdpa_calls_with_op_sac(save_list: set) -> int:
    """CPU SDPA kernel calls in one eager forward + backward of a 2-block model under op-level SAC."""
    calls = []

    class CountSDPA(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is SDPA_CPU:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(small_config(**{"model.num_hidden_layers": 2})["model"])
    titan_apply_ac(model.model, ACConfig(mode="selective", selective_ac_option="op"), model_compile_enabled=False,
                   op_sac_save_list=save_list)
    with CountSDPA():
        forward_logits(model, torch.randint(0, 256, (2, 64))).float().pow(2).mean().backward()
    return len(calls)


def test_without_the_cpu_sdpa_op_selective_ac_runs_attention_again_in_backward():
    """workarounds.OP_SAC_SAVE_LIST (torchtitan 0.2.2): its save list names only the CUDA SDPA
    kernels, so on CPU op-level SAC recomputes attention in backward."""
    assert _sdpa_calls_with_op_sac(workarounds.OP_SAC_SAVE_LIST) == 2, "one forward call per block, kept"
    assert _sdpa_calls_with_op_sac(_op_sac_save_list) == 4, "each block's attention runs again in backward"


def test_without_the_filter_fsdp_warns_that_replicated_logits_are_a_view(monkeypatch):
    """workarounds.silence_fsdp_view_output_warning (torch 2.14.1, 2.15.0): with loss parallel
    off, TP's all-gathered logits are a view, and FSDP2 warns on every rank at every step. A
    (1, 1) mesh on one process is enough to see it."""
    from torch.distributed.device_mesh import init_device_mesh

    silence = workarounds.silence_fsdp_view_output_warning
    monkeypatch.setattr(workarounds, "silence_fsdp_view_output_warning", lambda: None)
    with one_rank_group(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # filters go back as they were on leaving
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = build_model(small_config(**{"model.num_hidden_layers": 1})["model"])
        parallelize.apply_tp(model, mesh["tp"], "positional", "pre_hook", loss_parallel=False)
        parallelize.apply_fsdp(model, mesh["dp"], "float32", "float32")

        def view_warnings() -> list[str]:
            caught.clear()
            forward_logits(model, torch.randint(0, 256, (2, 64))).sum().backward()
            return [str(w.message).split(" returned")[0] for w in caught if "returned a view tensor" in str(w.message)]

        assert view_warnings() == ["FSDP2-wrapped module (FSDPLlamaRMSNorm, FSDPLinear)",
                                   "FSDP2-wrapped module (FSDPLlamaForCausalLM)"]
        silence()
        assert view_warnings() == []


RESTARTED_GROUP = """
import os, signal, time
import torch.distributed as dist

store, rank, _ = next(dist.rendezvous("env://"))  # the store that init_process_group meets first
keys = ["left by the first attempt, rank 0", "left by the first attempt, rank 1"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    store.set(keys[rank], "1")
    store.wait(keys)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # torchrun stops rank 0 and starts both again
    time.sleep(60)
line = f"rank {rank} after a restart finds the first attempt's keys: {store.check(keys)}\\n"
os.write(1, line.encode())  # one write: print's text and newline may reach the shared pipe apart
"""


def test_without_the_restart_store_a_restarted_group_meets_the_failed_attempts_keys(tmp_path):
    """workarounds.store_for_this_restart (torch 2.10.0, 2.15.0): torchrun --max-restarts starts the
    group again in the agent's TCPStore, where the failed attempt's keys are still there: gloo
    may then read the dead ranks' addresses (RESULTS.md: 3 of 6 restarts refused, 1 hung). With
    the workaround: test_a_killed_rank_restarts_by_itself_with_the_uninterrupted_numbers."""
    script = tmp_path / "restarted_group.py"
    script.write_text(RESTARTED_GROUP)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1", "--nproc_per_node",
                           "2", f"--master_port={free_port()}", str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(line for line in proc.stdout.splitlines() if "after a restart" in line)
    assert found == [f"rank {r} after a restart finds the first attempt's keys: True" for r in (0, 1)], (
        f"{found}: a restart meets a store of its own, and the workaround may go")


def _timeouts_main(rank: int, port: int, out: str) -> None:
    import datetime
    import json
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))  # tp: the world group
    groups = {"world": dist.distributed_c10d._get_default_group(), "dp_shard": mesh.get_group("dp_shard")}
    timeout = lambda group: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: E731
    before = {name: timeout(group) for name, group in groups.items()}
    workarounds.set_comm_timeout(7)
    if rank == 0:
        Path(out).write_text(json.dumps({"before": before, "after": {n: timeout(g) for n, g in groups.items()}}))
    dist.destroy_process_group()


def test_without_the_timeout_workaround_a_device_mesh_subgroup_keeps_gloos_default(tmp_path):
    """init_process_group's timeout reaches the world group only: a DeviceMesh subgroup keeps gloo's
    30 minutes, so set_comm_timeout sets every group this rank is in."""
    import json

    from conftest import spawn

    out = tmp_path / "timeouts.json"
    spawn(_timeouts_main, lambda port: (port, str(out)), 2, "timeouts")
    found = json.loads(out.read_text())
    assert found["before"] == {"world": 60, "dp_shard": 1800}, "subgroups take init_process_group's timeout now"
    assert found["after"] == {"world": 7, "dp_shard": 7}


GROUP_KEPT_AT_EXIT = """
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import workarounds

KEPT = []  # as a DeviceMesh in DTensor's caches keeps its groups past destroy_process_group


def main():
    dist.init_process_group("gloo")
    group = init_device_mesh("cpu", (2,)).get_group()
    for _ in range(50):  # in flight at the exit: only the gloo workers hold their tensors
        dist.all_gather([torch.ones(1 << 16) for _ in range(2)], torch.ones(1 << 16), group=group, async_op=True)
    KEPT.append(group)
    dist.destroy_process_group()


if sys.argv[1] == "with":
    workarounds.exit_without_finalizing(main)
else:
    main()
"""


def test_without_the_exit_workaround_a_gloo_worker_aborts_a_finalizing_rank(tmp_path):
    """workarounds.exit_without_finalizing (torch 2.10.0, 2.15.0; pytorch/pytorch#190489): a gloo worker
    that drops a collective's tensors while Python finalizes takes the GIL and dies in std::terminate.
    Collectives in flight at the exit make the race likely (measured: 16 of 16 launches aborted)."""
    script = tmp_path / "group_kept_at_exit.py"
    script.write_text(GROUP_KEPT_AT_EXIT)

    def launch(how: str) -> subprocess.CompletedProcess:
        return subprocess.run(_torchrun_cmd(how, script=script), capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE)))
    for _ in range(3):
        without = launch("without")
        if "terminate called without an active exception" in without.stderr:
            break
    assert without.returncode != 0 and "terminate called without an active exception" in without.stderr, (
        f"3 launches finalized cleanly: the workaround may go\n{without.stderr[-2000:]}")
    with_it = launch("with")
    assert with_it.returncode == 0, with_it.stderr[-3000:]
