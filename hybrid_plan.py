"""What only hybrid families need (Qwen3.5's Gated DeltaNet beside gated attention): the linear-attention
layer's TP plan, by heads; and packed documents kept apart in its convolution and recurrent state."""

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers.models.qwen3_5 import modeling_qwen3_5

from hf_layout import RowsByParts


GATED_DELTANETS = (modeling_qwen3_5.Qwen3_5GatedDeltaNet,)  # the linear attention linear_attention_plan knows


def linear_attention_plan(gdn: nn.Module) -> dict:
    """Gated DeltaNet by heads: rank r computes its key heads and their value heads and nothing else. The
    input is attention's (gathered at the norm's output); the projections' outputs stay this rank's heads
    through the convolution, the gated delta rule and the gated norm; out_proj reduce-scatters to Shard(1)."""
    keep_documents_apart_in_linear_attention()  # its kernels take this plan's DTensors as this rank's heads
    parts = (gdn.key_dim, gdn.key_dim, gdn.value_dim)  # in_proj_qkv's and conv1d's rows: [q; k; v]
    return {
        "linear_attn": LinearAttentionHeads(),
        "linear_attn.in_proj_qkv": RowsByParts(parts),
        "linear_attn.conv1d": RowsByParts(parts),
        "linear_attn.in_proj_z": ColwiseParallel(),
        "linear_attn.in_proj_a": ColwiseParallel(use_local_output=False),  # with A_log and dt_bias: g, a DTensor
        "linear_attn.in_proj_b": ColwiseParallel(use_local_output=False),
        "linear_attn.norm": NormPerHead(),
        "linear_attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


class LinearAttentionHeads(ParallelStyle):
    """Each rank's head counts and widths, which HF's forward splits by; A_log and dt_bias (one per value
    head) Shard(0), as in_proj_a's and in_proj_b's outputs, with which they make the decay g."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim"):
            setattr(module, name, getattr(module, name) // tp)
        for name in ("A_log", "dt_bias"):
            module.register_parameter(name, nn.Parameter(distribute_tensor(getattr(module, name), device_mesh, [Shard(0)])))
        return module


class NormPerHead(ParallelStyle):
    """The gated RMS norm over each value head's features: its weight replicated, its two inputs (the
    heads' outputs and their gates, one row per token and head) Shard(0), so that TP sums its gradient."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, None,
            lambda _norm, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False) for x in inputs),
            lambda _norm, output, mesh: output.to_local())


# The decay at a document's first token: the state before it times e^-40 (4e-18), nothing in float32; the
# chunked rule only takes differences of its cumulative decays, so no exp(40) overflows.
RESTART = -40.0


def keep_documents_apart_in_linear_attention() -> None:
    """Workaround, transformers 5.24.0: Qwen3.5's torch kernels (`causal_conv1d_fn`, `torch_chunk_gated_delta_rule`)
    cannot keep packed documents apart. Given position_ids alone, their convolution window and recurrent state run
    on into the next document; given cu_seqlens or seq_idx, transformers refuses them without causal-conv1d and
    flash-linear-attention, GPU kernels (modelscope/ms-swift#9565; torchtitan's own Qwen3.5: pytorch/torchtitan#3892).
    The two, replaced once: given `seq_idx` (each token's document, model.forward_logits), the convolution sums
    only its own document's taps, and the library's chunked rule gets a decay of RESTART at each document's first
    token, which multiplies the state before it by e^-40. Both take linear_attention_plan's DTensors as this
    rank's heads. test_hybrid.py says when this can go."""
    if getattr(modeling_qwen3_5.causal_conv1d_fn, "by_document", False):
        return
    library_conv, library_rule = modeling_qwen3_5.causal_conv1d_fn, modeling_qwen3_5.torch_chunk_gated_delta_rule

    def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        weight = local(weight)  # TP's (linear_attention_plan): this rank's heads
        if seq_idx is None:
            return library_conv(x, weight, bias, activation, **kwargs)
        return causal_conv1d_by_document(x, weight, bias, activation, seq_idx)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, seq_idx=None, **kwargs):
        g, beta = local(g), local(beta)  # g: [batch, length, heads], the log of the state's decay at each token
        if seq_idx is not None:
            first = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True)
            g = g.masked_fill(first[..., None], RESTART)
        return library_rule(query, key, value, g, beta, **kwargs)

    causal_conv1d_fn.by_document = True
    modeling_qwen3_5.causal_conv1d_fn, modeling_qwen3_5.torch_chunk_gated_delta_rule = causal_conv1d_fn, torch_chunk_gated_delta_rule


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A TP-sharded argument (linear_attention_plan's) as this rank's heads, its gradient sent back
    contiguous: the chunked rule's transposes would leave the gradient of in_proj_a's and in_proj_b's
    outputs a transposed DTensor, which their linear's backward views (`view size is not compatible`)."""
    return ContiguousGradient.apply(tensor).to_local() if isinstance(tensor, DTensor) else tensor


class ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


def causal_conv1d_by_document(x, weight, bias, activation, seq_idx):
    """transformers' depthwise causal convolution ([batch, channels, length], weight [channels, width]),
    each output summing only the inputs of its own document: tap j (j tokens back) where seq_idx agrees."""
    width, length = weight.shape[-1], x.shape[-1]
    padded, doc = F.pad(x.to(weight.dtype), (width - 1, 0)), F.pad(seq_idx, (width - 1, 0), value=-1)
    out = sum(weight[:, width - 1 - j, None] * padded[..., width - 1 - j:width - 1 - j + length]
              * (doc[:, width - 1 - j:width - 1 - j + length] == seq_idx)[:, None] for j in range(width))
    out = out if bias is None else out + bias[:, None]
    return (F.silu(out) if activation in ("silu", "swish") else out).to(x.dtype)


def a_frame_of_their_own(blocks: nn.ModuleList) -> None:
    """Before per-block compile: linear-attention blocks call a copy of their forward's code. Dynamo
    caches a frame by its code, which every block shares (transformers' `forward_with_checkpointing`,
    or AC's wrapper), so the second layer kind would count as a recompile of the first; this way each
    kind compiles once, into a graph of its own."""
    copy = None
    for block in blocks:
        if hasattr(block, "linear_attn"):  # through AC's wrapper too
            forward = type(block).forward
            copy = copy or types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                              forward.__defaults__, forward.__closure__)
            block.forward = types.MethodType(copy, block)
