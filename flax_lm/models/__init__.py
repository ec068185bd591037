"""The models, one module each, chosen by the `model_type` of a Hugging Face config.

MODEL_MODULES below is the one table of them; several model types may share a module where one is a configuration of
another's block (Qwen 2 and 3, Mistral: of Llama's). A model module defines one model and what the tools need of it:

    HF_ARCHITECTURES        the config.model_type values it computes -> the transformers class of each, whose
                            checkpoint layout its parameters map onto
    GENERATES_TEXT          a causal LM (run_clm_flax.py, generate_flax.py), or not (run_mlm_flax.py)
    MODEL_CLASS             the flax.linen model: MODEL_CLASS(config, dtype, param_dtype, remat_policy, mesh, ...)
                            returning float32 logits; a causal LM also decodes with a key/value cache (empty_cache)
    check_model_config(config, mesh)        refuse a config the module does not implement, in one line
    to_hf_state_dict(params), from_hf_state_dict(state_dict, abstract_params)
                            the parameters as the transformers checkpoint names and lays them out, and back
    hf_shapes(params), hf_architecture_shapes(config)
                            the shapes of the first, and those the architecture has, to check they agree

and, where it computes config fields its transformers class lacks (GPT-2's block options):

    BLOCK_OPTIONS           those fields, which create_config.py --set accepts
    export_refusal(config)  why an export of the model of `config` cannot name the architecture, or None

To give one experiment a model of its own, copy a module beside the script (`cp flax_lm/models/gpt2.py my_gpt2.py`),
edit the copy and pass it to every tool with `--model_file my_gpt2.py`: flax_lm and every other run stay as they are.
See flax_lm/models/model_code.py for what a run records of the code and what its exports may claim.

Beside the models: huggingface.py reads and writes Hugging Face model directories (config, tokenizer, safetensors
weights, sharded or not), and model_code.py says which code computes a run's model and what its exports may claim.
"""

import importlib
import importlib.util
import math
import os
import sys
from types import ModuleType

from flax_lm.errors import UsageError

# model_type -> the module that computes it.
MODEL_MODULES = {
    "gpt2": "flax_lm.models.gpt2",
    "llama": "flax_lm.models.llama",
    "mistral": "flax_lm.models.llama",
    "qwen2": "flax_lm.models.llama",
    "qwen3": "flax_lm.models.llama",
    "gemma2": "flax_lm.models.gemma",
    "gemma3_text": "flax_lm.models.gemma",
    "olmo2": "flax_lm.models.olmo2",
    "roberta": "flax_lm.models.roberta",
    "mixtral": "flax_lm.models.mixtral.model",
    "qwen2_moe": "flax_lm.models.qwen_moe.model",
    "qwen3_moe": "flax_lm.models.qwen_moe.model",
    "olmoe": "flax_lm.models.olmoe.model",
}

# What a module must define, for the tools to train, export and decode its model.
MODULE_INTERFACE = (
    "HF_ARCHITECTURES",
    "GENERATES_TEXT",
    "MODEL_CLASS",
    "check_model_config",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "hf_shapes",
    "hf_architecture_shapes",
)


def model_types(generates_text: bool) -> list[str]:
    """The model types of MODEL_MODULES that generate text (causal LMs), or that do not (masked LMs)."""
    return [name for name in MODEL_MODULES if stock_module(name).GENERATES_TEXT == generates_text]


def check_model_type(model_type: str | None, generates_text: bool):
    """Refuse a --model_type the script does not train: run_clm_flax.py trains the models that generate text,
    run_mlm_flax.py the others."""
    if model_type not in (None, *model_types(generates_text)):
        these, others = " and ".join(model_types(generates_text)), " and ".join(model_types(not generates_text))
        other_script = "run_mlm_flax.py" if generates_text else "run_clm_flax.py"
        raise UsageError(
            f"--model_type {model_type} is not supported; this script trains {these} ({other_script} trains {others})"
        )


