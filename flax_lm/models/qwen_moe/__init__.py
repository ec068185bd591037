"""The Qwen MoE family (Qwen 2 MoE, Qwen 3 MoE): its model types, create_config.py presets (Qwen3-30B-A3B's
published shape, from Qwen/Qwen3-30B-A3B on the Hugging Face Hub: 30.5B parameters, 3.3B active per token; a tiny
Qwen 3 MoE that trains on a CPU) and no tokenizer conventions of its own (flax_lm/models/README.md). The model is
model.py."""

from flax_lm.models.family import ModelFamily

# fmt: off
FAMILY = ModelFamily(
    name="qwen_moe",
    title="Qwen MoE",
    config_classes={"qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"},
    head_dim_apart=("qwen3_moe",),
    presets={
        "qwen3-30b-a3b": ("qwen3_moe", {
            "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 40960, "vocab_size": 151936,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "bos_token_id": 151643,
            "eos_token_id": 151645,
        }),
        "qwen3-moe-tiny": ("qwen3_moe", {
            "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "intermediate_size": 384, "moe_intermediate_size": 128, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256, "vocab_size": 151936,
            "tie_word_embeddings": True,
        }),
    },
)
# fmt: on
