"""The OPT family: its model type and create_config.py presets (see flax_lm/models/README.md). The model is
model.py."""

from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="opt",
    title="OPT",
    config_classes={"opt": "OPTConfig"},
    # facebook/opt-125m's published shape on the Hugging Face Hub, its vocabulary and special ids unless a tokenizer
    # gives others; and a tiny size of our own that trains on a CPU.
    presets={
        "opt-125m": ("opt", {
            "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "ffn_dim": 3072,
            "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768,
            "do_layer_norm_before": True, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 2,
            "pad_token_id": 1,
        }),
        "opt-tiny": ("opt", {
            "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "ffn_dim": 512,
            "max_position_embeddings": 256, "vocab_size": 50272, "word_embed_proj_dim": 128,
        }),
    },
)  # fmt: skip
