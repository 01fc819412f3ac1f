"""Every weight in HF's layout, as Shard rows, for DCP and the export, and back into the plan's: a fused
weight's _StridedShard rows (family_plan.FusedColwiseParallel), and Gated DeltaNet's rows held by heads
(hybrid_plan.RowsByHeads), each exchanged by one all-to-all in TP's group: no rank holds more than its rows.
Beside family_plan.py: what a checkpointing trainer needs of it, and the exchange (blocks_exchanged) its fused
weights' forward makes on torch 2.10-2.11."""

import math

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map_with_path


def in_hf_layout(state, config):
    """`state` (a model's or optimizer's state dict, or a tuple of them: by parameter name) with every
    weight in HF's layout, as Shard rows."""
    by_heads = rows_by_heads(config)
    return tree_map_with_path(lambda path, value: rows_reordered(value, by_heads[name], to_hf=True)
                              if (name := named(path, by_heads)) else without_strided_shards(value), state)


def in_plan_layout(state, like, config):
    """`state`, loaded in HF's layout (in_hf_layout's), in the layout of `like`, the model's own state."""
    by_heads = rows_by_heads(config)
    return tree_map_with_path(lambda path, value, like: rows_reordered(value, by_heads[name], to_hf=False)
                              if (name := named(path, by_heads)) else placed_like(value, like), state, like)


def named(path, names: dict) -> str | None:
    """The parameter name on a state dict's path (an optimizer's: "state", name, "exp_avg") among `names`."""
    return next((key.key for key in path if getattr(key, "key", None) in names), None)


def without_strided_shards(value):
    """A fused weight's DTensor, or its AdamW state, as Shard on the same dim: a slice of HF's
    layout, for DCP, which refuses _StridedShard (`overlapping chunks`, torch 2.15.0; test_checkpoint
    says when it no longer does). `placed_like` sets such a copy back, loaded, into the strided weight."""
    if not isinstance(value, DTensor) or not (fused := fused_placements(value.placements)):
        return value
    return rows_exchanged(value, [Shard(p.dim) if i in fused else p for i, p in enumerate(value.placements)])


def placed_like(value, like):
    """`value`, a loaded copy of without_strided_shards', in `like`'s placements; anything else as it is."""
    if not (isinstance(value, DTensor) and isinstance(like, DTensor)) or value.placements == like.placements:
        return value
    return rows_exchanged(value, like.placements)


def rows_exchanged(value: DTensor, placements) -> DTensor:
    """`value` in `placements`: Shard(d) <-> a fused weight's _StridedShard(d, parts) on one mesh dim, by
    blocks_exchanged in that dim's group. Torch 2.15.0's `redistribute` gathers the whole weight
    (`_redistribute.py`'s TODO cases 8 and 10, pytorch/pytorch#171023; test_families says when it
    no longer does)."""
    [i] = [i for i, (p, q) in enumerate(zip(value.placements, placements)) if p != q]
    strided = next(p for p in (value.placements[i], placements[i]) if isinstance(p, _StridedShard))
    mesh, dim, parts = value.device_mesh, strided.dim, strided.split_factor
    if value.shape[dim] % (parts * mesh.size(i)):
        return value.redistribute(mesh, placements)
    local = blocks_exchanged(value.to_local().detach(), dim, parts, mesh, i, to_strided=strided is placements[i])
    local = wait_tensor(local)  # a plain tensor, not funcol's AsyncCollectiveTensor, which DCP cannot load back
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


def rows_by_heads(config) -> dict[str, tuple]:
    """{parameter name: its parts} of the weights RowsByHeads holds in rank order, from the config."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or ()):
        return {}
    k, v = (config.linear_num_key_heads * config.linear_key_head_dim, config.linear_num_value_heads * config.linear_value_head_dim)
    return {f"model.layers.{i}.linear_attn.{module}.weight": (k, k, v) for i, kind in enumerate(config.layer_types)
            if kind == "linear_attention" for module in ("in_proj_qkv", "conv1d")}


def rows_reordered(value, parts: tuple, to_hf: bool):
    """A RowsByHeads weight, or its AdamW state, between rank order and HF's (Shard(0) rows of [q; k; v], as
    DCP and the export take them): one all-to-all in TP's group, no rank holding more than its rows."""
    if not isinstance(value, DTensor) or "tp" not in (value.device_mesh.mesh_dim_names or ()):
        return value  # no TP (FSDP alone): HF's rows
    mesh = value.device_mesh
    i = mesh.mesh_dim_names.index("tp")  # RowsByHeads's Shard(0); FSDP shards another dim
    tp = mesh.size(i)
    unit = math.gcd(*parts) // tp  # rows in a block: each part's rank share is whole blocks
    counts = [part // tp // unit for part in parts]
    first = [tp * sum(counts[:p]) for p in range(len(parts))]  # each part's first block in HF's order
    rank_order = [[first[p] + r * n + j for p, n in enumerate(counts) for j in range(n)] for r in range(tp)]
    hf_order = [[r * sum(counts) + j for j in range(sum(counts))] for r in range(tp)]
    now, then = (rank_order, hf_order) if to_hf else (hf_order, rank_order)
    local = wait_tensor(rows_moved(value.to_local().detach(), now, then, mesh, i))
    return DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())


def fused_placements(placements) -> list[int]:
    """The mesh dims of a fused weight's _StridedShard: not FSDP's own over a TP-sharded dim
    (torch 2.10.0's label for 2D), which a later mesh dim's Shard of the same tensor dim follows."""
    return [i for i, p in enumerate(placements)
            if isinstance(p, _StridedShard) and not any(q.is_shard(p.dim) for q in placements[i + 1:])]


def blocks_exchanged(local: torch.Tensor, dim: int, parts: int, mesh, i: int, to_strided: bool) -> torch.Tensor:
    """`local`'s parts x TP equal blocks on `dim` (block b: part b // TP's (b % TP)-th 1/TP), moved by one
    all-to-all in mesh dim i's group between Shard's order (rank r: blocks r*parts...) and the strided one
    (rank r: blocks r, r + TP, ...), each rank's in the order of b; differentiable."""
    tp = mesh.size(i)
    shard, strided = [[q * parts + k for k in range(parts)] for q in range(tp)], [[k * tp + q for k in range(parts)] for q in range(tp)]
    now, then = (shard, strided) if to_strided else (strided, shard)
    return rows_moved(local.movedim(dim, 0), now, then, mesh, i).movedim(0, dim).contiguous()


def rows_moved(local: torch.Tensor, now: list, then: list, mesh, i: int) -> torch.Tensor:
    """`local`'s equal blocks of rows (rank q holds blocks now[q], in that order) moved by one all-to-all in
    mesh dim i's group so that rank q holds blocks then[q], in that order."""
    tp, r = mesh.size(i), mesh.get_local_rank(i)
    owner = {b: q for q in range(tp) for b in then[q]}
    sent = sorted(now[r], key=lambda b: (owner[b], then[owner[b]].index(b)))
    blocks = local.unflatten(0, (len(now[r]), -1))[[now[r].index(b) for b in sent]].contiguous()
    came = [b for q in range(tp) for b in sorted((b for b in now[q] if owner[b] == r), key=then[r].index)]
    received = all_to_all_single_autograd(blocks, [sum(owner[b] == r for b in now[q]) for q in range(tp)],
                                          [sum(owner[b] == q for b in now[r]) for q in range(tp)], (mesh, i))
    return received[[came.index(b) for b in then[r]]].flatten(0, 1)
