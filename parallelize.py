"""Tensor Parallel + sequence parallel, activation checkpointing, per-block compile and FSDP2.

`parallelize` applies them in torchtitan's order, one `apply_*` each, calling torchtitan's or
torch's primitive on the HF module names. Library workarounds are at the bottom.
"""

import ast
import functools
import inspect
import re
import textwrap
import warnings

import torch
import torch.nn as nn
import torchtitan.distributed.parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torchtitan.config.job_config import ActivationCheckpoint as ACConfig, Compile as CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile as titan_apply_compile
from transformers import LlamaForCausalLM


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
    _set_titan_mesh_device_type(device_type)
    keep_device_mesh_hash_out_of_pickles()
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1,
                                 world_size=dp_shard * tp)
    parallel_dims.build_mesh()
    return parallel_dims


def apply_tp(model: LlamaForCausalLM, tp_mesh: DeviceMesh, decoder_layer: str, attention_gather: str,
             loss_parallel: bool = False) -> None:
    """TP + sequence parallel: torchtitan's llama3 plan on HF names. Between blocks activations
    are Shard(1) (sequence); attention and MLP all-gather on entry and reduce-scatter on exit.
    Logits stay sharded on the vocabulary with `loss_parallel` (train.vocab_parallel), else replicated."""
    require_llama_layout_and_sdpa(model)
    plans = [block_plan(block, decoder_layer, attention_gather) for block in model.model.layers]  # may refuse
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(use_local_output=True),  # nanochat runs it before the blocks too
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    })
    if model.config.tie_word_embeddings:  # both weights Shard(0) on the vocabulary: one parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    materialize_embedding_output(model.model.embed_tokens)
    for i, (block, plan) in enumerate(zip(model.model.layers, plans)):
        parallelize_module(block, tp_mesh, plan)
        if attention_gather == "norm_output":
            # A second call: a plan holds one style per module, and the attention norm has two.
            parallelize_module(block.get_submodule(attention_norm(block)), tp_mesh, GATHER_AT_NORM_OUTPUT)
        refuse_unplanned_parameters(block, f"model.layers.{i}")


# Recipe B: all-gather attention's input at the attention norm's output in a positional forward
# hook, kept a Replicate DTensor: q, k and v's input gradients leave by one reduce-scatter (README).
GATHER_AT_NORM_OUTPUT = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                            use_local_output=False)


class PlanError(ValueError):
    """What the TP plan cannot make correct, raised before it changes the model."""


NORM = re.compile(r"(RMS|Layer)Norm")  # HF's norm classes: LlamaRMSNorm, CohereLayerNorm, nn.LayerNorm
ATTENTION_NORMS = ("input_layernorm", "attention_layernorm")  # the norm whose output attention reads
MLP_PROJECTIONS = {"gate_proj": "in", "up_proj": "in", "c_fc": "in", "fc1": "in",
                   "down_proj": "out", "c_proj": "out", "fc2": "out"}


def block_plan(block: nn.Module, decoder_layer: str, attention_gather: str) -> dict:
    """One block's plan, from the modules it holds; PlanError for what it cannot make correct. Every
    norm outside attention and the MLP is SequenceParallel, found by type, so that its weight's gradient
    is summed over the TP group (an unplanned norm trains on its rank's tokens only, in silence)."""
    gather_at = attention_norm(block) if attention_gather == "norm_output" else "input_layernorm"
    norms = [name for name, module in block.named_children() if NORM.search(type(module).__name__)]
    return {
        **{name: SequenceParallel(use_local_output=name != gather_at) for name in norms},
        **_attention_input_plan(decoder_layer, attention_gather),
        **attention_plan(block.self_attn),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **mlp_plan(block.mlp),
    }


def attention_norm(block: nn.Module) -> str:
    """The norm whose output attention reads: where recipe B gathers."""
    for name in ATTENTION_NORMS:
        if hasattr(block, name):
            return name
    raise PlanError(f"{type(block).__name__} has no norm before attention ({' or '.join(ATTENTION_NORMS)}): "
                    "a post-norm block, where recipe B has no module to gather at; vendor the layer (recipe A)")


