"""The Hugging Face Llama, with a decoder layer that Tensor Parallel can hook without kwargs.

HF's `LlamaDecoderLayer` calls `self.self_attn(hidden_states=...)` by keyword, so a TP plan
needs a `with_kwargs=True` pre-hook on attention, which torch <= 2.10 Dynamo guards on by id:
one recompile per block (pytorch/pytorch#170110, fixed by #172519 in 2.11).
`PositionalLlamaDecoderLayer` passes `hidden_states` positionally instead (README, "The fix to copy").
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils.deprecation import deprecate_kwarg


class PositionalLlamaDecoderLayer(LlamaDecoderLayer):
    """transformers 5.24.0 `LlamaDecoderLayer.forward`, with `self_attn(hidden_states, ...)`.

    Subclassing keeps HF's `GradientCheckpointingLayer.__call__` and every weight name.
    test_recompile.py checks that this copy still matches the installed transformers.
    """

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states,  # positional: the one change from HF, see the module docstring
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


DECODER_LAYERS = {"positional": PositionalLlamaDecoderLayer, "stock": LlamaDecoderLayer}


def hf_config(model_cfg: dict) -> LlamaConfig:
    """[model] as transformers' `LlamaConfig`: for the model, its parameter count and the HF export."""
    return LlamaConfig(**model_cfg, architectures=[LlamaForCausalLM.__name__])


def build_model(model_cfg: dict, decoder_layer: str = "positional") -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM` whose blocks are `DECODER_LAYERS[decoder_layer]`.
    The positional layer adds no state, so one seed gives the same weights with either layer."""
    model = LlamaForCausalLM(hf_config(model_cfg))
    for block in model.model.layers:
        block.__class__ = DECODER_LAYERS[decoder_layer]
    # Device maps (from_pretrained(device_map=...)) keep whole only the layers named here, by class name.
    model._no_split_modules.add(DECODER_LAYERS[decoder_layer].__name__)
    return model


def forward_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits for (batch, seq_len) token ids. Under sequence parallel each block sees 1/TP of the
    sequence, and HF would derive `position_ids` from that local length: pass the full ones. No
    mask: SDPA runs with `is_causal=True` over the all-gathered sequence."""
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
