"""A TP plan for any HF decoder family, derived from the modules its blocks hold; the refusals of
what it cannot make correct; and what FSDP2 needs for its fused weights (their rows: hf_layout.py). For Llama blocks
it gives parallelize.LLAMA_BLOCK_PLAN (test_recompile). RESULTS.md, "Recipe B's reach": 66 families.

With README's `plan`, recipe B and `both`: require_llama_layout_and_masks(model), parallelize_top, then
parallelize_blocks with block_plan(block, "norm_output") (Qwen3.5: one per layer kind), AC,
hybrid_plan.a_frame_of_their_own(model.model.layers), per-block compile, FSDP2 with
shard_placement_fn=fsdp_shard_placement; DCP through hf_layout.in_hf_layout and in_plan_layout."""

import ast
import copy
import functools
import inspect
import re
import textwrap

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from hf_layout import RowsByParts
from hybrid_plan import GATED_DELTANETS, linear_attention_plan


class PlanError(ValueError):
    """What the TP plan cannot make correct, raised before it changes the model."""


NORM = re.compile(r"(RMS|Layer)Norm")  # HF's norm classes: LlamaRMSNorm, CohereLayerNorm, nn.LayerNorm
ATTENTION_NORMS = ("input_layernorm", "attention_layernorm")  # the norm whose output attention reads
MLP_PROJECTIONS = {"gate_proj": "in", "up_proj": "in", "c_fc": "in", "fc1": "in",
                   "down_proj": "out", "c_proj": "out", "fc2": "out", "gate_up_proj": "in"}
FUSED_PARTS = {"gate_up_proj": 2, "qkv_proj": 3}  # HF's fused projections: [gate; up], [q; k; v]
FULL_SEQUENCE_MASKS = ("full_attention", "sliding_attention", "linear_attention")  # forward_logits's layer types
# HF's layers pass attention's input by keyword: a with_kwargs pre-hook, whose id Dynamo guards on
# per block on torch <= 2.10 (pytorch/pytorch#170110), a recompile per block there.
KWARGS_ATTENTION_INPUT = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})


