"""The Hugging Face Llama, with a decoder layer that Tensor Parallel can hook without kwargs.

HF's `LlamaDecoderLayer` calls `self.self_attn(hidden_states=...)` by keyword, so a TP plan
needs a `with_kwargs=True` pre-hook on attention, which torch <= 2.10 Dynamo guards on by id:
one recompile per block (pytorch/pytorch#170110, fixed by #172519 in 2.11).
`PositionalLlamaDecoderLayer` passes `hidden_states` positionally instead (README, "The fix to copy").
"""

import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig
from transformers.masking_utils import (create_causal_mask, create_recurrent_attention_mask,
                                        create_sliding_window_causal_mask)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
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


def hf_config(model_cfg: dict) -> PretrainedConfig:
    """[model] as its transformers config: config.toml's Llama keys, or an HF folder's whole config.json
    with its model_type (hub_folder.read). For the model, its parameter count and the HF export."""
    if "model_type" in model_cfg:
        return AutoConfig.for_model(**model_cfg)
    return LlamaConfig(**model_cfg, architectures=[LlamaForCausalLM.__name__])


def build_model(model_cfg: dict, decoder_layer: str = "positional"):
    """A randomly initialised `*ForCausalLM` of [model]'s family, in float32. A Llama's blocks are
    `DECODER_LAYERS[decoder_layer]`; the positional layer adds no state, so one seed gives the same
    weights with either layer. Other families keep their own layer: recipe B needs no hook on it."""
    config = hf_config(model_cfg)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    if isinstance(model, LlamaForCausalLM):
        for block in model.model.layers:
            block.__class__ = DECODER_LAYERS[decoder_layer]
        # Device maps (from_pretrained(device_map=...)) keep whole only the layers named here, by class name.
        model._no_split_modules.add(DECODER_LAYERS[decoder_layer].__name__)
    return model


# The masks forward_logits builds, by HF's layer type (config.layer_types).
MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask,
         "linear_attention": create_recurrent_attention_mask}


def forward_logits(model, input_ids, position_ids=None):
    """Logits, with position_ids and masks for the whole sequence (under SP, HF would build them from each
    rank's 1/TP). Packed documents: position_ids restart at each, the masks are block-causal (batch x seq_len²)."""
    packed = position_ids is not None
    if not packed:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    shape = torch.empty(*input_ids.shape, 0, dtype=model.dtype, device=input_ids.device)  # batch, length, dtype
    kinds = getattr(model.config, "layer_types", None)  # then HF takes a dict by kind
    one_kind = "full_attention" if getattr(model.config, "sliding_window", None) is None else "sliding_attention"
    masks = {kind: MASKS[kind](model.config, shape, None, None, position_ids=position_ids, allow_is_causal_skip=not packed)
             for kind in set(kinds or [one_kind])}
    if packed:  # HF expands a batch without restarts from one row: the compiled blocks' guards want one layout
        masks = {kind: mask if mask is None else mask.contiguous() for kind, mask in masks.items()}
    hybrid = packed and "linear_attention" in masks  # Qwen3.5's linear attention's too
    documents = {"seq_idx": (position_ids == 0).cumsum(-1, dtype=torch.int32)} if hybrid else {}
    return model(input_ids=input_ids, attention_mask=masks if kinds else masks[one_kind],
                 position_ids=position_ids, use_cache=False, **documents).logits
