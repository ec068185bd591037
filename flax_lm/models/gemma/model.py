"""Gemma 2 and Gemma 3 (text) in Flax: the embedding scaled by sqrt(width), a GeGLU MLP, RMSNorm that stores its
weight less one, each block's attention and MLP normalized before and after, local (sliding-window) and global layers
as layer_types says, attention scaled by query_pre_attn_scalar; Gemma 2's soft-capped attention and final logits,
Gemma 3's RMSNorm of each query and key head and its rotary settings for each layer type. Parameter names and layouts
are one-to-one with transformers' Gemma2ForCausalLM and Gemma3ForCausalLM; a key/value cache decodes.

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import flax.linen as nn
import jax

from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    CausalDecoderLM,
    DecoderPart,
    GatedMLP,
    KeyValueCache,
    check_decoder_config,
    check_rope,
    decoder_shapes,
    from_hf_state_dict,
    hf_shapes,
    layer_windows,
    linear_shapes,
    refuse_foreign_keys,
    rope_parameters,
    rotary_frequencies,
    rotate,
    to_hf_state_dict,
)

# The config.model_type values this module computes -> the transformers class whose checkpoint layout the
# parameters map onto, named in an exported config.json.
HF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/README.md).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]


def layer_rope(config, layer_index: int) -> dict:
    """The rotary settings of a layer: Gemma 3 keeps one set for each layer type (a slower rotation for the global
    layers), Gemma 2 one for all."""
    layer_type = config.layer_types[layer_index]
    by_type = getattr(config, "rope_parameters", None) or {}
    if isinstance(by_type.get(layer_type), dict):
        rope = dict(by_type[layer_type])
        rope.setdefault("rope_type", "default")
        return rope
    return rope_parameters(config)


def normalizes_heads(config) -> bool:
    """Whether each query and key head is RMS-normalized before its rotation (Gemma 3's q_norm and k_norm)."""
    return config.model_type == "gemma3_text"


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/gemma/model.py was given a config of model type '{config.model_type}'")
    check_decoder_config(config, "flax_lm/models/gemma/model.py", mesh, activation_key="hidden_activation")
    if config.model_type == "gemma3_text":  # its config has the field, but Gemma3ForCausalLM's attention ignores it
        refuse_foreign_keys(config, ("attn_logit_softcapping",), "gemma3_text")
    for index, layer_type in enumerate(config.layer_types):
        check_rope(layer_rope(config, index), "flax_lm/models/gemma/model.py", f"rope_parameters of {layer_type}")
    if getattr(config, "use_bidirectional_attention", None):
        raise UsageError(
            "use_bidirectional_attention is not implemented by flax_lm/models/gemma/model.py (it computes causal "
            "attention); set it to false"
        )


class GemmaPart(DecoderPart):
    """Base of the model's parts: Gemma's RMSNorm, x normalized times (1 + weight), in float32."""

    NORM_STYLE = {"unit_offset": True}


class GemmaAttention(GemmaPart):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        query, key, value = self.head_projections(x, config.attention_bias)
        if normalizes_heads(config):
            query = self.rms_norm("q_norm", logical_axis=None)(query)
            key = self.rms_norm("k_norm", logical_axis=None)(key)
        frequencies = rotary_frequencies(layer_rope(config, self.layer_index), config.head_dim)
        query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        scale = config.query_pre_attn_scalar**-0.5
        window, softcap = layer_windows(config)[self.layer_index], config.attn_logit_softcapping
        y, layer_cache = self.attend(query, key, value, scale, cache, self.layer_index, segment_ids, window, softcap)
        y = self.dense(config.hidden_size, ("heads", "embed"), config.attention_bias, "o_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class GemmaDecoderLayer(GemmaPart):
    """x + norm(attention(norm(x))), then x + norm(mlp(norm(x))): each sublayer normalized before and after."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(GemmaAttention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + self.rms_norm("post_attention_layernorm")(y)
        mlp = self.child(GatedMLP, "mlp", activation=self.config.hidden_activation)
        y = mlp(self.rms_norm("pre_feedforward_layernorm")(x))
        return x + self.rms_norm("post_feedforward_layernorm")(y), layer_cache


class FlaxGemmaForCausalLM(CausalDecoderLM):
    """Gemma 2 or 3 with its language-model head (the embedding, as published): see CausalDecoderLM."""

    LAYER_CLASS = GemmaDecoderLayer
    SCALED_EMBEDDING = True


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxGemmaForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of the transformers class of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head. From the config alone, so that it holds whatever is done to
    the Flax model."""
    width, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    heads, key_value_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias

    def layer_shapes(layer: str) -> dict:
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        shapes = linear_shapes(f"{attention}.q_proj", width, heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.k_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.v_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * head_dim, width, bias)
        if normalizes_heads(config):
            shapes |= {f"{attention}.q_norm.weight": (head_dim,), f"{attention}.k_norm.weight": (head_dim,)}
        shapes |= linear_shapes(f"{mlp}.gate_proj", width, inner, False)
        shapes |= linear_shapes(f"{mlp}.up_proj", width, inner, False)
        shapes |= linear_shapes(f"{mlp}.down_proj", inner, width, False)
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        return shapes | {f"{layer}.{norm}.weight": (width,) for norm in norms}

    return decoder_shapes(config, layer_shapes)
