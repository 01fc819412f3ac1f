"""Library workarounds: one named function each, with the versions it was measured on, its upstream
link where one is known, and a test that says when it can go (test_workarounds.py, test_caches.py,
test_readme.py; RESULTS.md, "Library workarounds by torch version").
"""

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torchtitan.distributed.parallel_dims
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.torch_version import TorchVersion
from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip_grad_norm_
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list


def keep_device_mesh_hash_out_of_pickles() -> None:
    """Workaround, torch 2.14.1 and 2.15.0 (on 2.10.0 and 2.11.0 TP graphs miss or bypass AOTAutograd's
    cache either way): its key pickles the TP `DeviceMesh`, whose state keeps `_hash`, a per-process
    `hash()`, so every TP restart missed. Unpickled meshes recompute it; the key keeps the rank. No
    upstream issue found; related: pytorch/pytorch#173526, #188390 (fixed by #188401). test_caches.py
    says when to drop it."""
    original = DeviceMesh.__getstate__
    if getattr(original, "keeps_hash_out", False):
        return

    def __getstate__(self) -> dict:
        state = original(self)
        state.pop("_hash", None)
        return state

    __getstate__.keeps_hash_out = True
    DeviceMesh.__getstate__ = __getstate__


def set_titan_mesh_device_type(device_type: str) -> None:
    """Workaround, torchtitan 0.2.2 on torch 2.10.0 to 2.15.0: `ParallelDims.build_mesh` uses the
    module-level `torchtitan.tools.utils.device_type`, "cuda" on a machine without a GPU."""
    torchtitan.distributed.parallel_dims.device_type = device_type


def materialize_embedding_output(embedding: nn.Module) -> None:
    """Workaround, every torch measured (2.10.0, 2.11.0, 2.14.1, 2.15.0): the TP embedding's output
    is an `AsyncCollectiveTensor`; fed to block 0 it costs one extra graph, and from 2.14.1 AOTAutograd's
    backward fails (`'Tensor' object has no attribute '_local_tensor'`). A clone waits for it and
    hands every block a plain tensor. test_readme.py says when to drop it."""
    embedding.register_forward_hook(lambda _module, _inputs, output: output.clone())


# Workaround, torchtitan 0.2.2 on torch 2.10.0 to 2.15.0: its op-level selective-AC save list names
# only the CUDA SDPA kernels, so attention ran again in backward on CPU (test_workarounds.py).
OP_SAC_SAVE_LIST = _op_sac_save_list | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def silence_fsdp_view_output_warning() -> None:
    """Workaround, torch 2.14.1 and 2.15.0 (2.10.0 and 2.11.0 have no such warning): with loss parallel
    off, FSDP2 warns on every rank and step that a module returned a view (an in-place op on it would
    skip a hook). The views are TP's all-gathered logits, which only the loss reads."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


# Measured (test_readme.py -k clip_workaround): wrong on torch 2.10.0 and 2.11.0, right on 2.12.0-2.15.0.
FOREACH_SCALES_PARTIAL_GRADIENTS = TorchVersion(torch.__version__) >= (2, 12)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Workaround, torch 2.10.0 and 2.11.0: torchtitan's clip_grad_norm_ scales gradients with
    `torch._foreach_mul_`, which leaves a `Partial(sum)` DTensor unscaled in silence: the
    SequenceParallel norms' weight gradients. One `mul_` per gradient scales it. No upstream issue
    found; related: pytorch/pytorch#170025. test_readme.py says when to drop it."""
    return titan_clip_grad_norm_(parameters, max_norm, foreach=None if FOREACH_SCALES_PARTIAL_GRADIENTS else False)


def store_for_this_restart(launch) -> dict:
    """Workaround, torch 2.10.0 and 2.15.0 (pytorch/pytorch#167288): after a `torchrun --max-restarts`
    restart, init_process_group's arguments for a store under a prefix of its own. The new group
    meets in the agent's TCPStore, which keeps the failed attempt's keys, so its ranks may read the
    dead ones' addresses (gloo: `connectFullMesh failed ... Connection refused`; nccl exchanges its
    unique id through the same store). One node only (`launch`: train.Launch), where every rank has
    one TORCHELASTIC_RESTART_COUNT; several nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (several_nodes_restart_problem)."""
    env, restart = os.environ, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or launch.world_size != launch.local_world_size:
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch.world_size, is_master=False,
                          timeout=default_pg_timeout)  # the process group's, not the store's 5 minutes
    return {"store": dist.PrefixStore(f"restart-{restart}", store), "rank": launch.rank, "world_size": launch.world_size}


def several_nodes_restart_problem(launch) -> str | None:
    """The line that stops a job that would hang: with `--max-restarts` on several nodes, an agent
    whose ranks were healthy restarts them without advancing TORCHELASTIC_RESTART_COUNT, so no
    prefix is one for every rank, and the group meets the failed attempt's keys in the shared store
    (measured: no progress for 8 minutes, nothing printed). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    gives every rendezvous round a new store."""
    env = os.environ
    if (int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and launch.world_size != launch.local_world_size):
        return ("torchrun --max-restarts on several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node: "
                "a restarted group would meet the failed one's keys in the agents' shared store and hang")
    return None


def set_comm_timeout(seconds: int) -> None:
    """Workaround, torch 2.10.0 and 2.15.0 (measured on both): the timeout of every process group this
    rank is in. torch lists them only privately, and DeviceMesh's subgroups keep the backend's default
    (gloo 30 min), not init_process_group's. torch 2.15.0 has `dist.set_timeout` (pytorch/pytorch#187387);
    2.10.0 only `_set_pg_timeout`, which 2.15.0 deprecates."""
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        set_timeout(timedelta(seconds=seconds), group)


def exit_without_finalizing(main) -> None:
    """Workaround, torch 2.10.0 and 2.15.0 (measured on both): `main()`, then its exit code by os._exit,
    the output flushed, skipping Python's finalization. A cached DeviceMesh keeps its gloo groups past
    destroy_process_group; a gloo worker that drops a finished collective's tensors while Python
    finalizes takes the GIL and dies in std::terminate: SIGABRT, "terminate called without an active
    exception" (pytorch/pytorch#190489). An exception still finalizes, after its traceback."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if not isinstance(e.code, (int, type(None))):
            raise
        code = e.code or 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
