"""The DeepSeek-V3 family: its model type, create_config.py presets (DeepSeek-V3's published shape, from
deepseek-ai/DeepSeek-V3 on the Hugging Face Hub: 671B parameters, 37B active per token; a tiny one that trains on a
CPU), its parameter count and no tokenizer conventions of its own (flax_lm/models/README.md). The model is model.py."""

from flax_lm.models.family import ModelFamily


def count_parameters(config) -> int:
    """Parameters of the DeepseekV3ForCausalLM of `config` (its correction biases are buffers): model.py counts
    them from its checkpoint's tensors, with those active per token."""
    from flax_lm.models.deepseek_v3.model import parameter_counts

    return parameter_counts(config)[0]


# fmt: off
FAMILY = ModelFamily(
    name="deepseek_v3",
    title="DeepSeek-V3",
    config_classes={"deepseek_v3": "DeepseekV3Config"},
    presets={
        # The multi-token prediction layer of the published checkpoint (num_nextn_predict_layers 1, its 62nd layer)
        # is not part of DeepseekV3ForCausalLM: none here.
        "deepseek-v3": ("deepseek_v3", {
            "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 3,
            "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 163840,
            "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_interleave": True, "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            },
            "num_mtp_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
        }),
        "deepseek-v3-tiny": ("deepseek_v3", {
            "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "max_position_embeddings": 256, "vocab_size": 32000, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_mtp_layers": 0,
        }),
    },
    count_parameters=count_parameters,
)
# fmt: on
