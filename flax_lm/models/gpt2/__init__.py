"""The GPT-2 family: its model type, create_config.py presets, tokenizer conventions and parameter count (see
flax_lm/models/README.md). The model is model.py."""

from flax_lm.models import moved_to_model
from flax_lm.models.family import ModelFamily, TokenizerConventions


def count_parameters(config) -> int:
    """Parameters of the GPT2LMHeadModel of `config`, counted from the sizes, and the query and key heads' RMSNorm
    weights of the block option qk_norm. The output layer shares the embedding's weights unless tie_word_embeddings
    is false."""
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    layer_norm = 2 * hidden  # scale and bias
    inner = config.n_inner or 4 * hidden
    embeddings = vocab * hidden + config.n_positions * hidden
    attention = (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden)  # fused q/k/v, then output
    mlp = (hidden * inner + inner) + (inner * hidden + hidden)
    block = layer_norm + attention + layer_norm + mlp
    if getattr(config, "qk_norm", False):
        block += 2 * (hidden // config.n_head)  # the query and key heads' RMSNorm weights
    output_layer = 0 if config.tie_word_embeddings else vocab * hidden
    return embeddings + layers * block + layer_norm + output_layer


FAMILY = ModelFamily(
    name="gpt2",
    title="GPT-2",
    config_classes={"gpt2": "GPT2Config"},
    # GPT-2 sizes as published with the GPT-2 paper (Radford et al., 2019) and the openai-community/gpt2,
    # gpt2-medium, gpt2-large and gpt2-xl configurations on the Hugging Face Hub; distilgpt2 as distilbert/distilgpt2.
    # Other values are the GPT2Config defaults, which are those of the published models. Then small sizes of our own
    # that train on a CPU.
    presets={
        "gpt2": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}),
        "gpt2-medium": (
            "gpt2",
            {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024, "vocab_size": 50257},
        ),
        "gpt2-large": (
            "gpt2",
            {"n_layer": 36, "n_embd": 1280, "n_head": 20, "n_positions": 1024, "vocab_size": 50257},
        ),
        "gpt2-xl": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024, "vocab_size": 50257}),
        "distilgpt2": ("gpt2", {"n_layer": 6, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}),
        "gpt2-tiny": ("gpt2", {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 256, "vocab_size": 50257}),
        "gpt2-mini": ("gpt2", {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 512, "vocab_size": 50257}),
    },  # fmt: skip
    # One token for beginning, end and unknown text, and no padding token; 1024 positions.
    tokenizers={
        "gpt2": TokenizerConventions(
            special_tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
            model_max_length=1024,
        )
    },
    count_parameters=count_parameters,
)


def __getattr__(name: str):
    """flax_lm 0.4's flax_lm.models.gpt2 was the model module: a name imported from it stops in one line."""
    return moved_to_model("gpt2", name)
