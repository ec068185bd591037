#!/usr/bin/env python3
"""Write the config.json of a GPT-2, Llama (SmolLM), Qwen 3, Gemma 3, OLMo 2, GPT-J, GPT-NeoX (Pythia), OPT or
RoBERTa model from a preset size, with your changes.

The presets are stored with each model family (flax_lm/models/NAME/__init__.py), so no network is needed. Given a
tokenizer directory, the vocabulary size and the special-token ids are taken from the tokenizer, and config.json is
written next to it, so that one directory holds the tokenizer and the model configuration:

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

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoTokenizer

from flax_lm.command_line.tool_arguments import parse_arguments
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, call_with_one_line_errors, check_writable_directory
from flax_lm.models import CONFIG_SIZES, config_class, config_problem, family_of, presets, stock_module

logger = logging.getLogger(__name__)

# The presets, name -> (model_type, config values), of every family of flax_lm/models: each family's __init__.py holds
# its own (edit or add sizes there).
PRESETS = presets()
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
    config_type = config_class(model_type)
    defaults = config_type().to_dict()
    canonical_names = {key: key for key in defaults if key not in BOOKKEEPING_KEYS}
    canonical_names.update(config_type.attribute_map)
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
            raise UsageError(f"--set {key}: {config_type.__name__} has no such key; {hint}")
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
    family = family_of(model_type)
    if family.encoder_decoder and tokenizer.pad_token_id is not None:  # T5's decoder starts from the padding token
        values["decoder_start_token_id"] = tokenizer.pad_token_id
    if family.positions_after_pad_id and tokenizer.pad_token_id is None:
        raise UsageError(
            f"the tokenizer in {tokenizer_dir} has no padding token, which {family.title} needs; "
            f"train it with train_tokenizer.py --model_type {next(iter(family.tokenizers))}"
        )
    return values


def round_up(number, multiple):
    return math.ceil(number / multiple) * multiple


# ---------------------------------------------------------------------------------------------------------------------
# Checks and parameter count
# ---------------------------------------------------------------------------------------------------------------------


def check_config(config, preset, tokenizer=None):
    """Refuse settings the model cannot be built or trained with: what no model computes with (config_problem, which
    the tools that load a config check too), what its family's module does not compute (check_model_config), and
    what a new config must hold beside (heads that divide the width, special ids in the vocabulary, positions for
    the tokenizer's longest input)."""
    if problem := config_problem(config):
        raise UsageError(f"{problem.text}; {preset_fix(problem.key, preset)}")
    family = family_of(config.model_type)
    # Qwen 3's and Gemma's heads have a width of their own (head_dim); the others' divide the hidden size.
    if config.model_type not in family.head_dim_apart and config.hidden_size % config.num_attention_heads != 0:
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
    if tokenizer is not None and config.vocab_size < len(tokenizer):
        raise UsageError(
            f"vocab_size {config.vocab_size} is smaller than the tokenizer's vocabulary of {len(tokenizer)}; "
            f"leave vocab_size out or set it to at least {len(tokenizer)}"
        )
    if getattr(config, "max_position_embeddings", None) is None:  # relative positions (T5): no limit of its own
        return
    # RoBERTa numbers positions from pad_token_id + 1, so that many positions are never used.
    position_offset = config.pad_token_id + 1 if family.positions_after_pad_id else 0
    if config.max_position_embeddings <= position_offset:
        raise UsageError(
            f"max_position_embeddings {config.max_position_embeddings} leaves no positions after the padding "
            f"offset of {position_offset}; set it to at least {position_offset + 1}"
        )
    usable_positions = config.max_position_embeddings - position_offset

    if tokenizer is not None:
        # A tokenizer without a limit has model_max_length of 1e30; only a real limit is checked.
        if usable_positions < tokenizer.model_max_length < 1e9:
            name = config.attribute_map.get(
                "max_position_embeddings", "max_position_embeddings"
            )  # GPT-2's n_positions
            raise UsageError(
                f"{preset} with {name} {config.max_position_embeddings} has room for {usable_positions} tokens, "
                f"but the tokenizer's model_max_length is {tokenizer.model_max_length}; "
                f"--set {name}={tokenizer.model_max_length + position_offset}, or retrain the tokenizer with "
                f"--model_max_length {usable_positions}"
            )


def preset_fix(key: str, preset: str) -> str:
    """How to fix the config value `key` of a config made from `preset`: the vocabulary from the tokenizer, another
    value the preset's, or the config class's default, or left out where the default computes it from the others."""
    if key == "vocab_size":
        return "set vocab_size to your tokenizer's (--tokenizer_dir sets it)"
    model_type, preset_values = PRESETS[preset]
    if key in preset_values:
        return f"--set {key}={json.dumps(preset_values[key])}, the preset's"
    defaults = config_class(model_type)().to_dict()
    if key not in defaults:  # a key of a nested mapping, e.g. rope_parameters.factor
        return f"fix it with --set {key.split('.')[0]}=..."
    if defaults[key] is None:
        return "leave it out"
    return f"--set {key}={json.dumps(defaults[key])}, the default"


def count_parameters(config):
    """Parameters of the transformers model (GPT2LMHeadModel, LlamaForCausalLM, ..., RobertaForMaskedLM) built from
    this config: as its family counts them, else those of the tensors its module exports."""
    if (count := family_of(config.model_type).count_parameters) is not None:
        return count(config)
    shapes = stock_module(config.model_type).hf_architecture_shapes(config)
    return sum(math.prod(shape) for shape in shapes.values())


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
        return config_class(model_type)(**values)
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
    layers, positions = f"{config.num_hidden_layers} layers", getattr(config, "max_position_embeddings", None)
    if family_of(model_type).encoder_decoder:
        layers = f"{config.num_layers} encoder and {config.num_decoder_layers} decoder layers"
    print(
        f"{args.preset} ({model_type}): {layers}, hidden size {config.hidden_size}, {config.num_attention_heads} "
        f"heads, {f'{positions} positions' if positions else 'relative positions'}, vocab size {config.vocab_size}"
    )
    print(f"parameters: {parameters:,} ({parameters / 1e6:.1f}M)")


if __name__ == "__main__":
    call_with_one_line_errors(main)
