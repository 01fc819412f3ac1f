"""A TP plan for any HF decoder family, derived from the modules its blocks hold, and the refusals
of what such a plan cannot make correct (RESULTS.md, "Recipe B's reach": 66 families). For Llama
blocks the derivation gives parallelize.LLAMA_BLOCK_PLAN (test_recompile); apply_tp uses it for
every other family, and its refusals for every model.
"""

import ast
import functools
import inspect
import re
import textwrap

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


class PlanError(ValueError):
    """What the TP plan cannot make correct, raised before it changes the model."""


NORM = re.compile(r"(RMS|Layer)Norm")  # HF's norm classes: LlamaRMSNorm, CohereLayerNorm, nn.LayerNorm
ATTENTION_NORMS = ("input_layernorm", "attention_layernorm")  # the norm whose output attention reads
MLP_PROJECTIONS = {"gate_proj": "in", "up_proj": "in", "c_fc": "in", "fc1": "in",
                   "down_proj": "out", "c_proj": "out", "fc2": "out"}


def block_plan(block: nn.Module, attention_gather: str) -> dict:
    """One block's plan but attention's input (parallelize.block_plan adds it), from the modules it
    holds; PlanError for what it cannot make correct. Every norm outside attention and the MLP is
    SequenceParallel, found by type, so that its weight's gradient is summed over the TP group (an
    unplanned norm trains on its rank's tokens only, in silence). Its output stays a DTensor where
    attention's input is gathered, and is a plain tensor elsewhere (a residual add)."""
    gather_at = attention_norm(block) if attention_gather == "norm_output" else "input_layernorm"
    norms = [name for name, module in block.named_children() if NORM.search(type(module).__name__)]
    return {
        **{name: SequenceParallel(use_local_output=name != gather_at) for name in norms},
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


def require_llama_layout_and_masks(model: nn.Module) -> None:
    """The module names the plan uses, every block's included; and masks that forward_logits can
    build for the whole sequence (under sequence parallel HF builds them from each rank's 1/TP):
    SDPA or eager attention, full or sliding-window layers, causal."""
    blocks = getattr(getattr(model, "model", None), "layers", [])
    for name in ("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                 *(f"model.layers.{i}.{part}" for i in range(len(blocks)) for part in ("self_attn", "mlp"))):
        try:
            model.get_submodule(name)
        except AttributeError:
            raise PlanError(f"{type(model).__name__} has no {name}: the plan names HF's Llama layout") from None
    config, name = model.config, type(model).__name__
    if (impl := config._attn_implementation) not in ("sdpa", "eager"):
        raise PlanError(f"{name} runs attention as {impl!r}; the TP plan's full-sequence masks are for 'sdpa' and 'eager'")
    if other := sorted(set(getattr(config, "layer_types", None) or ()) - set(FULL_SEQUENCE_MASKS)):
        raise PlanError(f"{name} has {other[0]} layers, whose mask HF would build from each rank's seq_len/TP "
                        f"tokens: full-sequence masks are built for {' and '.join(FULL_SEQUENCE_MASKS)} layers")
    if getattr(config, "use_bidirectional_attention", False):
        raise PlanError(f"{name} sets use_bidirectional_attention (sliding_window {config.sliding_window}): "
                        "the full-sequence masks are causal")


FULL_SEQUENCE_MASKS = ("full_attention", "sliding_attention")  # the layer types forward_logits builds masks for


def refuse_unplanned_parameters(block: nn.Module, prefix: str) -> None:
    """After the plan, every parameter of a block is a DTensor; a plain one would keep only its
    rank's part of the gradient, and nothing would sum it."""
    plain = [name for name, p in block.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise PlanError(f"{prefix}.{plain[0]} is not in the TP plan: its gradient would hold this rank's "
                        "tokens or heads only")
