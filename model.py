"""The Hugging Face Llama, with a decoder layer that Tensor Parallel can hook without kwargs.

HF's `LlamaDecoderLayer.forward` calls `self.self_attn(hidden_states=hidden_states, ...)` by
keyword. A TP plan for that call needs `PrepareModuleInput(input_kwarg_layouts=...)`, which
registers a `with_kwargs=True` forward pre-hook on every attention module. On torch <= 2.10
Dynamo guards on that hook's id (`___dict_contains(<id>, ..._forward_pre_hooks_with_kwargs)`),
every block has another id, and each block recompiles until `recompile_limit`
(pytorch/pytorch#170110, fixed by #172519 in 2.11).

`PositionalLlamaDecoderLayer` is HF's forward with one change: `hidden_states` is passed
positionally, so a positional `PrepareModuleInput` fits and no kwargs hook exists at all.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils.deprecation import deprecate_kwarg


class PositionalLlamaDecoderLayer(LlamaDecoderLayer):
    """transformers 5.24.0 `LlamaDecoderLayer.forward`, with `self_attn(hidden_states, ...)`.

    Subclassing keeps HF's `GradientCheckpointingLayer.__call__` and every weight name;
    only the call into attention differs. test_recompile.py checks that this copy still
    matches the installed transformers.
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


def build_model(model_cfg: dict, decoder_layer: str = "positional") -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM` whose blocks are `DECODER_LAYERS[decoder_layer]`.

    The positional layer adds no state to HF's, so switching each block's class keeps the
    weights HF initialised: the same seed gives the same model with either layer.
    """
    config = LlamaConfig(**model_cfg, use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    for block in model.model.layers:
        block.__class__ = DECODER_LAYERS[decoder_layer]
    return model


def forward_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits for a batch of token ids of shape (batch, seq_len).

    Under sequence parallel each block sees 1/TP of the sequence, and HF would derive
    `position_ids` (and so the rotary embeddings) from that local length. The full-sequence
    positions are passed here instead. No attention mask is passed: SDPA then runs with
    `is_causal=True` over the whole, all-gathered sequence.
    """
    seq_len = input_ids.shape[1]
    position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
