"""OLMo 2 in Flax: Llama's rotary attention and SwiGLU MLP, with the norms after each sublayer rather than before it
(x + norm(attention(x)), x + norm(mlp(x))) and RMSNorm of the whole query and key projections (all heads together)
before their rotation. Parameter names and layouts are one-to-one with transformers' Olmo2ForCausalLM; a key/value
cache decodes.

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
    linear_shapes,
    refuse_foreign_keys,
    rope_parameters,
    rotary_frequencies,
    rotate,
    to_hf_state_dict,
)

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/README.md).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/olmo2/model.py was given a config of model type '{config.model_type}'")
    # What Olmo2ForCausalLM does not read, which the decoder would compute all the same.
    foreign = ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping")
    refuse_foreign_keys(config, foreign, "olmo2")
    check_decoder_config(config, "flax_lm/models/olmo2/model.py", mesh)
    check_rope(rope_parameters(config), "flax_lm/models/olmo2/model.py")


class Olmo2Part(DecoderPart):
    """Base of the model's parts: OLMo 2's RMSNorm, the weight multiplying the normalized x in float32."""

    NORM_STYLE = {"weight_in_float32": True}


class Olmo2Attention(Olmo2Part):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        head_dim = head_dim_of(config)
        query, key, value = self.head_projections(x, config.attention_bias)

        def normalized_over_heads(y, name: str):  # (batch, length, heads, head_dim), normalized over its last two
            flat = self.rms_norm(name, logical_axis="heads")(y.reshape(*y.shape[:2], -1))
            return self.constrain(flat.reshape(y.shape), ("batch", None, "heads", None))

        query, key = normalized_over_heads(query, "q_norm"), normalized_over_heads(key, "k_norm")
        frequencies = rotary_frequencies(rope_parameters(config), head_dim)
        query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        y, layer_cache = self.attend(query, key, value, 1 / math.sqrt(head_dim), cache, self.layer_index, segment_ids)
        y = self.dense(config.hidden_size, ("heads", "embed"), config.attention_bias, "o_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class Olmo2DecoderLayer(Olmo2Part):
    """x + norm(attention(x)), then x + norm(mlp(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(Olmo2Attention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(x, positions, cache, segment_ids)
        x = x + self.rms_norm("post_attention_layernorm")(y)
        y = self.child(GatedMLP, "mlp", activation=self.config.hidden_act)(x)
        return x + self.rms_norm("post_feedforward_layernorm")(y), layer_cache


class FlaxOlmo2ForCausalLM(CausalDecoderLM):
    """OLMo 2 with its language-model head: see CausalDecoderLM."""

    LAYER_CLASS = Olmo2DecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxOlmo2ForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of an Olmo2ForCausalLM of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head. From the config alone, so that it holds whatever is done to
    the Flax model."""
    width, inner, head_dim = config.hidden_size, config.intermediate_size, head_dim_of(config)
    heads, key_value_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias

    def layer_shapes(layer: str) -> dict:
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        shapes = linear_shapes(f"{attention}.q_proj", width, heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.k_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.v_proj", width, key_value_heads * head_dim, bias)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * head_dim, width, bias)
        shapes |= {
            f"{attention}.q_norm.weight": (heads * head_dim,),
            f"{attention}.k_norm.weight": (key_value_heads * head_dim,),
        }
        shapes |= linear_shapes(f"{mlp}.gate_proj", width, inner, False)
        shapes |= linear_shapes(f"{mlp}.up_proj", width, inner, False)
        shapes |= linear_shapes(f"{mlp}.down_proj", inner, width, False)
        norms = ("post_attention_layernorm", "post_feedforward_layernorm")
        return shapes | {f"{layer}.{norm}.weight": (width,) for norm in norms}

    return decoder_shapes(config, layer_shapes)
