"""Tensor Parallel + sequence parallel, activation checkpointing, per-block compile and FSDP2.

One function per parallelism, applied in torchtitan's order (TP, then AC, then compile, then
FSDP), each one calling torchtitan's or torch's primitive on the HF module names.
"""

import warnings

import torch
import torch.nn as nn
import torchtitan.distributed.parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.config.job_config import ActivationCheckpoint as ACConfig
from torchtitan.config.job_config import Compile as CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
from torchtitan.models.llama3.infra.parallelize import apply_compile as titan_apply_compile
from transformers import LlamaForCausalLM


def build_parallel_dims(dp_shard: int, tp: int, device_type: str) -> ParallelDims:
    """The (dp_shard, tp) mesh, built by torchtitan's `ParallelDims`. TP is the innermost
    dimension, so a TP group is made of neighbouring ranks: with tp = GPUs per node, the GPUs
    of one node. `get_optional_mesh("tp")`, `("fsdp")` and `("batch")` give the 1D meshes
    (None for a degree of 1)."""
    _set_titan_mesh_device_type(device_type)
    keep_device_mesh_hash_out_of_pickles()
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=dp_shard * tp
    )
    parallel_dims.build_mesh()
    return parallel_dims


def keep_device_mesh_hash_out_of_pickles() -> None:
    """Workaround, torch 2.14.1: AOTAutograd's cache key pickles the TP `DeviceMesh`, whose
    state keeps `_hash`, this process's `hash()` of it (address-based for None before Python
    3.12, salted for strings), so every TP restart misses the AOTAutograd and FX-graph caches.
    An unpickled mesh recomputes `_hash`; the key keeps the rank, so ranks never share an entry
    (pytorch/pytorch#188390; related: #173526). test_caches.py says when it is not needed."""
    original = DeviceMesh.__getstate__
    if getattr(original, "keeps_hash_out", False):
        return

    def __getstate__(self) -> dict:
        state = original(self)
        state.pop("_hash", None)
        return state

    __getstate__.keeps_hash_out = True
    DeviceMesh.__getstate__ = __getstate__


def _set_titan_mesh_device_type(device_type: str) -> None:
    """Workaround, torchtitan 0.2.2: `ParallelDims.build_mesh` uses the module-level
    `torchtitan.tools.utils.device_type`, which falls back to "cuda" on a machine without
    a GPU, so the mesh creation fails on CPU. Point it at the device actually in use."""
    torchtitan.distributed.parallel_dims.device_type = device_type


def apply_tp(model: LlamaForCausalLM, tp_mesh: DeviceMesh, decoder_layer: str, attention_gather: str) -> None:
    """TP + sequence parallel, the plan of torchtitan's llama3 `apply_tp` on HF names.

    Between blocks the activations are sharded on the sequence dim (Shard(1)); attention and
    MLP all-gather them on entry and reduce-scatter on exit (RowwiseParallel with output
    Shard(1)). Logits come out replicated, so the loss is a plain cross entropy. The plan uses
    only HF's Llama module names, so it fits any HF decoder with them (Qwen2, Qwen3, Mistral).
    """
    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    materialize_embedding_output(model.model.embed_tokens)

    for block in model.model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "input_layernorm": SequenceParallel(),
                **_attention_input_plan(decoder_layer, attention_gather),
                **_qk_norm_plan(block),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        if attention_gather == "norm_output":
            # A second call: a plan holds one style per module, and input_layernorm has two.
            parallelize_module(block.input_layernorm, tp_mesh, GATHER_AT_NORM_OUTPUT)


# The plan-only fix: all-gather attention's input on input_layernorm's output (a positional
# forward hook) instead of in a pre-hook on attention, which then gets its full-sequence input
# by keyword with no hook on it at all. The output stays a Replicate DTensor, as the pre-hook
# plan hands attention: q, k and v's partial input gradients then add up as one DTensor and
# leave by one reduce-scatter. A plain tensor (use_local_output=True) would cost three
# all-reduces per block in backward instead, one per projection.
GATHER_AT_NORM_OUTPUT = PrepareModuleOutput(
    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=False
)


def _qk_norm_plan(block: nn.Module) -> dict:
    """Qwen3's RMSNorm on each head's q and k, inside attention (Llama has none). Its weight is
    replicated over TP while each rank holds its own heads (dim 2 of the (batch, seq, heads,
    head_dim) view), planned as torchtitan's HF backend does: as a DTensor its gradient is
    summed over the TP ranks, as a plain tensor each rank would keep its own heads' part."""
    if not hasattr(block.self_attn, "q_norm"):
        return {}
    return {name: SequenceParallel(sequence_dim=2, use_local_output=True)
            for name in ("self_attn.q_norm", "self_attn.k_norm")}


