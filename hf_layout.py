"""Weights whose rows are parts (a fused [gate; up] or MHA's [q; k; v], Gated DeltaNet's [q; k; v] by heads) held
by RowsByParts, each rank's share of every part side by side: DTensor's global order is then the ranks', not HF's.
in_hf_layout gives HF's order, as Shard rows, to DCP, the load and the export, and in_plan_layout takes it back,
each by one all-to-all in TP's group: no rank holds more than its rows. Beside family_plan.py and hybrid_plan.py,
which use it; what a checkpointing trainer needs of them."""

import math
import re

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils._pytree import tree_map_with_path


class RowsByParts(ColwiseParallel):
    """Column-wise TP for a weight whose rows are `parts` (their sizes; Gated DeltaNet's v another size): rank r
    holds the r-th 1/TP of each part, side by side, as Shard(0) rows of the weight in rank order (`by_rank`), so
    that its output is the r-th 1/TP of each part, which the module splits. Also the depthwise conv1d's weight."""

    def __init__(self, parts: tuple):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for key, param in list(module.named_parameters(recurse=False)):
            rows = by_rank(param.detach(), self.parts, device_mesh.size())
            module.register_parameter(key, nn.Parameter(distribute_tensor(rows, device_mesh, [Shard(0)])))
            getattr(module, key).rows_by_parts = self.parts  # FSDP shards another dim (family_plan.fsdp_shard_placement)
        module.rows_by_parts = self.parts  # which in_hf_layout reorders

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)
        return distribute_module(module, device_mesh, self._partition_linear_fn)  # conv1d: HF's forward reads its weight


def by_rank(rows: torch.Tensor, parts: tuple, tp: int) -> torch.Tensor:
    """HF's rows [a; b; ...] as [a_0; b_0; ...; a_1; b_1; ...]: each part's r-th 1/tp, rank by rank."""
    pieces = [part.chunk(tp) for part in rows.split(parts)]
    return torch.cat([piece[r] for r in range(tp) for piece in pieces])


def in_hf_layout(state, model):
    """`state` (`model`'s or its optimizer's state dict, or a tuple of them: by parameter name) with every
    RowsByParts weight in HF's order, a copy; every other value as it is."""
    parts = rows_by_parts(model)
    return tree_map_with_path(lambda path, value: rows_reordered(value, parts[name], to_hf=True)
                              if (name := named(path, parts)) else value, state)


def in_plan_layout(state, model):
    """`state`, loaded in HF's layout (in_hf_layout's), in `model`'s own."""
    parts = rows_by_parts(model)
    return tree_map_with_path(lambda path, value: rows_reordered(value, parts[name], to_hf=False)
                              if (name := named(path, parts)) else value, state)


def rows_by_parts(model: nn.Module) -> dict[str, tuple]:
    """{parameter name, as a state dict names it: its parts} of `model`'s RowsByParts weights."""
    return {state_dict_name(f"{name}.{key}"): module.rows_by_parts for name, module in model.named_modules()
            if hasattr(module, "rows_by_parts") for key, _ in module.named_parameters(recurse=False)}


def state_dict_name(name: str) -> str:
    """A parameter's name without compile's and AC's wrapper prefixes, as state dicts name it."""
    return re.sub(r"(_orig_mod|_checkpoint_wrapped_module)\.", "", name)


def named(path, names: dict) -> str | None:
    """The parameter name on a state dict's path (an optimizer's: "state", name, "exp_avg") among `names`."""
    return next((key.key for key in path if getattr(key, "key", None) in names), None)


def rows_reordered(value, parts: tuple, to_hf: bool):
    """A RowsByParts weight, or its AdamW state, between rank order and HF's (Shard(0) rows of [a; b; ...], as
    DCP and the export take them): one all-to-all in TP's group, no rank holding more than its rows."""
    if not isinstance(value, DTensor):
        return value
    mesh, names = value.device_mesh, value.device_mesh.mesh_dim_names or ()
    if "tp" not in names and mesh.ndim > 1:  # FSDP's on TP's: FSDP shards another dim
        raise ValueError(f"a RowsByParts weight on a mesh of dims {names or 'with no names'}: name TP's dim 'tp'")
    i = names.index("tp") if "tp" in names else 0
    tp = mesh.size(i)
    unit = math.gcd(*parts) // tp  # rows in a block: each part's rank share is whole blocks
    counts = [part // tp // unit for part in parts]
    first = [tp * sum(counts[:p]) for p in range(len(parts))]  # each part's first block in HF's order
    rank_order = [[first[p] + r * n + j for p, n in enumerate(counts) for j in range(n)] for r in range(tp)]
    hf_order = [[r * sum(counts) + j for j in range(sum(counts))] for r in range(tp)]
    now, then = (rank_order, hf_order) if to_hf else (hf_order, rank_order)
    local = wait_tensor(rows_moved(value.to_local().detach(), now, then, mesh, i))
    return DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())


def rows_moved(local: torch.Tensor, now: list, then: list, mesh, i: int) -> torch.Tensor:
    """`local`'s equal blocks of rows (rank q holds blocks now[q], in that order) moved by one all-to-all in
    mesh dim i's group so that rank q holds blocks then[q], in that order."""
    tp, r = mesh.size(i), mesh.get_local_rank(i)
    owner = {b: q for q in range(tp) for b in then[q]}
    sent = sorted(now[r], key=lambda b: (owner[b], then[owner[b]].index(b)))
    blocks = local.unflatten(0, (len(now[r]), -1))[[now[r].index(b) for b in sent]].contiguous()
    came = [b for q in range(tp) for b in sorted((b for b in now[q] if owner[b] == r), key=then[r].index)]
    received = all_to_all_single(blocks, [sum(owner[b] == r for b in now[q]) for q in range(tp)],
                                 [sum(owner[b] == q for b in now[r]) for q in range(tp)], (mesh, i))
    return received[[came.index(b) for b in then[r]]].flatten(0, 1)
