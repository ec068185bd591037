"""The registry of model families: FAMILIES names one package per family (flax_lm/models/NAME/, whose __init__.py
defines its FAMILY and whose model.py computes its model types), and the lookups the tools make in it; no tool keeps
a table of families of its own. flax_lm/models/README.md says what a family holds and how to add one.

A model module (NAME/model.py) defines one model and what the tools need of it:

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

and, where the checkpoint names a tensor otherwise than the transformers class holds it in memory (GPT-NeoX's
embed_out, its lm_head):

    LOADED_NAMES            {checkpoint name: the class's name}, for the probe that loads weights into the class

To give one experiment a model of its own, copy a module beside the script (`cp flax_lm/models/gpt2/model.py
my_gpt2.py`), edit the copy and pass it to every tool with `--model_file my_gpt2.py`: flax_lm and every other run stay
as they are. See flax_lm/models/model_code.py for what a run records of the code and what its exports may claim.

Beside the families: shared/ holds what several of them compute alike; huggingface.py reads and writes Hugging Face
model directories (config, tokenizer, safetensors weights, sharded or not), and model_code.py says which code computes
a run's model and what its exports may claim.
"""

import contextlib
import importlib
import importlib.abc
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from flax_lm.errors import UsageError
from flax_lm.models.family import ModelFamily, TokenizerConventions