def attention_plan(attn: nn.Module) -> dict:
    """q, k, v column-wise, o row-wise back to Shard(1); a per-head q/k norm as torchtitan's HF
    backend plans Qwen3's (each rank holds its own heads on dim 2, the weight's gradient summed)."""
    children = dict(attn.named_children())
    missing = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj") if name not in children]
    if missing:
        raise PlanError(f"{type(attn).__name__} has no {', '.join(missing)} (it has {', '.join(children)}): "
                        "column-wise TP would split a fused projection across q, k and v")
    if other := next((n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not isinstance(children[n], nn.Linear)), None):
        raise PlanError(f"{type(attn).__name__}.{other} is a {type(children[other]).__name__}, not an nn.Linear: "
                        "torch's TP styles shard nn.Linear")
    if reshape := _global_head_reshape(type(attn)):
        raise PlanError(f"{type(attn).__name__} reshapes with the global head count ({reshape}), "
                        "but TP leaves each rank 1/TP of the heads: its attention code needs a patch")
    plan = {f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
    for name, module in children.items():
        if NORM.search(type(module).__name__) and getattr(module, "weight", None) is not None:  # else no gradient
            width = module.weight.shape[-1]
            if width != attn.head_dim:
                raise PlanError(f"{type(attn).__name__}.{name} normalizes {width} features across heads "
                                f"(head_dim {attn.head_dim}): under TP each rank would normalize its own heads only")
            plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


@functools.cache  # one parse per attention class, not per block
def _global_head_reshape(attention_class: type) -> str | None:
    """A view or reshape in attention's forward sized by the model's head count or width
    (stablelm's `view(bsz, q_len, self.num_heads, self.head_dim)`), not by -1."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(attention_class.forward)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("view", "reshape") and any(
                isinstance(a, ast.Attribute) and a.attr in ("num_heads", "num_key_value_heads", "hidden_size")
                for arg in node.args for a in ast.walk(arg)):
            return ast.unparse(node)
    return None


def mlp_plan(mlp: nn.Module) -> dict:
    """The MLP's input projections column-wise, its output projection row-wise back to Shard(1)."""
    linears = [name for name, module in mlp.named_children() if isinstance(module, nn.Linear)]
    unknown = [name for name in linears if name not in MLP_PROJECTIONS]
    if not linears:
        raise PlanError(f"{type(mlp).__name__} has no nn.Linear projection (experts?) for the plan to shard")
    if unknown:
        raise PlanError(f"{type(mlp).__name__}.{unknown[0]} is not one of {', '.join(MLP_PROJECTIONS)}: "
                        "column-wise TP would split a fused projection (gate_up_proj) across its parts")
    return {f"mlp.{name}": ColwiseParallel() if MLP_PROJECTIONS[name] == "in" else RowwiseParallel(output_layouts=Shard(1))
            for name in linears}


def require_llama_layout_and_sdpa(model: nn.Module) -> None:
    """The module names the plan uses, every block's included; and SDPA: under sequence parallel HF
    builds an attention mask from each rank's 1/TP of the sequence, SDPA with none runs is_causal."""
    blocks = getattr(getattr(model, "model", None), "layers", [])
    for name in ("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                 *(f"model.layers.{i}.{part}" for i in range(len(blocks)) for part in ("self_attn", "mlp"))):
        try:
            model.get_submodule(name)
        except AttributeError:
            raise PlanError(f"{type(model).__name__} has no {name}: the plan names HF's Llama layout") from None
    if (impl := model.config._attn_implementation) != "sdpa":
        raise PlanError(f"{type(model).__name__} runs attention as {impl!r}; the TP plan needs 'sdpa' (no mask)")


def refuse_unplanned_parameters(block: nn.Module, prefix: str) -> None:
    """After the plan, every parameter of a block is a DTensor; a plain one would keep only its
    rank's part of the gradient, and nothing would sum it."""
    plain = [name for name, p in block.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise PlanError(f"{prefix}.{plain[0]} is not in the TP plan: its gradient would hold this rank's "
                        "tokens or heads only")


def _attention_input_plan(decoder_layer: str, attention_gather: str) -> dict:
    """Where attention's input is gathered from Shard(1) to Replicate. "pre_hook": a positional
    PrepareModuleInput (the vendored layer), or a kwargs one (the stock layer: one recompile
    per block on torch <= 2.10, pytorch/pytorch#170110). "norm_output": none here, see apply_tp."""
    if attention_gather == "norm_output":
        return {}
    if decoder_layer == "positional":
        return {"self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return {"self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},  # "stock"
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})}


def apply_ac(model: LlamaForCausalLM, mode: str, selective_option: str, compile_enabled: bool) -> None:
    """torchtitan's `apply_ac`, which wraps each child of `model.model.layers`."""
    titan_apply_ac(model.model, ACConfig(mode=mode, selective_ac_option=selective_option),
                   model_compile_enabled=compile_enabled, op_sac_save_list=OP_SAC_SAVE_LIST)


def apply_compile(model: LlamaForCausalLM, backend: str) -> None:
    """torchtitan's `apply_compile`: `torch.compile(block, fullgraph=True)` per block. All
    blocks run the same code, so Dynamo can serve them all from one graph."""
    titan_apply_compile(model.model, CompileConfig(enable=True, backend=backend))


def apply_fsdp(model: LlamaForCausalLM, dp_mesh: DeviceMesh, param_dtype: str, reduce_dtype: str) -> None:
    """FSDP2: torchtitan 0.2.2's `apply_fsdp` (no PP, "default" reshard) on HF names. The embedding, each
    block, final norm + lm_head as one group (not resharded: backward needs them first; tied, with the
    embedding), then the root. Gradients keep FSDP's average over the dp ranks (README, "Other launches")."""
    _silence_fsdp_view_output_warning()
    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype))
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    tied = model.config.tie_word_embeddings  # a shared parameter belongs to one group (torchtitan's qwen3)
    if not tied:
        fully_shard(model.model.embed_tokens, **fsdp_config, reshard_after_forward=True)
    for block in model.model.layers:
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    fully_shard([model.model.embed_tokens] * tied + [model.model.norm, model.lm_head], **fsdp_config,
                reshard_after_forward=False)
    fully_shard(model, **fsdp_config)


# -----------------------------------------------------------------------------
# Library workarounds: one named function each, with the versions it was seen on


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


def _set_titan_mesh_device_type(device_type: str) -> None:
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


def _silence_fsdp_view_output_warning() -> None:
    """Workaround, torch 2.14.1 and 2.15.0 (2.10.0 and 2.11.0 have no such warning): with loss parallel
    off, FSDP2 warns on every rank and step that a module returned a view (an in-place op on it would
    skip a hook). The views are TP's all-gathered logits, which only the loss reads."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
