#!/usr/bin/env python3
"""Write the config.json of a GPT-2, Llama (SmolLM), Qwen 3, Gemma 3, OLMo 2 or RoBERTa model from a preset size,
with your changes.

The presets are stored here, so no network is needed. Given a tokenizer directory, the vocabulary size and the
special-token ids are taken from the tokenizer, and config.json is written next to it, so that one directory holds
the tokenizer and the model configuration:

    python train_tokenizer.py --train_file "data/*.txt" --model_type roberta --output_dir my-model
    python create_config.py --preset roberta-mini --tokenizer_dir my-model --set num_hidden_layers=6

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained("my-model")

A single .json file holding the arguments works as well: `python create_config.py args.json`.
"""

import difflib
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

import flax_lm  # noqa: F401  first: where PyTorch is missing, it keeps transformers from warning about it on import

# isort: split

import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoTokenizer,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    Olmo2Config,
    Qwen3Config,
    RobertaConfig,
)

from flax_lm.command_line.tool_arguments import parse_arguments
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, check_writable_directory, run
from flax_lm.models import (
    CONFIG_SIZES,
    MAX_VOCAB_SIZE,
    mixtral,
    non_finite_config_value,
    olmoe,
    qwen_moe,
    stock_module,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# Presets: edit or add sizes here.
# ---------------------------------------------------------------------------------------------------------------------

# GPT-2 sizes as published with the GPT-2 paper (Radford et al., 2019) and the openai-community/gpt2,
# gpt2-medium, gpt2-large and gpt2-xl configurations on the Hugging Face Hub; distilgpt2 as distilbert/distilgpt2.
# Other values are the GPT2Config defaults, which are those of the published models.
GPT2_PRESETS = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024, "vocab_size": 50257},
    "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20, "n_positions": 1024, "vocab_size": 50257},
    "gpt2-xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25, "n_positions": 1024, "vocab_size": 50257},
    "distilgpt2": {"n_layer": 6, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
    # Small sizes of our own that train on a CPU.
    "gpt2-tiny": {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 256, "vocab_size": 50257},
    "gpt2-mini": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 512, "vocab_size": 50257},
}

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

