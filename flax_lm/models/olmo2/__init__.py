"""The OLMo 2 family: its model type and create_config.py presets (see flax_lm/models/README.md). The model is
model.py."""

from flax_lm.models import moved_to_model
from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="olmo2",
    title="OLMo 2",
    config_classes={"olmo2": "Olmo2Config"},
    # allenai/OLMo-2-0425-1B's published shape on the Hugging Face Hub, its vocabulary and special ids unless a
    # tokenizer gives others; and a tiny size of our own that trains on a CPU.
    presets={
        "olmo2-1b": (
            "olmo2",
            {
                "num_hidden_layers": 16,
                "hidden_size": 2048,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "intermediate_size": 8192,
                "max_position_embeddings": 4096,
                "vocab_size": 100352,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                "bos_token_id": None,
                "eos_token_id": 100257,
                "pad_token_id": 100277,
            },
        ),
        "olmo2-tiny": (
            "olmo2",
            {
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "intermediate_size": 384,
                "max_position_embeddings": 256,
                "vocab_size": 100352,
                "tie_word_embeddings": True,
            },
        ),
    },  # fmt: skip
)


def __getattr__(name: str):
    """flax_lm 0.4's flax_lm.models.olmo2 was the model module: a name imported from it stops in one line."""
    return moved_to_model("olmo2", name)
