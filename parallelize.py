"""Tensor Parallel + sequence parallel, activation checkpointing and per-block compile.

One function per parallelism, applied in torchtitan's order (TP, then AC, then compile),
each one calling torchtitan's or torch's primitive on the HF module names.
"""

import torch
import torch.nn as nn
import torchtitan.distributed.parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
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


def build_tp_mesh(world_size: int, device_type: str) -> DeviceMesh:
    """The TP mesh over all ranks, built by torchtitan's `ParallelDims`."""
    _set_titan_mesh_device_type(device_type)
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, etp=1, world_size=world_size
    )
    parallel_dims.build_mesh()
    return parallel_dims.get_mesh("tp")


def _set_titan_mesh_device_type(device_type: str) -> None:
    """Workaround, torchtitan 0.2.2: `ParallelDims.build_mesh` uses the module-level
    `torchtitan.tools.utils.device_type`, which falls back to "cuda" on a machine without
    a GPU, so the mesh creation fails on CPU. Point it at the device actually in use."""
    torchtitan.distributed.parallel_dims.device_type = device_type


def apply_tp(model: LlamaForCausalLM, tp_mesh: DeviceMesh, decoder_layer: str) -> None:
    """TP + sequence parallel, the plan of torchtitan's llama3 `apply_tp` on HF names.

    Between blocks the activations are sharded on the sequence dim (Shard(1)); attention and
    MLP all-gather them on entry (PrepareModuleInput) and reduce-scatter on exit (RowwiseParallel
    with output Shard(1)). Logits come out replicated, so the loss is a plain cross entropy.
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
                "self_attn": _attention_input_style(decoder_layer),
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


def _attention_input_style(decoder_layer: str) -> PrepareModuleInput:
    """How attention's input is all-gathered from Shard(1) to Replicate.

    "positional": the fix. `PositionalLlamaDecoderLayer` passes hidden_states positionally, so
    a positional pre-hook does it and no `with_kwargs=True` hook is registered.
    "stock": what HF's own layer needs, since it passes `hidden_states=` by keyword. It registers
    a `with_kwargs=True` pre-hook per block, which torch <= 2.10 Dynamo guards on by hook id:
    one recompile per block (pytorch/pytorch#170110). Kept for the demonstration and the test.
    """
    if decoder_layer == "positional":
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if decoder_layer == "stock":
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
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


def parallelize(model: LlamaForCausalLM, tp_mesh: DeviceMesh | None, cfg: dict) -> None:
    """TP (when there is a mesh), AC, compile: torchtitan's order."""
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, cfg["parallelism"]["decoder_layer"])
    ac, comp = cfg["activation_checkpoint"], cfg["compile"]
    if ac["mode"] != "none":
        apply_ac(model, ac["mode"], ac["selective_ac_option"], comp["enable"])
    if comp["enable"]:
        apply_compile(model, comp["backend"])