class MovedCommonModuleFinder(importlib.abc.MetaPathFinder):
    """An import of flax_lm.models.common, which moved, stops with one line naming where it went (but in a model file,
    common_under_its_0_4_name). The 0.4 modules that are family folders now still import, as their package: a name
    taken from it stops there (moved_to_model)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name == "common":
            raise SystemExit(
                "error: flax_lm.models.common moved to flax_lm.models.shared.common (each model family is a folder "
                "of flax_lm/models now, see flax_lm/models/README.md); change the import to "
                "flax_lm.models.shared.common"
            )
        return None


if not any(isinstance(finder, MovedCommonModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, MovedCommonModuleFinder())


@contextlib.contextmanager
def common_under_its_0_4_name():
    """While a model file is imported, flax_lm.models.common is flax_lm.models.shared.common, the same file moved: a
    copy of a flax_lm 0.4 module runs unedited, with the fingerprint its runs recorded (the files' bytes are the same),
    so that they resume and their exports load."""
    old_name = f"{__name__}.common"
    sys.modules[old_name] = importlib.import_module(f"{__name__}.shared.common")
    try:
        yield
    finally:
        del sys.modules[old_name]


def moved_to_model(family_name: str, name: str):
    """For the __getattr__ of a family whose module was flax_lm/models/NAME.py in 0.4: a name a script imported from
    that module (flax_lm.models.gpt2.FlaxGPT2LMHeadModel) stops the script with one line naming the module holding it
    now, NAME/model.py."""
    if name.startswith("__"):
        raise AttributeError(name)
    module = importlib.import_module(f"{__name__}.{family_name}.model")
    if name not in vars(module):
        raise AttributeError(f"module 'flax_lm.models.{family_name}' has no attribute '{name}'")
    raise SystemExit(
        f"error: flax_lm.models.{family_name}.{name} moved to flax_lm.models.{family_name}.model (each model family "
        f"is a folder of flax_lm/models now, see flax_lm/models/README.md); change the import to `from "
        f"flax_lm.models.{family_name}.model import {name}`"
    )


# The model families, one package each under flax_lm/models/, in the order the tools list them.
FAMILIES = (
    "gpt2",
    "llama",
    "gemma",
    "olmo2",
    "roberta",
    "smollm3",
    "gptj",
    "gpt_neox",
    "opt",
    "mixtral",
    "qwen_moe",
    "olmoe",
    "t5",
)


def family(name: str) -> ModelFamily:
    """The FAMILY that flax_lm/models/NAME/__init__.py registers."""
    return importlib.import_module(f"{__name__}.{name}").FAMILY


@cache
def family_of_model_types() -> dict[str, ModelFamily]:
    """model_type -> the family whose model.py computes it, for every model type of FAMILIES."""
    return {model_type: family(name) for name in FAMILIES for model_type in family(name).config_classes}


def family_of(model_type: str) -> ModelFamily | None:
    """The family that computes `model_type`, or None where no family does."""
    return family_of_model_types().get(model_type)


def presets() -> dict[str, tuple[str, dict]]:
    """create_config.py's presets: name -> (model_type, config values), family by family."""
    return {name: preset for family_name in FAMILIES for name, preset in family(family_name).presets.items()}


def config_class(model_type: str) -> type:
    """The transformers config class of `model_type` (a model type of FAMILIES)."""
    import transformers

    return getattr(transformers, family_of(model_type).config_classes[model_type])


def tokenizer_conventions() -> dict[str, TokenizerConventions]:
    """train_tokenizer.py's --model_type values -> their tokenizer conventions, family by family."""
    return {name: rules for family_name in FAMILIES for name, rules in family(family_name).tokenizers.items()}


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
    """The model types of FAMILIES that generate text (causal LMs), or that do not (masked LMs); encoder-decoders
    (encoder_decoder_types) are neither."""
    return [
        name
        for name, family in family_of_model_types().items()
        if not family.encoder_decoder and stock_module(name).GENERATES_TEXT == generates_text
    ]


def encoder_decoder_types() -> list[str]:
    """The model types of FAMILIES that are encoder-decoders (T5), which run_t5_mlm_flax.py trains."""
    return [name for name, family in family_of_model_types().items() if family.encoder_decoder]


def encoder_decoder_refusal(model_type: str | None, tool: str) -> UsageError | None:
    """The refusal of an encoder-decoder's model type by a script that trains causal or masked LMs, else None."""
    found = family_of(model_type) if model_type else None
    if found is None or not found.encoder_decoder:
        return None
    return UsageError(
        f"{tool} does not train {found.title} (model type '{model_type}', an encoder-decoder); "
        "run_t5_mlm_flax.py trains it"
    )


def check_model_type(model_type: str | None, generates_text: bool):
    """Refuse a --model_type the script does not train: run_clm_flax.py trains the models that generate text,
    run_mlm_flax.py the others, run_t5_mlm_flax.py the encoder-decoders."""
    script = "run_clm_flax.py" if generates_text else "run_mlm_flax.py"
    if refusal := encoder_decoder_refusal(model_type, script):
        raise refusal
    if model_type not in (None, *model_types(generates_text)):
        these, others = " and ".join(model_types(generates_text)), " and ".join(model_types(not generates_text))
        other_script = "run_mlm_flax.py" if generates_text else "run_clm_flax.py"
        raise UsageError(
            f"--model_type {model_type} is not supported; this script trains {these} ({other_script} trains {others})"
        )


def stock_module(model_type: str) -> ModuleType:
    """The model module that flax_lm ships for `model_type` (a model type of FAMILIES): its family's model.py."""
    return importlib.import_module(family_of(model_type).module_name)


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
        with common_under_its_0_4_name():
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


def model_module(
    model_type: str, model_file: str | None, generates_text: bool, tool: str, encoder_decoder: bool = False
) -> ModuleType:
    """The module that computes `model_type` for `tool` (a script name, for the messages): that of --model_file when
    given, else its family's model.py. Refused in one line: a type without a module, or a module of another
    type or of the other kind of model (masked for a causal tool, or the reverse; an encoder-decoder for either, or
    either for a tool of `encoder_decoder` models)."""
    if encoder_decoder:
        return encoder_decoder_module(model_type, model_file, tool)
    if refusal := encoder_decoder_refusal(model_type, tool):
        raise refusal
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


def encoder_decoder_module(model_type: str, model_file: str | None, tool: str) -> ModuleType:
    """model_module's answer for a tool of encoder-decoders (run_t5_mlm_flax.py): a module setting ENCODER_DECODER."""
    module = import_model_file(model_file) if model_file else None
    if module is None and family_of(model_type) is not None and family_of(model_type).encoder_decoder:
        module = stock_module(model_type)
    if module is None or not getattr(module, "ENCODER_DECODER", False):
        source = f"--model_file {model_file}" if model_file else f"model type '{model_type}'"
        raise UsageError(
            f"{tool} trains encoder-decoders ({', '.join(encoder_decoder_types())}), not {source}; pass a config of "
            "one (create_config.py --preset t5-tiny makes one)"
        )
    if model_type not in module.HF_ARCHITECTURES:
        raise UsageError(
            f"--model_file {model_file} computes model type {' and '.join(module.HF_ARCHITECTURES)} but the config is "
            f"of model type '{model_type}'; pass a config of that type, or a copy of the module of '{model_type}'"
        )
    return module


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


# The sizes the models build their arrays from, under each family's names: a whole number of 1 or more each (those
# a config leaves None are computed from the others: head_dim, n_inner). Gemma's query_pre_attn_scalar scales the
# attention scores by its inverse square root.
CONFIG_SIZES = (
    "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "max_position_embeddings", "n_positions",
    "type_vocab_size", "query_pre_attn_scalar",
)  # fmt: skip
# Token ids are int32 wherever they are read and trained (JAX without 64-bit types, the packed corpus).
MAX_VOCAB_SIZE = 2**31 - 1
# The config keys of the activation, as each family's config names it.
ACTIVATION_KEYS = ("activation_function", "hidden_activation", "hidden_act")


@dataclass(frozen=True)
class ConfigProblem:
    """What is wrong with a config: the config.json key at fault, and a sentence saying what, for the tool to add its
    fix to."""

    key: str
    text: str


def config_problem(config) -> ConfigProblem | None:
    """The first value of `config` no model computes with, or None: a number that is not finite, a size below 1 or
    not a whole number, a vocabulary beyond int32's ids, heads that the key/value heads do not divide, a dropout
    probability outside [0, 1), a norm's epsilon or an initializer range that is not positive, an activation no model
    computes.
    create_config.py refuses these before it writes a config, adding its hint; the tools that load one refuse a
    config.json edited by hand with them, which would otherwise fail in the model (a ZeroDivisionError, an allocation
    of many GiB, weights of NaN that the first step blames on the learning rate)."""
    if found := non_finite_config_value(config):
        name, value = found
        return ConfigProblem(name, f"{name} is {value}, not a finite number")
    for name in CONFIG_SIZES:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            name = config.attribute_map.get(name, name)  # as config.json spells it: GPT-2's n_head
            return ConfigProblem(name, f"{name} must be a whole number of 1 or more, not {value!r}")
    if (getattr(config, "vocab_size", None) or 0) > MAX_VOCAB_SIZE:
        return ConfigProblem(
            "vocab_size",
            f"vocab_size {config.vocab_size} is more token ids than int32 holds ({MAX_VOCAB_SIZE}), the type the "
            "tokens are read and trained as",
        )
    heads, key_value_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and key_value_heads and heads % key_value_heads:
        return ConfigProblem(
            "num_key_value_heads",
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {key_value_heads}",
        )
    values = config.to_dict()
    for name, rate in values.items():  # probabilities; 1 would drop everything
        is_rate = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        if name.endswith(("pdrop", "dropout", "dropout_prob")) and is_rate and not 0 <= rate < 1:
            return ConfigProblem(name, f"{name} is a dropout probability, in [0, 1), not {rate}")
    for name in ("layer_norm_epsilon", "layer_norm_eps", "initializer_range"):
        if (value := values.get(name)) is not None and not value > 0:
            return ConfigProblem(name, f"{name} must be positive, not {value}")
    from flax_lm.models.shared.common import ACTIVATIONS  # here: JAX, which it imports, takes a second to load

    name = next((key for key in ACTIVATION_KEYS if key in values), None)
    if name is not None and not (isinstance(values[name], str) and values[name] in ACTIVATIONS):
        return ConfigProblem(
            name,
            f"{name} {values[name]!r} is not an activation the models compute; use one of {', '.join(ACTIVATIONS)}",
        )
    return None
