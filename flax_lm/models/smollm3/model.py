"""SmolLM3 in Flax: Llama's block (RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention) with no rotary
positions in some layers (NoPE: no_rope_layers, every fourth layer by default), biases on all four attention
projections with attention_bias, and sliding windows where use_sliding_window is set. Parameter names and layouts are
one-to-one with transformers' SmolLM3ForCausalLM; a key/value cache decodes.

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import math

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
    head_dim_of,
    hf_shapes,
    layer_windows,
    linear_shapes,
    refuse_foreign_keys,
    rope_parameters,
    rotary_frequencies,
    rotate,
    to_hf_state_dict,
)

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/README.md).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/smollm3/model.py was given a config of model type '{config.model_type}'")
    refuse_foreign_keys(config, ("attn_logit_softcapping", "final_logit_softcapping"), "smollm3")
    check_decoder_config(config, "flax_lm/models/smollm3/model.py", mesh)
    check_rope(rope_parameters(config), "flax_lm/models/smollm3/model.py")
    if len(config.no_rope_layers) < config.num_hidden_layers:
        raise UsageError(
            f"no_rope_layers names {len(config.no_rope_layers)} layers but num_hidden_layers is "
            f"{config.num_hidden_layers}; give one 1 (rotary positions) or 0 (none) per layer"
        )


def windows(config) -> list:
    """The sliding window of each layer: those of layer_types where use_sliding_window is set, else none."""
    return layer_windows(config) if config.use_sliding_window else [None] * config.num_hidden_layers


class SmolLM3Part(DecoderPart):
    """Base of the model's parts: Llama's RMSNorm (the weight multiplies the normalized x in the model's dtype)."""

    NORM_STYLE = {}


class SmolLM3Attention(SmolLM3Part):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        head_dim = head_dim_of(config)
        bias = config.attention_bias
        query, key, value = self.head_projections(x, bias)
        if config.no_rope_layers[self.layer_index]:  # 0: a NoPE layer, which sees positions through the mask alone
            frequencies = rotary_frequencies(rope_parameters(config), head_dim)
            query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        window = windows(config)[self.layer_index]
        y, layer_cache = self.attend(
            query, key, value, 1 / math.sqrt(head_dim), cache, self.layer_index, segment_ids, window
        )
        y = self.dense(config.hidden_size, ("heads", "embed"), bias, "o_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class SmolLM3DecoderLayer(SmolLM3Part):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(SmolLM3Attention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + y
        mlp = self.child(GatedMLP, "mlp", activation=self.config.hidden_act, use_bias=self.config.mlp_bias)
        x = x + mlp(self.rms_norm("post_attention_layernorm")(x))
        return x, layer_cache


class FlaxSmolLM3ForCausalLM(CausalDecoderLM):
    """SmolLM3 with its language-model head: see CausalDecoderLM."""

    LAYER_CLASS = SmolLM3DecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxSmolLM3ForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a SmolLM3ForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head: what exported weights must be for transformers to load
    them. From the config alone, so that it holds whatever is done to the Flax model."""
    width, inner, head_dim = config.hidden_size, config.intermediate_size, head_dim_of(config)
    heads, key_value_heads = config.num_attention_heads, config.num_key_value_heads
    bias, mlp_bias = config.attention_bias, config.mlp_bias

    def layer_shapes(layer: str) -> dict:
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        shapes = linear_shapes(f"{attention}.q_proj", width, heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.k_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.v_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * head_dim, width, bias)
        shapes |= linear_shapes(f"{mlp}.gate_proj", width, inner, mlp_bias)
        shapes |= linear_shapes(f"{mlp}.up_proj", width, inner, mlp_bias)
        shapes |= linear_shapes(f"{mlp}.down_proj", inner, width, mlp_bias)
        return shapes | {
            f"{layer}.input_layernorm.weight": (width,),
            f"{layer}.post_attention_layernorm.weight": (width,),
        }

    return decoder_shapes(config, layer_shapes)
