"""Build on the meta device, parallelize, then fill each rank's shards: no rank holds the whole model.

`build_on_meta` records every in-place op HF's construction runs on a parameter (the layers'
`reset_parameters`, then `post_init`'s `_init_weights`); `materialize` replays them in order on
one full-size host tensor at a time, so the CPU generator gives the weights one seeded process
builds, and keeps each rank's piece."""
from dataclasses import dataclass
from unittest import mock

import torch
import transformers.modeling_utils
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode


class InitOps(TorchDispatchMode):
    """Every in-place op on an existing tensor, in order: (op, target, other args, kwargs)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            self.ops.append((func, args[0], args[1:], kwargs or {}))
        return func(*args, **(kwargs or {}))


def build_on_meta(build):
    """`build()` on the meta device, with the init ops HF would run on a real one (it skips them on
    meta: `init_weights`); returns (model, ops), each op's target a `Weight` or None (a tensor that
    is no parameter by the end, as an lm_head weight replaced by the tie: its draws still count)."""
    real_device = lambda: torch.device("cpu")  # noqa: E731 (what HF sees: run _init_weights)
    with torch.device("meta"), InitOps() as recorded, \
            mock.patch.object(transformers.modeling_utils, "get_torch_context_manager_or_global_device", real_device):
        model = build()
    weights = {}  # id(parameter) -> Weight: wrappers added later keep the modules
    for module_name, module in model.named_modules():
        for attr, p in ((a, p) for a, p in module._parameters.items() if p is not None):
            weights.setdefault(id(p), Weight(f"{module_name}.{attr}".lstrip("."), [])).owners.append((module, attr))
    for func, target, *_ in recorded.ops:  # what replay_init could not give; a load fills them all
        if target._base is not None and id(target._base) in weights:  # a padding_idx row
            weights[id(target._base)].unreplayable = "the build initialises a view of it"
        if func is torch.ops.aten.copy_.default and id(target) in weights:  # its source is on meta: lost
            weights[id(target)].unreplayable = "the build copies into it"
    missing = set(weights) - {id(target) for _, target, *_ in recorded.ops}
    if missing:
        raise RuntimeError(f"the build ran no init op on {', '.join(weights[i].name for i in missing)}")
    return model, [(func, weights.get(id(target)), tuple(target.shape), target.dtype, args, kwargs)
                   for func, target, args, kwargs in recorded.ops]


@dataclass
class Weight:
    name: str
    owners: list  # (module, attribute): two for a tied weight
    unreplayable: str | None = None  # why replay_init cannot give it


@torch.no_grad()
def materialize(model, ops, device: torch.device, seed: int, draw: bool = True) -> None:
    """Storage for this rank's shards on `device`, filled as `torch.manual_seed(seed)` and the build on
    a real device would fill them; with `draw` False left for a load to fill (a checkpoint, an HF folder):
    no random number, no full-size tensor. Buffers by HF's `_init_weights` (rotary's inv_freq)."""
    model.to_empty(device=device)
    for weight in {id(weight): weight for _, weight, *_ in ops if weight is not None}.values():
        param = getattr(*weight.owners[0])
        for module, attr in weight.owners[1:]:  # to_empty gives a plain tied parameter two copies
            setattr(module, attr, param)
        if getattr(weight.owners[0][0], "rows_by_parts", None):  # TP's hf_layout.RowsByParts
            weight.unreplayable = "its rows are held in rank order, no one slice of the whole"
    if draw:
        replay_init(ops, seed)
    for module in model.modules():
        if next(module.buffers(recurse=False), None) is not None:
            for param in module.parameters(recurse=False):  # gemma's scaled embedding: its init skips them
                param._is_hf_initialized = True
            model._init_weights(module)


def replay_init(ops, seed: int) -> None:
    """The build's init ops in order, from `seed`, each on one full-size host tensor (the generator's
    stream), of which each parameter keeps this rank's piece."""
    last = {id(weight): i for i, (_, weight, *_) in enumerate(ops) if weight is not None}
    if lost := next((weight for _, weight, *_ in ops if weight is not None and weight.unreplayable), None):
        raise RuntimeError(f"{lost.name}: {lost.unreplayable}, not replayed; start from a folder or a checkpoint")
    torch.manual_seed(seed)
    for i, (func, weight, shape, dtype, args, kwargs) in enumerate(ops):
        if func is torch.ops.aten.copy_.default:  # into a buffer from a meta source: computed again below
            continue
        full = torch.empty(shape, dtype=dtype)
        func(full, *args, **kwargs)
        if weight is not None and last[id(weight)] == i:
            param = getattr(*weight.owners[0])
            local(param).copy_(full[piece(shape, param)])


def piece(shape: tuple, param) -> tuple:
    """The slices of a full tensor of `shape` that this rank holds of `param`."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in shape)
    sizes, offsets = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def local(param) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
