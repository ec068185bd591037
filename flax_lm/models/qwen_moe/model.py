"""Qwen 2 MoE and Qwen 3 MoE in Flax: the Qwen blocks (Qwen 2's query/key/value biases; Qwen 3's RMSNorm of each
query and key head) with a mixture of SwiGLU experts in place of the MLP on every decoder_sparse_step-th layer not in
mlp_only_layers (a gated MLP of intermediate_size on the others): each token's num_experts_per_tok experts by a
softmax router, the top-k weights renormalised where norm_topk_prob says, computed dropless
(flax_lm/models/shared/moe.py); Qwen 2 MoE adds its shared expert, which every token takes, gated by
sigmoid(shared_expert_gate(x)). Parameter names and layouts are one-to-one with the checkpoints of transformers'
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (mlp.experts.N.gate_proj/up_proj/down_proj, as transformers 4 and 5 load
them); a key/value cache decodes.

A model module: flax_lm/models/__init__.py says what one holds, and how an experiment trains a copy of its own."""

import dataclasses

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

# The config.model_type values this module computes -> the transformers class whose checkpoint layout the parameters
# map onto, named in an exported config.json.
HF_ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# Re-exported: what a model module defines (see flax_lm/models/__init__.py).
__all__ = ["from_hf_state_dict", "hf_shapes", "to_hf_state_dict"]


def sparse_layer(config, index: int) -> bool:
    """Whether layer `index` is an MoE layer: every decoder_sparse_step-th, but those of mlp_only_layers."""
    return (
        index not in (config.mlp_only_layers or ())
        and config.num_experts > 0
        and (index + 1) % config.decoder_sparse_step == 0
    )


def projection_biases(config) -> tuple[bool, bool]:
    """Qwen 2 MoE: biases on the query/key/value projections (qkv_bias, always in its checkpoints), none on the
    output; Qwen 3 MoE: on all four as attention_bias says."""
    if config.model_type == "qwen2_moe":
        return getattr(config, "qkv_bias", True), False
    return config.attention_bias, config.attention_bias


def moe_variant(config) -> MoeVariant:
    """What sets the model of `config` apart: Qwen 2 MoE's or Qwen 3 MoE's."""
    return QWEN2_MOE if config.model_type == "qwen2_moe" else QWEN3_MOE


QWEN3_MOE = MoeVariant(
    module_file="flax_lm/models/qwen_moe/model.py",
    moe_name="mlp",
    expert_names=("gate_proj", "up_proj", "down_proj"),
    head_norm="each head",
    projection_biases=projection_biases,
    num_experts=lambda config: config.num_experts,
    expert_inner=lambda config: config.moe_intermediate_size,
    renormalize=lambda config: config.norm_topk_prob,
    sparse_layer=sparse_layer,
)
QWEN2_MOE = dataclasses.replace(
    QWEN3_MOE, head_norm=None, shared_inner=lambda config: config.shared_expert_intermediate_size or None
)


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"flax_lm/models/qwen_moe/model.py was given a config of model type '{config.model_type}'")
    foreign = ("attn_logit_softcapping", "final_logit_softcapping")
    refuse_foreign_keys(config, (*foreign, *(("layer_types",) if config.model_type == "qwen3_moe" else ())), "qwen")
    if config.decoder_sparse_step < 1:
        raise UsageError(f"decoder_sparse_step {config.decoder_sparse_step} must be 1 or more; fix the config")
    check_moe_config(config, moe_variant(config), mesh)


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    VARIANT = QWEN2_MOE


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    VARIANT = QWEN3_MOE


class FlaxQwenMoeForCausalLM(MoeCausalLM):
    """Qwen 2 MoE or Qwen 3 MoE (by config.model_type) with its language-model head: see CausalDecoderLM."""

    @property
    def LAYER_CLASS(self):  # noqa: N802 (the name CausalDecoderLM reads)
        return Qwen2MoeDecoderLayer if self.config.model_type == "qwen2_moe" else Qwen3MoeDecoderLayer


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxQwenMoeForCausalLM


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a Qwen2MoeForCausalLM or Qwen3MoeForCausalLM of `config` as
    save_pretrained writes them."""
    return moe_architecture_shapes(config, moe_variant(config))