def block_plan(block: nn.Module, attention_gather: str) -> dict:
    """One block's plan but attention's input (parallelize.block_plan adds it); PlanError for what it
    cannot make correct. Every norm outside attention and the MLP is SequenceParallel, found by type,
    so that TP sums its gradient; its output stays a DTensor where attention gathers its input. A
    post-norm block (olmo2) has no such norm: attention gathers by keyword (KWARGS_ATTENTION_INPUT)."""
    gather_at = attention_norm(block) if attention_gather == "norm_output" else "input_layernorm"
    if hasattr(block, "linear_attn") and not isinstance(block.linear_attn, GATED_DELTANETS):
        raise PlanError(f"{type(block.linear_attn).__name__} is not Qwen3.5's Gated DeltaNet, the linear attention "
                        "hybrid_plan shards by heads")
    norms = [name for name, module in block.named_children() if NORM.search(type(module).__name__)]
    plan = {
        **{name: SequenceParallel(use_local_output=name != gather_at) for name in norms},
        **(linear_attention_plan(block.linear_attn) if hasattr(block, "linear_attn") else attention_plan(block.self_attn)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **mlp_plan(block.mlp),
    }
    if gather_at is None:
        plan["self_attn"] = KWARGS_ATTENTION_INPUT
    if (isinstance(plan.get("self_attn"), LocalHeads) or "linear_attn" in plan) and attention_gather != "norm_output":
        raise PlanError(f"{type(block).__name__}'s attention counts each rank's heads where a pre-hook plan puts "
                        "its input: gather at the norm's output (recipe B)")
    return plan


def attention_norm(block: nn.Module) -> str | None:
    """The norm whose output attention reads: where recipe B gathers; None in a post-norm block."""
    return next((name for name in ATTENTION_NORMS if hasattr(block, name)), None)


def attention_plan(attn: nn.Module) -> dict:
    """q, k, v column-wise (phi3's fused qkv_proj as `fused_colwise`), o row-wise back to
    Shard(1); a per-head q/k norm as torchtitan's HF backend plans Qwen3's (each rank holds its own
    heads on dim 2, the weight's gradient summed); LocalHeads where attention counts its heads."""
    name, children = type(attn).__name__, dict(attn.named_children())
    fused = "qkv_proj" in children
    projections = ("qkv_proj", "o_proj") if fused else ("q_proj", "k_proj", "v_proj", "o_proj")
    if missing := [p for p in projections if p not in children]:
        raise PlanError(f"{name} has no {', '.join(missing)} (it has {', '.join(children)}): "
                        "column-wise TP would split a fused projection across q, k and v")
    if other := next((p for p in projections if not isinstance(children[p], nn.Linear)), None):
        raise PlanError(f"{name}.{other} is a {type(children[other]).__name__}, not an nn.Linear: "
                        "torch's TP styles shard nn.Linear")
    if fused and (heads := attn.config.num_attention_heads) != (kv_heads := attn.config.num_key_value_heads):
        raise PlanError(f"{name}.qkv_proj fuses {heads} query heads with {kv_heads} key/value heads: "
                        "no one placement gives a rank its query heads and their key/value heads")
    plan = {f"self_attn.{p}": fused_colwise(children[p], p) if p in FUSED_PARTS else ColwiseParallel() for p in projections[:-1]}
    plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
    if counts := "qkv_proj's slices" if fused else _global_head_reshape(type(attn)):
        if per_head := next((n for n, m in children.items() if n not in projections and
                             getattr(m, "weight", None) is None and next(m.parameters(), None) is not None), None):
            raise PlanError(f"{name}.{per_head} holds one module per head, indexed by the global head count "
                            f"({counts}): LocalHeads would leave each rank the first 1/TP of them")
        plan["self_attn"] = LocalHeads()
    sharded = {children[p].out_features for p in projections[:-1]} | {children["o_proj"].in_features}
    return {**plan, **norms_plan(attn, "self_attn", {attn.head_dim: SequenceParallel(sequence_dim=2, use_local_output=True),
                                                     **dict.fromkeys(sharded, NormAcrossShards())})}


def norms_plan(parent: nn.Module, prefix: str, style_by_width: dict) -> dict:
    """Styles for the norms inside attention or the MLP, by the width they normalize: one head
    (Qwen3's q_norm), or every feature TP shards (olmo2's q_norm, bitnet's sub-norms)."""
    plan = {}
    for child, module in parent.named_children():
        if NORM.search(type(module).__name__) and getattr(module, "weight", None) is not None:  # else no gradient
            if (width := module.weight.shape[-1]) not in style_by_width:
                raise PlanError(f"{type(parent).__name__}.{child} normalizes {width} features, neither one head nor "
                                f"what TP shards ({', '.join(map(str, style_by_width))})")
            plan[f"{prefix}.{child}"] = style_by_width[width]
    return plan


class NormAcrossShards(ParallelStyle):
    """A norm over features that TP shards (olmo2's q_norm across heads, bitnet's sub-norms): it
    runs on their Shard(-1) DTensor with its weight Shard(0), so that its mean reduces across ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_weights(_name, norm, mesh):
            for key, param in list(norm.named_parameters(recurse=False)):
                norm.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))
        return distribute_module(
            module, device_mesh, shard_weights,
            lambda _norm, inputs, mesh: (DTensor.from_local(inputs[0], mesh, [Shard(-1)], run_check=False), *inputs[1:]),
            lambda _norm, output, mesh: output.redistribute(mesh, [Shard(-1)]).to_local())


def fused_colwise(linear: nn.Linear, name: str) -> RowsByParts:
    """A fused projection ([gate; up], MHA's [q; k; v]) column-wise: rank r computes the r-th 1/TP of each
    part, so that HF's split of its output is right (hf_layout.RowsByParts)."""
    return RowsByParts((linear.out_features // FUSED_PARTS[name],) * FUSED_PARTS[name])


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's `shard_placement_fn`: Shard(1) (a conv1d's last dim) for RowsByParts's weights, whose rows TP
    holds by parts (hf_layout.in_hf_layout reorders them within TP's group alone); else FSDP's Shard(0)."""
    return Shard(param.ndim - 1) if getattr(param, "rows_by_parts", None) else None


class LocalHeads(ParallelStyle):
    """For attention that slices or reshapes by its head counts (phi3's qkv, stablelm's view):
    each rank's counts, its own and its config's divided by TP; one config copy for every block,
    so that Dynamo serves them all from one graph."""
    configs = {}  # (id(config), tp): (config, its per-rank copy)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        for name in ("num_heads", "num_key_value_heads"):
            if hasattr(module, name):
                setattr(module, name, getattr(module, name) // tp)
        if (key := (id(module.config), tp)) not in self.configs:
            local = copy.copy(module.config)
            local.num_attention_heads, local.num_key_value_heads = local.num_attention_heads // tp, local.num_key_value_heads // tp
            self.configs[key] = (module.config, local)
        module.config = self.configs[key][1]
        return module


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
    """The MLP's input projections column-wise (a fused [gate; up] as `fused_colwise`), its
    output projection row-wise back to Shard(1)."""
    linears = [name for name, module in mlp.named_children() if isinstance(module, nn.Linear)]
    if not linears:
        raise PlanError(f"{type(mlp).__name__} has no nn.Linear projection (experts?) for the plan to shard")
    if unknown := [name for name in linears if name not in MLP_PROJECTIONS]:
        raise PlanError(f"{type(mlp).__name__}.{unknown[0]} is not one of {', '.join(MLP_PROJECTIONS)}: "
                        f"column-wise TP would split a fused projection ({unknown[0]}) across its parts")
    out = next(getattr(mlp, name) for name in linears if MLP_PROJECTIONS[name] == "out")
    return {**{f"mlp.{name}": RowwiseParallel(output_layouts=Shard(1)) if MLP_PROJECTIONS[name] == "out" else
               fused_colwise(getattr(mlp, name), name) if name in FUSED_PARTS else ColwiseParallel()
               for name in linears}, **norms_plan(mlp, "mlp", {out.in_features: NormAcrossShards()})}


def require_llama_layout_and_masks(model: nn.Module) -> None:
    """The module names the plan uses, every block's included; and masks that forward_logits can
    build for the whole sequence (under sequence parallel HF builds them from each rank's 1/TP):
    SDPA or eager attention, full or sliding-window layers, causal."""
    blocks = getattr(getattr(model, "model", None), "layers", [])
    mixer = lambda block: "linear_attn" if hasattr(block, "linear_attn") else "self_attn"  # noqa: E731 (Qwen3.5's)
    for name in ("model.embed_tokens", "model.layers", "model.norm", "lm_head",
                 *(f"model.layers.{i}.{part}" for i, block in enumerate(blocks) for part in (mixer(block), "mlp"))):
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


def refuse_unplanned_parameters(block: nn.Module, prefix: str) -> None:
    """After the plan, every parameter of a block is a DTensor; a plain one would keep only its
    rank's part of the gradient, and nothing would sum it."""
    plain = [name for name, p in block.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise PlanError(f"{prefix}.{plain[0]} is not in the TP plan: its gradient would hold this rank's "
                        "tokens or heads only")
