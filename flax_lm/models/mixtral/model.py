"""Mixtral in Flax: Mistral's block (rotary grouped-query attention, sliding windows) with a mixture of experts in
place of its MLP: each token's 2 (num_experts_per_tok) of 8 (num_local_experts) SwiGLU experts by a softmax router,
the top-k weights renormalised to sum to 1, computed dropless (flax_lm/models/shared/moe.py). Parameter names and
layouts are one-to-one with the checkpoints of transformers' MixtralForCausalLM (block_sparse_moe.experts.N.w1/w3/w2,
as transformers 4 and 5 load them); a key/value cache decodes.

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
HF_ARCHITECTURES = {"mixtral": "MixtralForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/__init__.py).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]

MIXTRAL = MoeVariant(
    module_file="flax_lm/models/mixtral/model.py",
    moe_name="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
    head_norm=None,
    projection_biases=lambda config: (False, False),
    num_experts=lambda config: config.num_local_experts,
    expert_inner=lambda config: config.intermediate_size,
    renormalize=lambda config: True,
)


def moe_variant(config) -> MoeVariant:
    """What sets the model of `config` apart (one family here)."""
    return MIXTRAL


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/mixtral/model.py was given a config of model type '{config.model_type}'")
    refuse_foreign_keys(config, ("layer_types", "attn_logit_softcapping", "final_logit_softcapping"), "mixtral")
    if getattr(config, "router_jitter_noise", 0.0):
        raise UsageError(
            f"router_jitter_noise {config.router_jitter_noise} is not implemented by flax_lm/models/mixtral/model.py;"
            " set 0.0"
        )
    check_moe_config(config, MIXTRAL, mesh)


class MixtralDecoderLayer(MoeDecoderLayer):
    VARIANT = MIXTRAL


class FlaxMixtralForCausalLM(MoeCausalLM):
    """Mixtral with its language-model head: see CausalDecoderLM."""

    LAYER_CLASS = MixtralDecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxMixtralForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a MixtralForCausalLM of `config` as save_pretrained writes them."""
    return moe_architecture_shapes(config, MIXTRAL)
