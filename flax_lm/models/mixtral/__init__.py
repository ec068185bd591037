"""The Mixtral family: its model type, create_config.py presets (Mixtral 8x7B's published shape, from
mistralai/Mixtral-8x7B-v0.1 on the Hugging Face Hub: 46.7B parameters, 12.9B active per token; a tiny one that trains
on a CPU) and no tokenizer conventions of its own (flax_lm/models/README.md). The model is model.py."""

from flax_lm.models.family import ModelFamily

# fmt: off
FAMILY = ModelFamily(
    name="mixtral",
    title="Mixtral",
    config_classes={"mixtral": "MixtralConfig"},
    presets={
        "mixtral-8x7b": ("mixtral", {
            "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 32768, "vocab_size": 32000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None, "bos_token_id": 1,
            "eos_token_id": 2,
        }),
        "mixtral-tiny": ("mixtral", {
            "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            "vocab_size": 32000, "tie_word_embeddings": True, "sliding_window": None,
        }),
    },
)
# fmt: on