def _attention_input_plan(decoder_layer: str, attention_gather: str) -> dict:
    """Where attention's input is all-gathered from Shard(1) (sequence) to Replicate.

    "pre_hook" with the "positional" layer: the vendored fix. `PositionalLlamaDecoderLayer`
    passes hidden_states positionally, so a positional PrepareModuleInput does it and no
    `with_kwargs=True` hook is registered.
    "pre_hook" with the "stock" layer: what HF's own layer needs, since it passes
    `hidden_states=` by keyword. It registers a `with_kwargs=True` pre-hook per block, which
    torch <= 2.10 Dynamo guards on by hook id: one recompile per block
    (pytorch/pytorch#170110). Kept for the demonstration and the tests.
    "norm_output", with either layer: no style on attention; `GATHER_AT_NORM_OUTPUT` on
    input_layernorm does the gather (see apply_tp).
    """
    if attention_gather == "norm_output":
        return {}
    if decoder_layer == "positional":
        return {"self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    if decoder_layer == "stock":
        return {"self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )}
    raise ValueError(f"decoder_layer must be 'positional' or 'stock', got {decoder_layer!r}")


def materialize_embedding_output(embedding: nn.Module) -> None:
    """Workaround, torch 2.13-2.14 (seen on both): the TP embedding's reduce-scatter output is
    an `AsyncCollectiveTensor`. Fed to the first compiled block it costs one extra graph
    (block 0 sees a different tensor type than the others) and AOTAutograd's backward fails
    with `'Tensor' object has no attribute '_local_tensor'`. Cloning waits for the collective
    and hands every block a plain tensor; the copy is one (batch, seq/TP, hidden) activation."""
    embedding.register_forward_hook(lambda _module, _inputs, output: output.clone())


# torchtitan's op-level selective-AC save list names the CUDA SDPA kernels only; add CPU's.
OP_SAC_SAVE_LIST = _op_sac_save_list | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def apply_ac(model: LlamaForCausalLM, mode: str, selective_option: str, compile_enabled: bool) -> None:
    """torchtitan's `apply_ac`, which wraps each child of `model.model.layers`."""
    titan_apply_ac(
        model.model,
        ACConfig(mode=mode, selective_ac_option=selective_option),
        model_compile_enabled=compile_enabled,
        op_sac_save_list=OP_SAC_SAVE_LIST,
    )


def apply_compile(model: LlamaForCausalLM, backend: str) -> None:
    """torchtitan's `apply_compile`: `torch.compile(block, fullgraph=True)` per block. All
    blocks run the same code, so Dynamo can serve them all from one graph."""
    titan_apply_compile(model.model, CompileConfig(enable=True, backend=backend))


def apply_fsdp(model: LlamaForCausalLM, dp_mesh: DeviceMesh, param_dtype: str, reduce_dtype: str) -> None:
    """FSDP2, torchtitan 0.2.2's `apply_fsdp` (no PP, "default" reshard policy) on HF names.

    torchtitan's function hard-codes its own module names (`tok_embeddings`, `layers`,
    `norm`, `output`), so its calls are written out here: the embedding, each block, final
    norm + lm_head as one group (not resharded after forward: backward needs them first),
    then the root. Parameters already sharded by TP become 2D DTensors (dp_shard x tp).

    It runs after compile, as in torchtitan: each block is then torch.compile's wrapper, and
    FSDP's own `with_kwargs=True` pre-hooks sit on that wrapper, outside the traced frame, so
    they add no per-block guard. The other order (fully_shard, then compile) fails on torch
    2.10.0 with `Unsupported: Attempted to call function marked as skipped`.

    Gradients keep FSDP's default average over the dp ranks: every token counts (no padding)
    and every rank has the same batch size, so that is the global mean, which torchtitan
    gets by dividing by the global token count with FSDP's division turned off.
    """
    _silence_fsdp_view_output_warning()
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype))
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    fully_shard(model.model.embed_tokens, **fsdp_config, reshard_after_forward=True)
    for block in model.model.layers:
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    fully_shard([model.model.norm, model.lm_head], **fsdp_config, reshard_after_forward=False)
    fully_shard(model, **fsdp_config)


def _silence_fsdp_view_output_warning() -> None:
    """torch 2.14's FSDP2 warns, on every rank, when a sharded module returns a view: an
    in-place op on it would skip FSDP's pre-backward hook. Here the views are the logits
    (lm_head's TP output and HF's `hidden_states[:, slice_indices, :]`), which only the loss
    reads; nothing changes them in place."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def parallelize(model: LlamaForCausalLM, parallel_dims: ParallelDims | None, cfg: dict) -> None:
    """TP, AC, compile, FSDP: torchtitan's order. TP and FSDP only where their degree is > 1."""
    tp_mesh = parallel_dims.get_optional_mesh("tp") if parallel_dims else None
    dp_mesh = parallel_dims.get_optional_mesh("fsdp") if parallel_dims else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, cfg["parallelism"]["decoder_layer"], cfg["parallelism"]["attention_gather"])
    ac, comp, t = cfg["activation_checkpoint"], cfg["compile"], cfg["training"]
    if ac["mode"] != "none":
        apply_ac(model, ac["mode"], ac["selective_ac_option"], comp["enable"])
    if comp["enable"]:
        apply_compile(model, comp["backend"])
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh, t["mixed_precision_param"], t["mixed_precision_reduce"])
