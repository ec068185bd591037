"""The Llama family, with the configurations of its block (Mistral, Qwen 2, Qwen 3): its model types, create_config.py
presets and tokenizer conventions (see flax_lm/models/README.md). The model is model.py."""

from flax_lm.models import moved_to_model
from flax_lm.models.family import ModelFamily, TokenizerConventions

# Llama sizes. Llama 2 7B as published (Touvron et al., 2023; meta-llama/Llama-2-7b-hf on the Hugging Face Hub); 1B as
# TinyLlama-1.1B (Zhang et al., 2024; TinyLlama/TinyLlama_v1.1); 60M and 350M as the LLaMA sizes of the ReLoRA and
# GaLore papers (Lialin et al., 2023; Zhao et al., 2024); 160M, mini and tiny our own. The vocabulary is Llama 2's
# 32000 unless the tokenizer gives another. Other values are the LlamaConfig defaults (SiLU, RMSNorm eps 1e-6, rope
# theta 10000), but for the RMSNorm eps 1e-5 of Llama 2. mini has the parameters of gpt2-mini: two key/value heads and
# an MLP of 3 x 768 columns where GPT-2's has 2 x 1024, and no position table.
LLAMA_SHARED = {"vocab_size": 32000, "rms_norm_eps": 1e-5}
LLAMA_PRESETS = {
    "llama-7b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        **LLAMA_SHARED,
    },
    "llama-1b": {
        "num_hidden_layers": 22,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
        "max_position_embeddings": 2048,
        **LLAMA_SHARED,
    },
    "llama-350m": {
        "num_hidden_layers": 24,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 2736,
        "max_position_embeddings": 1024,
        **LLAMA_SHARED,
    },
    "llama-160m": {
        "num_hidden_layers": 16,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 2048,
        "max_position_embeddings": 1024,
        **LLAMA_SHARED,
    },
    "llama-60m": {
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1376,
        "max_position_embeddings": 1024,
        **LLAMA_SHARED,
    },
    # Small sizes of our own that train on a CPU, with the output layer tied to the embedding, as small Llamas have.
    "llama-mini": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        **LLAMA_SHARED,
    },
    "llama-tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 384,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        **LLAMA_SHARED,
    },
}

# The small open models of the family that continued pretraining starts from, with their published shapes:
# Qwen/Qwen3-0.6B and HuggingFaceTB/SmolLM-135M (a Llama) on the Hugging Face Hub, their vocabularies and special ids
# unless a tokenizer gives others; and a tiny Qwen 3 of our own that trains on a CPU.
OPEN_MODEL_PRESETS = {
    "qwen3-0.6b": ("qwen3", {
        "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 40960, "vocab_size": 151936,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    "smollm-135m": ("llama", {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "max_position_embeddings": 2048, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
    }),
    "qwen3-tiny": ("qwen3", {
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 384, "max_position_embeddings": 256, "vocab_size": 151936,
        "tie_word_embeddings": True,
    }),
}  # fmt: skip

FAMILY = ModelFamily(
    name="llama",
    title="Llama",
    config_classes={
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
    },
    presets={**{name: ("llama", values) for name, values in LLAMA_PRESETS.items()}, **OPEN_MODEL_PRESETS},
    # A beginning and an end of text, as Llama 3's tokenizer names them, the first put before every text it encodes;
    # the presets up to llama-1b have 2048 positions.
    tokenizers={
        "llama": TokenizerConventions(
            special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
            model_max_length=2048,
            tokenizer_class="PreTrainedTokenizerFast",
            bos_before_each_text=True,
        )
    },
    head_dim_apart=("qwen3",),
)


def __getattr__(name: str):
    """flax_lm 0.4's flax_lm.models.llama was the model module: a name imported from it stops in one line."""
    return moved_to_model("llama", name)
