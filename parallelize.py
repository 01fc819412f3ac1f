"""Tensor Parallel + sequence parallel, activation checkpointing, per-block compile and FSDP2.

`parallelize` applies them in torchtitan's order, one `apply_*` each, calling torchtitan's or
torch's primitive on the HF module names. Llama's TP plan is LLAMA_BLOCK_PLAN; other HF families'
is derived in family_plan.py.
"""

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torchtitan.config.job_config import ActivationCheckpoint as ACConfig, Compile as CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
from torchtitan.models.llama3.infra.parallelize import apply_compile as titan_apply_compile
from transformers import LlamaForCausalLM

import family_plan
import hybrid_plan
import workarounds
from family_plan import attention_norm, refuse_unplanned_parameters, require_llama_layout_and_masks


def parallelize(model: LlamaForCausalLM, parallel_dims: ParallelDims | None, cfg: dict) -> None:
    """TP, AC, compile, FSDP: torchtitan's order. TP and FSDP only where their degree is > 1.
    FSDP after compile keeps its kwargs pre-hooks outside the traced frames; the other order
    fails on torch 2.10.0 (`Unsupported: Attempted to call function marked as skipped`)."""
    tp_mesh = parallel_dims.get_optional_mesh("tp") if parallel_dims else None
    dp_mesh = parallel_dims.get_optional_mesh("fsdp") if parallel_dims else None
    p, ac, comp, t = cfg["parallelism"], cfg["activation_checkpoint"], cfg["compile"], cfg["training"]
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, p["decoder_layer"], p["attention_gather"], p["loss_parallel"])
    if ac["mode"] != "none":
        apply_ac(model, ac["mode"], ac["selective_ac_option"], comp["enable"])
    if comp["enable"]:
        apply_compile(model, comp["backend"])
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh, t["mixed_precision_param"], t["mixed_precision_reduce"])


def build_parallel_dims(cfg: dict, world_size: int, device_type: str) -> ParallelDims | None:
    """[parallelism]'s (dp_shard, tp) mesh as torchtitan's `ParallelDims`, None for one process.
    TP innermost: a TP group is neighbouring ranks, one node's GPUs when tp = GPUs per node."""
    if world_size == 1:
        return None
    dp_shard, tp = cfg["parallelism"]["dp_shard"], cfg["parallelism"]["tp"]
    workarounds.set_titan_mesh_device_type(device_type)
    workarounds.keep_device_mesh_hash_out_of_pickles()
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1,
                                 world_size=dp_shard * tp)
    parallel_dims.build_mesh()
    workarounds.set_comm_timeout(cfg["comm"]["init_timeout_seconds"])  # its subgroups too, until step 1
    return parallel_dims


def apply_tp(model: LlamaForCausalLM, tp_mesh: DeviceMesh, decoder_layer: str, attention_gather: str,
             loss_parallel: bool = False) -> None:
    """TP + sequence parallel: torchtitan's llama3 plan on HF names. Between blocks activations
    are Shard(1) (sequence); attention and MLP all-gather on entry and reduce-scatter on exit.
    Logits stay sharded on the vocabulary with `loss_parallel` (train.vocab_parallel), else replicated."""
    require_llama_layout_and_masks(model)
    plans = [block_plan(model, block, decoder_layer, attention_gather) for block in model.model.layers]  # may refuse
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(use_local_output=True),  # nanochat runs it before the blocks too
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    })
    if model.config.tie_word_embeddings:  # both weights Shard(0) on the vocabulary: one parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    workarounds.materialize_embedding_output(model.model.embed_tokens)
    for i, (block, plan) in enumerate(zip(model.model.layers, plans)):
        parallelize_module(block, tp_mesh, plan)
        if attention_gather == "norm_output" and (norm := attention_norm(block)):  # not post-norm (olmo2)
            # A second call: a plan holds one style per module, and the attention norm has two.
            parallelize_module(block.get_submodule(norm), tp_mesh, GATHER_AT_NORM_OUTPUT)
        refuse_unplanned_parameters(block, f"model.layers.{i}")


