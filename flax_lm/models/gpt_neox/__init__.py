"""The GPT-NeoX family (Pythia): its model type and create_config.py presets (see flax_lm/models/README.md). The
model is model.py."""

from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="gpt_neox",
    title="GPT-NeoX",
    config_classes={"gpt_neox": "GPTNeoXConfig"},
    # EleutherAI/pythia-160m's published shape on the Hugging Face Hub, its vocabulary and special ids unless a
    # tokenizer gives others; and a tiny size of our own that trains on a CPU.
    presets={
        "pythia-160m": ("gpt_neox", {
            "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
            "max_position_embeddings": 2048, "vocab_size": 50304, "use_parallel_residual": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
        }),
        "pythia-tiny": ("gpt_neox", {
            "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512,
            "max_position_embeddings": 256, "vocab_size": 50304,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False,
        }),
    },
)  # fmt: skip
