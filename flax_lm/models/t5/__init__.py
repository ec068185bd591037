"""The T5 family: its model type, create_config.py presets and tokenizer conventions (flax_lm/models/README.md). The
model, an encoder-decoder, is model.py; run_t5_mlm_flax.py trains it, generate_flax.py decodes with it."""

from flax_lm.models.family import ModelFamily, TokenizerConventions

# T5 sizes as published: the original T5 (Raffel et al., 2020; google-t5/t5-small and t5-base on the Hugging Face
# Hub: ReLU MLP, the output layer the embedding scaled by d_model**-0.5) and T5 v1.1 (google/t5-v1_1-small and
# t5-v1_1-base: gated-GELU MLP, an output layer of its own, which tie_word_embeddings false asks for). The vocabulary
# is T5's 32128 (32000 pieces, 100 sentinels, padded to a multiple of 128) unless the tokenizer gives another; ByT5's
# is 384. Parameters, as transformers counts T5ForConditionalGeneration: t5-small 60,506,624, t5-base 222,903,552,
# t5-v1_1-small 76,961,152, t5-v1_1-base 247,577,856.
T5_SHARED = {"vocab_size": 32128, "d_kv": 64, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
T5_ORIGINAL = {"feed_forward_proj": "relu", "tie_word_embeddings": True, **T5_SHARED}
T5_V1_1 = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, **T5_SHARED}
T5_PRESETS = {
    "t5-small": {
        "d_model": 512,
        "d_ff": 2048,
        "num_layers": 6,
        "num_decoder_layers": 6,
        "num_heads": 8,
        **T5_ORIGINAL,
    },
    "t5-base": {
        "d_model": 768,
        "d_ff": 3072,
        "num_layers": 12,
        "num_decoder_layers": 12,
        "num_heads": 12,
        **T5_ORIGINAL,
    },
    "t5-v1_1-small": {
        "d_model": 512,
        "d_ff": 1024,
        "num_layers": 8,
        "num_decoder_layers": 8,
        "num_heads": 6,
        **T5_V1_1,
    },
    "t5-v1_1-base": {
        "d_model": 768,
        "d_ff": 2048,
        "num_layers": 12,
        "num_decoder_layers": 12,
        "num_heads": 12,
        **T5_V1_1,
    },
    # A small v1.1 of our own that trains on a CPU.
    "t5-tiny": {"d_model": 128, "d_ff": 512, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 2, **T5_V1_1},
}

FAMILY = ModelFamily(
    name="t5",
    title="T5",
    config_classes={"t5": "T5Config"},
    presets={name: ("t5", values) for name, values in T5_PRESETS.items()},
    head_dim_apart=("t5",),  # d_kv
    # <pad>=0, </s>=1, <unk>=2, then the pieces, then 100 sentinels, <extra_id_0> the last id, as in T5's vocabulary;
    # </s> after each text. The decoder starts from <pad>, and </s> ends a target: each needs a token of its own.
    tokenizers={
        "t5": TokenizerConventions(
            special_tokens={"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"},
            model_max_length=512,
            tokenizer_class="T5Tokenizer",
            distinct_roles=("pad_token", "eos_token"),
            converses=False,
            sentinel_tokens=100,
        )
    },
    encoder_decoder=True,
)