# torchtitan's llama3 block plan (its apply_tp) on HF names. Activations between blocks are Shard(1);
# each norm runs on its rank's sequence shard; attention and MLP all-gather their input and
# reduce-scatter their output. self_attn's entry is recipe A's positional pre-hook: block_plan
# swaps it for the kwargs one (the stock layer, the bug) or drops it (recipe B).
LLAMA_BLOCK_PLAN = {
    "input_layernorm": SequenceParallel(),
    "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(use_local_output=True),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}
# HF's layer passes hidden_states by keyword: a with_kwargs pre-hook, whose id Dynamo guards on
# per block on torch <= 2.10 (pytorch/pytorch#170110).
KWARGS_ATTENTION_INPUT = family_plan.KWARGS_ATTENTION_INPUT


def block_plan(model: nn.Module, block: nn.Module, decoder_layer: str, attention_gather: str) -> dict:
    """LLAMA_BLOCK_PLAN, or another family's derived from its modules (family_plan.py; for Llama
    blocks the same dict: test_recompile), with attention's input for the recipe."""
    plan = dict(LLAMA_BLOCK_PLAN) if isinstance(model, LlamaForCausalLM) else family_plan.block_plan(block, attention_gather)
    if attention_gather == "norm_output":  # recipe B: gathered at the attention norm's output
        if plan.get("self_attn") is LLAMA_BLOCK_PLAN["self_attn"]:  # not family_plan's (LocalHeads, post-norm)
            del plan["self_attn"]
    else:  # family_plan refuses a family whose attention has a style of its own here
        plan["self_attn"] = KWARGS_ATTENTION_INPUT if decoder_layer == "stock" else LLAMA_BLOCK_PLAN["self_attn"]
    return plan


# Recipe B: all-gather attention's input at the attention norm's output in a positional forward
# hook, kept a Replicate DTensor: q, k and v's input gradients leave by one reduce-scatter (README).
GATHER_AT_NORM_OUTPUT = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                            use_local_output=False)


def apply_ac(model: LlamaForCausalLM, mode: str, selective_option: str, compile_enabled: bool) -> None:
    """torchtitan's `apply_ac`, which wraps each child of `model.model.layers`."""
    titan_apply_ac(model.model, ACConfig(mode=mode, selective_ac_option=selective_option),
                   model_compile_enabled=compile_enabled, op_sac_save_list=workarounds.OP_SAC_SAVE_LIST)


def apply_compile(model: LlamaForCausalLM, backend: str) -> None:
    """torchtitan's `apply_compile`: `torch.compile(block, fullgraph=True)` per block. All
    blocks of a kind run the same code, so Dynamo can serve them all from one graph."""
    hybrid_plan.a_frame_of_their_own(model.model.layers)  # Qwen3.5's linear-attention blocks: a graph of their own
    titan_apply_compile(model.model, CompileConfig(enable=True, backend=backend))


def autocast(cfg: dict, device_type: str):
    """`torch.autocast` to bfloat16 around the forward where `bfloat16_by` says, as torchtitan's
    `maybe_enable_amp` (which leaves TP alone in float32). Weights, gradients, AdamW, loss: float32."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if bfloat16_by(cfg) == "autocast" else contextlib.nullcontext()


def bfloat16_by(cfg: dict) -> str | None:
    """What computes in bfloat16: FSDP2's policy (dp_shard > 1), else autocast; None in float32."""
    dtype, dp_shard = cfg["training"]["mixed_precision_param"], cfg["parallelism"]["dp_shard"]
    return None if dtype == "float32" else "FSDP2" if dp_shard > 1 else "autocast"


def apply_fsdp(model: LlamaForCausalLM, dp_mesh: DeviceMesh, param_dtype: str, reduce_dtype: str) -> None:
    """FSDP2: torchtitan 0.2.2's `apply_fsdp` (no PP, "default" reshard) on HF names. The embedding, each
    block, final norm + lm_head as one group (not resharded: backward needs them first; tied, with the
    embedding), then the root. Gradients keep FSDP's average over the dp ranks (README, "Other launches")."""
    workarounds.silence_fsdp_view_output_warning()
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype))
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy, "shard_placement_fn": family_plan.fsdp_shard_placement}
    tied = model.config.tie_word_embeddings  # a shared parameter belongs to one group (torchtitan's qwen3)
    if not tied:
        fully_shard(model.model.embed_tokens, **fsdp_config, reshard_after_forward=True)
        model.model.embed_tokens.set_unshard_in_backward(False)  # its backward needs the token ids only
    for block in model.model.layers:
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    fully_shard([model.model.embed_tokens] * tied + [model.model.norm, model.lm_head], **fsdp_config,
                reshard_after_forward=False)
    fully_shard(model, **fsdp_config)