# The small open models that continued pretraining starts from, with their published shapes: Qwen/Qwen3-0.6B,
# google/gemma-3-270m, allenai/OLMo-2-0425-1B and HuggingFaceTB/SmolLM-135M (a Llama) on the Hugging Face Hub, their
# vocabularies and special ids unless a tokenizer gives others; and tiny sizes of our own of each that train on a CPU.
FAMILY_PRESETS = {
    "qwen3-0.6b": ("qwen3", {
        "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 40960, "vocab_size": 151936,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    "gemma3-270m": ("gemma3_text", {
        "num_hidden_layers": 18, "hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 2048, "max_position_embeddings": 32768, "vocab_size": 262144,
        "sliding_window": 512, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    }),
    "olmo2-1b": ("olmo2", {
        "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
        "intermediate_size": 8192, "max_position_embeddings": 4096, "vocab_size": 100352,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 100257, "pad_token_id": 100277,
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
    "gemma3-tiny": ("gemma3_text", {
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "intermediate_size": 384, "max_position_embeddings": 256, "vocab_size": 262144,
        "sliding_window": 64, "query_pre_attn_scalar": 64, "layer_types": ["sliding_attention", "full_attention"],
    }),
    "olmo2-tiny": ("olmo2", {
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 384, "max_position_embeddings": 256, "vocab_size": 100352,
        "tie_word_embeddings": True,
    }),
}  # fmt: skip

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

PRESETS = {
    **{name: ("gpt2", values) for name, values in GPT2_PRESETS.items()},
    **{name: ("llama", values) for name, values in LLAMA_PRESETS.items()},
    **FAMILY_PRESETS,
    **{name: ("roberta", values) for name, values in ROBERTA_PRESETS.items()},
}
# The mixture-of-experts families, each with its presets and config classes in its folder of flax_lm/models.
MOE_FAMILIES = (mixtral, qwen_moe, olmoe)
PRESETS |= {name: preset for family in MOE_FAMILIES for name, preset in family.FAMILY.presets.items()}
CONFIG_CLASSES = {
    "gpt2": GPT2Config,
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "gemma3_text": Gemma3TextConfig,
    "olmo2": Olmo2Config,
    "roberta": RobertaConfig,
}
CONFIG_CLASSES |= {
    model_type: getattr(transformers, name)
    for family in MOE_FAMILIES
    for model_type, name in family.FAMILY.config_classes.items()
}
# Keys of config.json that describe the file rather than the model.
BOOKKEEPING_KEYS = {"transformers_version", "_name_or_path"}
# Files that make a directory a tokenizer directory.
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


@dataclass
class ConfigArguments:
    preset: str = field(
        metadata={"help": "The model size to start from.", "choices": list(PRESETS)},
    )
    tokenizer_dir: str | None = field(
        default=None,
        metadata={
            "help": "A tokenizer directory (from train_tokenizer.py): vocab_size and special-token ids are taken "
            "from it, and config.json is written into it unless --output_dir is given."
        },
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Directory to write config.json to. Default: --tokenizer_dir."}
    )
    pad_vocab_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Round vocab_size up to a multiple of this (64 or 128 make the embedding matmuls faster)."},
    )
    overrides: list[str] | None = field(
        default=None,
        metadata={
            "help": "Config values to change, as key=value separated by spaces, e.g. --set n_layer=6 "
            "resid_pdrop=0.0. Values are read as JSON, or else taken as strings.",
            "aliases": ["--set"],
            "metavar": "KEY=VALUE",
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a config.json already in the output directory."})


# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


def parse_overrides(overrides, model_type):
    """["n_layer=6", "hidden_size=256"] to {"n_layer": 6, "n_embd": 256}, with keys checked against the config class.

    Keys may use either name of an attribute with two (GPT-2's n_embd is also hidden_size); they are stored under the
    name config.json uses.
    """
    config_class = CONFIG_CLASSES[model_type]
    defaults = config_class().to_dict()
    canonical_names = {key: key for key in defaults if key not in BOOKKEEPING_KEYS}
    canonical_names.update(config_class.attribute_map)
    # Fields the model module computes beyond its transformers class's (GPT-2's block options).
    canonical_names.update({key: key for key in getattr(stock_module(model_type), "BLOCK_OPTIONS", {})})
    values, given_as = {}, {}
    for override in overrides or []:
        key, separator, text = override.partition("=")
        key = key.strip()
        if not separator or not key:
            raise UsageError(f"--set {override!r} is not key=value; write e.g. --set n_layer=6")
        if key not in canonical_names:
            close = difflib.get_close_matches(key, list(canonical_names), n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "see the keys of config.json"
            raise UsageError(f"--set {key}: {config_class.__name__} has no such key; {hint}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        name = canonical_names[key]
        if isinstance(defaults.get(name), float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # layer_norm_eps=1 means 1.0
        if name == "model_type":
            if value != model_type:
                raise UsageError(
                    f"--set model_type={value} contradicts the preset, which is a {model_type} model; "
                    "choose a preset of that model type instead"
                )
            continue
        if name in values and values[name] != value:
            raise UsageError(
                f"--set {given_as[name]}={values[name]!r} and --set {key}={value!r} contradict each other; "
                "give one value"
            )
        values[name], given_as[name] = value, key
    return values


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------------


def load_tokenizer(tokenizer_dir):
    if not os.path.isdir(tokenizer_dir):
        raise UsageError(f"--tokenizer_dir {tokenizer_dir} is not a directory; train one with train_tokenizer.py")
    if not any(os.path.isfile(os.path.join(tokenizer_dir, name)) for name in TOKENIZER_FILES):
        raise UsageError(
            f"--tokenizer_dir {tokenizer_dir} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
            "train one with train_tokenizer.py"
        )
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(f"cannot load a tokenizer from --tokenizer_dir {tokenizer_dir}: {first_line}") from None


def values_from_tokenizer(tokenizer, model_type, tokenizer_dir):
    """The vocabulary size and special-token ids a model for this tokenizer needs."""
    values = {"vocab_size": len(tokenizer)}
    for role in ["bos", "eos", "pad"]:
        token_id = getattr(tokenizer, f"{role}_token_id")
        if token_id is not None:
            values[f"{role}_token_id"] = token_id
    if model_type == "roberta" and tokenizer.pad_token_id is None:
        raise UsageError(
            f"the tokenizer in {tokenizer_dir} has no padding token, which RoBERTa needs; "
            "train it with train_tokenizer.py --model_type roberta"
        )
    return values


def round_up(number, multiple):
    return math.ceil(number / multiple) * multiple


# ---------------------------------------------------------------------------------------------------------------------
# Checks and parameter count
# ---------------------------------------------------------------------------------------------------------------------


def check_config(config, preset, tokenizer=None):
    """Refuse settings the model cannot be built or trained with."""
    if found := non_finite_config_value(config):
        name, value = found
        default = CONFIG_CLASSES[config.model_type]().to_dict().get(name)
        fix = f"--set {name}={default}" if isinstance(default, (int, float)) else f"--set {name}=..."
        raise UsageError(f"{name} is {value}, not a finite number; give it one with {fix}")
    sizes = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "max_position_embeddings": config.max_position_embeddings,
    }
    values = config.to_dict()
    for name in ["n_inner", "intermediate_size", "type_vocab_size"]:  # n_inner None: four times the width
        if name in values:
            sizes[name] = values[name]
    for name, size in sizes.items():
        if size is not None and size < 1:
            raise UsageError(f"{name} must be 1 or more, not {size}")
    # The attention's sizes, as the families read them: whole numbers of 1 or more (head_dim may be left out, to
    # divide the width by the heads); Gemma's query_pre_attn_scalar scales the scores by its inverse square root.
    for name in ("num_key_value_heads", "head_dim", "query_pre_attn_scalar"):
        if not hasattr(config, name) or name == "head_dim" and config.head_dim is None:
            continue
        if not is_positive_int(value := getattr(config, name)):
            preset_value = PRESETS[preset][1].get(name)
            fix = f"--set {name}={preset_value}, the preset's" if preset_value else "leave it out"
            raise UsageError(f"{name} must be a whole number of 1 or more, not {value!r}; {fix}")
    if config.vocab_size > MAX_VOCAB_SIZE:
        raise UsageError(
            f"vocab_size {config.vocab_size} is more token ids than int32 holds ({MAX_VOCAB_SIZE}), the type the "
            "tokens are read and trained as; set vocab_size to your tokenizer's (--tokenizer_dir sets it)"
        )
    # Dropout rates are probabilities; 1 would drop everything.
    for name, rate in values.items():
        if name.endswith(("pdrop", "dropout", "dropout_prob")) and rate is not None and not 0 <= rate < 1:
            raise UsageError(f"{name} is a dropout probability, in [0, 1), not {rate}; fix it with --set {name}=0.1")
    for name in ["layer_norm_epsilon", "layer_norm_eps", "initializer_range"]:
        value = getattr(config, name, None)
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be positive, not {value}; fix it with --set")
    from flax_lm.models.common import ACTIVATIONS  # here: JAX, which it imports, takes a second to load

    name = {"gpt2": "activation_function", "gemma3_text": "hidden_activation"}.get(config.model_type, "hidden_act")
    if getattr(config, name) not in ACTIVATIONS:
        raise UsageError(
            f"{name} {getattr(config, name)!r} is not an activation the models compute; use one of "
            f"{', '.join(ACTIVATIONS)}, e.g. --set {name}=gelu_new"
        )
    # Qwen 3's and Gemma's heads have a width of their own (head_dim); the others' divide the hidden size.
    if config.model_type not in ("qwen3", "gemma3_text") and config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(
            f"hidden size {config.hidden_size} is not divisible by the {config.num_attention_heads} attention heads; "
            "change one of them with --set"
        )
    stock_module(config.model_type).check_model_config(config)  # what the model itself computes
    for name in ["bos_token_id", "eos_token_id", "pad_token_id"]:
        token_id = getattr(config, name, None)
        if token_id is not None and not 0 <= token_id < config.vocab_size:
            raise UsageError(
                f"{name} {token_id} is outside the vocabulary of {config.vocab_size}; set vocab_size higher"
            )

    if config.model_type == "roberta":
        if config.pad_token_id is None:
            raise UsageError("RoBERTa needs a pad_token_id; set one with --set pad_token_id=1")
        # Positions are numbered from pad_token_id + 1, so that many positions are never used.
        position_offset = config.pad_token_id + 1
        if config.max_position_embeddings <= position_offset:
            raise UsageError(
                f"max_position_embeddings {config.max_position_embeddings} leaves no positions after the padding "
                f"offset of {position_offset}; set it to at least {position_offset + 1}"
            )
    else:
        position_offset = 0
    usable_positions = config.max_position_embeddings - position_offset

    if tokenizer is not None:
        if config.vocab_size < len(tokenizer):
            raise UsageError(
                f"vocab_size {config.vocab_size} is smaller than the tokenizer's vocabulary of {len(tokenizer)}; "
                f"leave vocab_size out or set it to at least {len(tokenizer)}"
            )
        # A tokenizer without a limit has model_max_length of 1e30; only a real limit is checked.
        if usable_positions < tokenizer.model_max_length < 1e9:
            name = "n_positions" if config.model_type == "gpt2" else "max_position_embeddings"
            raise UsageError(
                f"{preset} with {name} {config.max_position_embeddings} has room for {usable_positions} tokens, "
                f"but the tokenizer's model_max_length is {tokenizer.model_max_length}; "
                f"--set {name}={tokenizer.model_max_length + position_offset}, or retrain the tokenizer with "
                f"--model_max_length {usable_positions}"
            )


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def count_parameters(config):
    """Parameters of the transformers model (GPT2LMHeadModel, LlamaForCausalLM, ..., RobertaForMaskedLM) built from
    this config, counted from
    the sizes.

    The output layer shares its weights with the token embeddings unless tie_word_embeddings is false.
    """
    vocab, hidden, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    layer_norm = 2 * hidden  # scale and bias
    if config.model_type == "gpt2":
        inner = config.n_inner or 4 * hidden
        embeddings = vocab * hidden + config.n_positions * hidden
        attention = (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden)  # fused q/k/v, then output
        mlp = (hidden * inner + inner) + (inner * hidden + hidden)
        block = layer_norm + attention + layer_norm + mlp
        if getattr(config, "qk_norm", False):
            block += 2 * (hidden // config.n_head)  # the query and key heads' RMSNorm weights
        output_layer = 0 if config.tie_word_embeddings else vocab * hidden
        return embeddings + layers * block + layer_norm + output_layer
    if config.model_type != "roberta":  # the rotary decoders: the tensors their module exports
        shapes = stock_module(config.model_type).hf_architecture_shapes(config)
        return sum(math.prod(shape) for shape in shapes.values())
    inner = config.intermediate_size
    embeddings = (vocab + config.max_position_embeddings + config.type_vocab_size) * hidden + layer_norm
    attention = 4 * (hidden * hidden + hidden) + layer_norm  # q, k, v, output, then layer norm
    mlp = (hidden * inner + inner) + (inner * hidden + hidden) + layer_norm
    # The masked-LM head: dense, layer norm, then the decoder's bias. Untied, the decoder has its own weights and,
    # in transformers' RobertaLMHead, a bias apart from the head's.
    lm_head = (hidden * hidden + hidden) + layer_norm + vocab
    lm_head += 0 if config.tie_word_embeddings else vocab * hidden + vocab
    return embeddings + layers * (attention + mlp) + lm_head


def write_config_atomically(config, output_dir):
    """Write config.json through a temporary file and a rename, so no reader ever sees half a file."""
    os.makedirs(output_dir, exist_ok=True)
    file_descriptor, temporary_path = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=output_dir)
    os.close(file_descriptor)
    try:
        config.to_json_file(temporary_path)
        os.replace(temporary_path, os.path.join(output_dir, "config.json"))
    finally:
        if os.path.exists(temporary_path):
            os.remove(temporary_path)


def build_config(model_type: str, values: dict, overrides: dict):
    """The config class of `model_type` made of `values` (the preset's, with the --set `overrides`), its own checks'
    refusals in one line."""
    try:
        return CONFIG_CLASSES[model_type](**values)
    except (StrictDataclassError, TypeError, ValueError) as error:
        # The config class checks the type of every value, e.g. that n_layer is an integer.
        message = str(error).strip().splitlines()[-1].strip().removeprefix("TypeError: ")
        raise UsageError(f"invalid config value: {message}; fix it with --set") from None
    except ZeroDivisionError:  # Llama's and Gemma 3's classes divide by the heads before check_config can look
        zeros = [f"{name}={value}" for name, value in overrides.items() if name in CONFIG_SIZES and value == 0]
        raise UsageError(f"--set {', '.join(zeros)}: sizes must be 1 or more") from None


def main():
    # Arguments ------------------------------------------------------------------------------------------------------
    (args,) = parse_arguments((ConfigArguments,))
    # The summary and the log both go to stdout, so that stderr holds only the error line of a mistake.
    logging.basicConfig(format=LOG_FORMAT, handlers=[logging.StreamHandler(sys.stdout)], level=logging.INFO)
    model_type, preset_values = PRESETS[args.preset]
    overrides = parse_overrides(args.overrides, model_type)
    if args.pad_vocab_to_multiple_of is not None and args.pad_vocab_to_multiple_of < 1:
        raise UsageError(f"--pad_vocab_to_multiple_of must be 1 or more, not {args.pad_vocab_to_multiple_of}")

    output_dir = args.output_dir or args.tokenizer_dir
    if output_dir is None:
        raise UsageError("no output directory: pass --tokenizer_dir (config.json goes next to it) or --output_dir")
    if os.path.exists(os.path.join(output_dir, "config.json")) and not args.overwrite:
        raise UsageError(f"{output_dir} already has a config.json; pass --overwrite to replace it")
    check_writable_directory(output_dir, "output_dir")

    # Values: the preset, then what the tokenizer needs, then the user's changes -------------------------------------
    values = dict(preset_values)
    tokenizer = None
    if args.tokenizer_dir is not None:
        tokenizer = load_tokenizer(args.tokenizer_dir)
        from_tokenizer = values_from_tokenizer(tokenizer, model_type, args.tokenizer_dir)
        logger.info(
            "From the tokenizer in %s: %s",
            args.tokenizer_dir,
            ", ".join(f"{key}={value}" for key, value in from_tokenizer.items()),
        )
        values.update(from_tokenizer)
    if args.pad_vocab_to_multiple_of is not None:
        explicit_vocab_size = overrides.get("vocab_size")
        if isinstance(explicit_vocab_size, int) and explicit_vocab_size % args.pad_vocab_to_multiple_of != 0:
            raise UsageError(
                f"--set vocab_size={overrides['vocab_size']} is not a multiple of --pad_vocab_to_multiple_of "
                f"{args.pad_vocab_to_multiple_of}; leave one of them out"
            )
        values["vocab_size"] = round_up(values["vocab_size"], args.pad_vocab_to_multiple_of)
    # The model class the config is written for, so that pipeline() and the Auto classes pick the right head.
    values["architectures"] = [stock_module(model_type).HF_ARCHITECTURES[model_type]]
    values.update(overrides)

    # Config ---------------------------------------------------------------------------------------------------------
    config = build_config(model_type, values, overrides)
    check_config(config, args.preset, tokenizer)

    # Save -----------------------------------------------------------------------------------------------------------
    write_config_atomically(config, output_dir)
    parameters = count_parameters(config)
    print(f"Wrote {os.path.abspath(os.path.join(output_dir, 'config.json'))}")
    print(
        f"{args.preset} ({model_type}): {config.num_hidden_layers} layers, hidden size {config.hidden_size}, "
        f"{config.num_attention_heads} heads, {config.max_position_embeddings} positions, "
        f"vocab size {config.vocab_size}"
    )
    print(f"parameters: {parameters:,} ({parameters / 1e6:.1f}M)")


if __name__ == "__main__":
    run(main)