def stock_module(model_type: str) -> ModuleType:
    return importlib.import_module(MODEL_MODULES[model_type])


def import_model_file(path: str) -> ModuleType:
    """The module of a model file of one's own (a copy of a module of flax_lm/models, edited), by its path."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise UsageError(
            f"--model_file {path}: no such Python file; pass the path of a copy of a flax_lm/models module"
        )
    name = f"flax_lm_model_file_{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and flax.struct look classes up by their module's name
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UsageError(f"--model_file {path} fails on import ({type(error).__name__}: {error})") from None
    missing = [name for name in MODULE_INTERFACE if not hasattr(module, name)]
    if missing:
        raise UsageError(
            f"--model_file {path} does not define {', '.join(missing)}; copy a module of flax_lm/models and edit it"
        )
    return module


def model_module(model_type: str, model_file: str | None, generates_text: bool, tool: str) -> ModuleType:
    """The module that computes `model_type` for `tool` (a script name, for the messages): that of --model_file when
    given, else the one MODEL_MODULES names. Refused in one line: a type without a module, or a module of another
    type or of the other kind of model (masked for a causal tool, or the reverse)."""
    kind = "causal" if generates_text else "masked"
    if model_file:
        module = import_model_file(model_file)
        if model_type not in module.HF_ARCHITECTURES:
            raise UsageError(
                f"--model_file {model_file} computes model type {' and '.join(module.HF_ARCHITECTURES)} but the "
                f"config is of model type '{model_type}'; pass a config of that type, or a copy of the module of "
                f"'{model_type}'"
            )
        if module.GENERATES_TEXT != generates_text:
            raise UsageError(f"{tool} cannot run --model_file {model_file}: it is not a {kind} LM")
        return module
    trained_here = model_types(generates_text)
    if model_type not in trained_here:
        raise UsageError(
            f"{tool} has no model of type '{model_type}': it runs {', '.join(trained_here)} (the {kind} LMs of "
            "flax_lm/models/__init__.py); pass a config of one of those (create_config.py makes one)"
        )
    return stock_module(model_type)


def non_finite_config_value(config) -> tuple[str, float] | None:
    """The first value of `config` (its config.json's keys, those of nested mappings joined by ".") that is a number
    but not a finite one (NaN, Infinity, as Python's json reads and writes them), with that value; None where every
    number is finite. No model computes with such a value: an initializer_range of Infinity fills the weights with
    NaN, which the first step then blames on the learning rate."""

    def first(value, name: str):
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if found := first(item, f"{name}.{key}" if name else str(key)):
                return found
        return None

    return first(config.to_dict(), "")


# The sizes the models build their arrays from, under each family's names: a whole number of 1 or more each.
CONFIG_SIZES = (
    "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings", "n_positions",
)  # fmt: skip
# Token ids are int32 wherever they are read and trained (JAX without 64-bit types, the packed corpus).
MAX_VOCAB_SIZE = 2**31 - 1


def config_size_problem(config) -> str | None:
    """What is wrong with `config`'s sizes (a size below 1 or not a whole number, a vocabulary beyond int32's ids,
    heads that the key/value heads do not divide), or None. create_config.py refuses these when it writes a config;
    this catches a config.json edited by hand, which would otherwise fail in the model with a ZeroDivisionError or
    an allocation of many GiB."""
    for name in CONFIG_SIZES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            # Named as its config.json spells it (GPT-2's n_head for num_attention_heads).
            return f"{config.attribute_map.get(name, name)} is {value!r}, not a whole number of 1 or more"
    if (getattr(config, "vocab_size", None) or 0) > MAX_VOCAB_SIZE:
        return f"vocab_size {config.vocab_size} is more token ids than int32 holds ({MAX_VOCAB_SIZE})"
    heads, key_value_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and key_value_heads and heads % key_value_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {key_value_heads}"
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is not None and not scalar > 0:
        return f"query_pre_attn_scalar is {scalar!r}, not positive (the scores are scaled by its inverse square root)"
    return None
