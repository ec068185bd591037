"""The SmolLM3 family: its model type and create_config.py presets (see flax_lm/models/README.md). The model is
model.py. Its tokenizer: train a `llama` one (train_tokenizer.py --model_type llama), whose special ids
create_config.py --tokenizer_dir takes."""

from flax_lm.models.family import ModelFamily

FAMILY = ModelFamily(
    name="smollm3",
    title="SmolLM3",
    config_classes={"smollm3": "SmolLM3Config"},
    # SmolLM3Config's defaults, which transformers documents as the shape of HuggingFaceTB/SmolLM3-3B (36 layers,
    # width 2048, 16 heads over 4, a NoPE layer every fourth, tied), its vocabulary and special ids unless a tokenizer
    # gives others; and a tiny size of our own that trains on a CPU, its second layer a NoPE one, padded as its
    # tokenizer pads (a llama tokenizer does not).
    presets={
        "smollm3-3b": ("smollm3", {}),
        "smollm3-tiny": (
            "smollm3",
            {
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 384,
                "max_position_embeddings": 256,
                "no_rope_layer_interval": 2,
                "pad_token_id": None,
            },
        ),
    },
)
