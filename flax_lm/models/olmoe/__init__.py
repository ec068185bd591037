"""The OLMoE family: its model type, create_config.py presets (OLMoE-1B-7B's published shape, from
allenai/OLMoE-1B-7B-0924 on the Hugging Face Hub: 6.9B parameters, 1.3B active per token; a tiny one that trains on a
CPU) and no tokenizer conventions of its own (flax_lm/models/README.md). The model is model.py."""

from flax_lm.models.family import ModelFamily

# fmt: off
FAMILY = ModelFamily(
    name="olmoe",
    title="OLMoE",
    config_classes={"olmoe": "OlmoeConfig"},
    presets={
        "olmoe-1b-7b": ("olmoe", {
            "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
            "max_position_embeddings": 4096, "vocab_size": 50304,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "router_aux_loss_coef": 0.01, "bos_token_id": None, "eos_token_id": 50279,
            "pad_token_id": 1,
        }),
        "olmoe-tiny": ("olmoe", {
            "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            "vocab_size": 50304, "tie_word_embeddings": True,
        }),
    },
)
# fmt: on
