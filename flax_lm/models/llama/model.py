"""The Llama family in Flax: RMSNorm, rotary positions, a SwiGLU MLP and grouped-query attention, with parameter
names and layouts one-to-one with transformers' LlamaForCausalLM, and the families that are configurations of its
block: Qwen 2 (biases on the query, key and value projections), Qwen 3 (RMSNorm of each query and key head, a head_dim
apart from the width) and Mistral (sliding-window attention); Qwen's sliding-window layers too. Checkpoints of each
load, and exports name the family's own transformers class. A key/value cache decodes (flax_lm.generation.sampling
decodes with it).

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import logging
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

logger = logging.getLogger(__name__)

# The config.model_type values this module computes -> the transformers class whose checkpoint layout the
# parameters map onto, named in an exported config.json.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/README.md).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]


def projection_biases(config) -> tuple[bool, bool]:
    """Whether the query/key/value projections, and the output projection, have biases: Qwen 2's first three always,
    its output never; the others' all four as attention_bias says."""
    if config.model_type == "qwen2":
        return True, False
    bias = getattr(config, "attention_bias", False)
    return bias, bias


def normalizes_heads(config) -> bool:
    """Whether each query and key head is RMS-normalized before its rotation (Qwen 3's q_norm and k_norm)."""
    return config.model_type == "qwen3"


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/llama/model.py was given a config of model type '{config.model_type}'")
    # What the model type's transformers class does not read, which the decoder would compute all the same.
    foreign = {"llama": ("sliding_window", "layer_types"), "mistral": ("layer_types",)}.get(config.model_type, ())
    refuse_foreign_keys(config, (*foreign, "attn_logit_softcapping", "final_logit_softcapping"), config.model_type)
    check_decoder_config(config, "flax_lm/models/llama/model.py", mesh)
    check_rope(rope_parameters(config), "flax_lm/models/llama/model.py")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        logger.warning("pretraining_tp %s is ignored: it splits the products alone", config.pretraining_tp)


class LlamaPart(DecoderPart):
    """Base of the model's parts: Llama's RMSNorm (the weight multiplies the normalized x in the model's dtype)."""

    NORM_STYLE = {}


class LlamaAttention(LlamaPart):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        head_dim = head_dim_of(config)
        projections_bias, output_bias = projection_biases(config)
        query, key, value = self.head_projections(x, projections_bias)
        if normalizes_heads(config):
            query = self.rms_norm("q_norm", logical_axis=None)(query)
            key = self.rms_norm("k_norm", logical_axis=None)(key)
        frequencies = rotary_frequencies(rope_parameters(config), head_dim)
        query, key = rotate(query, positions, frequencies), rotate(key, positions, frequencies)
        scale = 1 / math.sqrt(head_dim)
        window = layer_windows(config)[self.layer_index]
        y, layer_cache = self.attend(query, key, value, scale, cache, self.layer_index, segment_ids, window)
        # Split by heads, the projection's rows are split alike: each device sums its heads' share of the output.
        y = self.dense(config.hidden_size, ("heads", "embed"), output_bias, "o_proj")(y)
        return self.constrain(y, ("batch", "length", None)), layer_cache


class LlamaDecoderLayer(LlamaPart):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, positions, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(LlamaAttention, "self_attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.rms_norm("input_layernorm")(x), positions, cache, segment_ids)
        x = x + y
        mlp = self.child(
            GatedMLP, "mlp", activation=self.config.hidden_act, use_bias=getattr(self.config, "mlp_bias", False)
        )
        x = x + mlp(self.rms_norm("post_attention_layernorm")(x))
        return x, layer_cache


class FlaxLlamaForCausalLM(CausalDecoderLM):
    """Llama (and Qwen 2, Qwen 3, Mistral) with its language-model head: see CausalDecoderLM."""

    LAYER_CLASS = LlamaDecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxLlamaForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of the transformers class of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head: what exported weights must be for transformers to load
    them. From the config alone, so that it holds whatever is done to the Flax model."""
    width, inner, head_dim = config.hidden_size, config.intermediate_size, head_dim_of(config)
    heads, key_value_heads = config.num_attention_heads, config.num_key_value_heads
    projections_bias, output_bias = projection_biases(config)
    mlp_bias = getattr(config, "mlp_bias", False)

    def layer_shapes(layer: str) -> dict:
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        shapes = linear_shapes(f"{attention}.q_proj", width, heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.k_proj", width, key_value_heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.v_proj", width, key_value_heads * head_dim, projections_bias)
        shapes |= linear_shapes(f"{attention}.o_proj", heads * head_dim, width, output_bias)
        if normalizes_heads(config):
            shapes |= {f"{attention}.q_norm.weight": (head_dim,), f"{attention}.k_norm.weight": (head_dim,)}
        shapes |= linear_shapes(f"{mlp}.gate_proj", width, inner, mlp_bias)
        shapes |= linear_shapes(f"{mlp}.up_proj", width, inner, mlp_bias)
        shapes |= linear_shapes(f"{mlp}.down_proj", inner, width, mlp_bias)
        return shapes | {
            f"{layer}.input_layernorm.weight": (width,),
            f"{layer}.post_attention_layernorm.weight": (width,),
        }

    return decoder_shapes(config, layer_shapes)
