"""The Gemma family (Gemma 2, Gemma 3's text model): its model types and create_config.py presets (see
flax_lm/models/README.md). The model is model.py."""

from flax_lm.models import moved_to_model
from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="gemma",
    title="Gemma",
    config_classes={"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"},
    # google/gemma-3-270m's published shape on the Hugging Face Hub, its vocabulary and special ids unless a tokenizer
    # gives others; and a tiny size of our own that trains on a CPU.
    presets={
        "gemma3-270m": (
            "gemma3_text",
            {
                "num_hidden_layers": 18,
                "hidden_size": 640,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 256,
                "intermediate_size": 2048,
                "max_position_embeddings": 32768,
                "vocab_size": 262144,
                "sliding_window": 512,
                "query_pre_attn_scalar": 256,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
                "bos_token_id": 2,
                "eos_token_id": 1,
                "pad_token_id": 0,
            },
        ),
        "gemma3-tiny": (
            "gemma3_text",
            {
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "intermediate_size": 384,
                "max_position_embeddings": 256,
                "vocab_size": 262144,
                "sliding_window": 64,
                "query_pre_attn_scalar": 64,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
    },  # fmt: skip
    head_dim_apart=("gemma2", "gemma3_text"),
)


def __getattr__(name: str):
    """flax_lm 0.4's flax_lm.models.gemma was the model module: a name imported from it stops in one line."""
    return moved_to_model("gemma", name)
