"""OLMoE in Flax: Llama's pre-norm block with RMSNorm of the whole query and key projections (all heads together, as
OLMo 2's) before their rotation, optional clipping of the projections (clip_qkv), and a mixture of SwiGLU experts in
place of the MLP: each token's 8 (num_experts_per_tok) of 64 (num_experts) by a softmax router whose top-k weights are
NOT renormalised (norm_topk_prob false, as OLMoE trains), computed dropless (flax_lm/models/shared/moe.py). Parameter
names and layouts are one-to-one with the checkpoints of transformers' OlmoeForCausalLM (mlp.experts.N.gate_proj/
up_proj/down_proj, as transformers 4 and 5 load them); a key/value cache decodes.

A model module: flax_lm/models/__init__.py says what one holds, and how an experiment trains a copy of its own."""

import jax

from flax_lm.errors import UsageError
from flax_lm.models.shared.common import refuse_foreign_keys
from flax_lm.models.shared.moe_decoder import (
    MoeCausalLM,
    MoeDecoderLayer,
    MoeVariant,
    check_moe_config,
    from_hf_state_dict,
    hf_shapes,
    moe_architecture_shapes,
    to_hf_state_dict,
)

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"olmoe": "OlmoeForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/__init__.py).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]

OLMOE = MoeVariant(
    module_file="flax_lm/models/olmoe/model.py",
    moe_name="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    head_norm="all heads",
    projection_biases=lambda config: (config.attention_bias, config.attention_bias),
    num_experts=lambda config: config.num_experts,
    expert_inner=lambda config: config.intermediate_size,
    renormalize=lambda config: config.norm_topk_prob,
)


def moe_variant(config) -> MoeVariant:
    """What sets the model of `config` apart (one family here)."""
    return OLMOE


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/olmoe/model.py was given a config of model type '{config.model_type}'")
    foreign = ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping")
    refuse_foreign_keys(config, foreign, "olmoe")
    check_moe_config(config, OLMOE, mesh)


class OlmoeDecoderLayer(MoeDecoderLayer):
    VARIANT = OLMOE


class FlaxOlmoeForCausalLM(MoeCausalLM):
    """OLMoE with its language-model head: see CausalDecoderLM."""

    LAYER_CLASS = OlmoeDecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxOlmoeForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of an OlmoeForCausalLM of `config` as save_pretrained writes them."""
    return moe_architecture_shapes(config, OLMOE)
