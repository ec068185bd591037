"""The RoBERTa family: its model type, create_config.py presets, tokenizer conventions and parameter count (see
flax_lm/models/README.md). The model is model.py."""

from flax_lm.models import moved_to_model
from flax_lm.models.family import ModelFamily, TokenizerConventions


def count_parameters(config) -> int:
    """Parameters of the RobertaForMaskedLM of `config`, counted from the sizes. Untied, the masked-LM head's decoder
    has its own weights and, in transformers' RobertaLMHead, a bias apart from the head's."""
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    layer_norm = 2 * hidden  # scale and bias
    inner = config.intermediate_size
    embeddings = (vocab + config.max_position_embeddings + config.type_vocab_size) * hidden + layer_norm
    attention = 4 * (hidden * hidden + hidden) + layer_norm  # q, k, v, output, then layer norm
    mlp = (hidden * inner + inner) + (inner * hidden + hidden) + layer_norm
    # The masked-LM head: dense, layer norm, then the decoder's bias.
    lm_head = (hidden * hidden + hidden) + layer_norm + vocab
    lm_head += 0 if config.tie_word_embeddings else vocab * hidden + vocab
    return embeddings + layers * (attention + mlp) + lm_head


# RoBERTa sizes as published with the RoBERTa paper (Liu et al., 2019) and the FacebookAI/roberta-base and
# roberta-large configurations on the Hugging Face Hub. RoBERTa numbers positions from pad_token_id + 1, so
# max_position_embeddings 514 leaves room for 512 tokens.
ROBERTA_SHARED = {
    "vocab_size": 50265,
    "type_vocab_size": 1,
    "layer_norm_eps": 1e-5,
    "bos_token_id": 0,
    "pad_token_id": 1,
    "eos_token_id": 2,
}
ROBERTA_PRESETS = {
    "roberta-base": {
        "num_hidden_layers": 12,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 514,
        **ROBERTA_SHARED,
    },
    "roberta-large": {
        "num_hidden_layers": 24,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "max_position_embeddings": 514,
        **ROBERTA_SHARED,
    },
    # Small sizes of our own that train on a CPU; roberta-tiny has room for 256 tokens.
    "roberta-tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 258,
        **ROBERTA_SHARED,
    },
    "roberta-mini": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "max_position_embeddings": 514,
        **ROBERTA_SHARED,
    },
}

FAMILY = ModelFamily(
    name="roberta",
    title="RoBERTa",
    config_classes={"roberta": "RobertaConfig"},
    presets={name: ("roberta", values) for name, values in ROBERTA_PRESETS.items()},
    # <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4, as in the published roberta-base vocabulary; <s> A </s> around each
    # text. The padding token needs an id of its own, as RoBERTa numbers positions and attends from it; 514 position
    # embeddings, two of which the padding offset takes, leave 512 tokens.
    tokenizers={
        "roberta": TokenizerConventions(
            special_tokens={
                "bos_token": "<s>",
                "pad_token": "<pad>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "mask_token": "<mask>",
            },
            model_max_length=512,
            tokenizer_class="RobertaTokenizer",
            distinct_roles=("mask_token", "pad_token"),
            converses=False,
        )
    },
    positions_after_pad_id=True,
    count_parameters=count_parameters,
)


def __getattr__(name: str):
    """flax_lm 0.4's flax_lm.models.roberta was the model module: a name imported from it stops in one line."""
    return moved_to_model("roberta", name)
