"""The GPT-J family: its model type and create_config.py presets (see flax_lm/models/README.md). The model is
model.py."""

from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="gptj",
    title="GPT-J",
    config_classes={"gptj": "GPTJConfig"},
    # EleutherAI/gpt-j-6b's published shape on the Hugging Face Hub, its vocabulary and special ids unless a tokenizer
    # gives others; and a tiny size of our own that trains on a CPU.
    presets={
        "gpt-j-6b": ("gptj", {
            "n_layer": 28, "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_positions": 2048, "vocab_size": 50400,
            "tie_word_embeddings": False, "bos_token_id": 50256, "eos_token_id": 50256,
        }),
        "gpt-j-tiny": ("gptj", {
            "n_layer": 2, "n_embd": 128, "n_head": 2, "rotary_dim": 16, "n_positions": 256, "vocab_size": 50400,
            "tie_word_embeddings": False,
        }),
    },
)  # fmt: skip
