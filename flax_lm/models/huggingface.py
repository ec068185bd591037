"""Hugging Face model directories: the config and tokenizer a run starts from, the safetensors weights it continues
from, and the directory it exports (config.json, model.safetensors, tokenizer), which transformers loads; or, for
model code not known to compute a transformers architecture, flax_model.safetensors beside the model file."""

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import struct
from dataclasses import dataclass

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import transformers
import xxhash
from flax.traverse_util import flatten_dict, unflatten_dict
from huggingface_hub import split_state_dict_into_shards_factory
from jax.experimental import multihost_utils
from safetensors import SafetensorError
from safetensors.numpy import save_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from flax_lm.data.chat import stop_token_ids, training_chat_template
from flax_lm.errors import UsageError, first_line, naming_a_full_disk
from flax_lm.models import config_problem, family_of, stock_module
from flax_lm.models.model_code import (
    FINGERPRINT_KEY,
    FLAX_WEIGHTS_NAME,
    MODEL_FILE_KEY,
    PROBE_TOLERANCE,
    ModelCode,
    check_model_file_of,
    probe_ids,
    probe_length,
    routes_difference,
)
from flax_lm.models.tokenizer_files import CHAT_TEMPLATE_FILE, save_tokenizer_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLoading:
    """What loading a model takes: where its config, tokenizer and weights come from (a directory or hub name each;
    the config and tokenizer default to the model's), the model type without a config, the chat template file, and
    how the hub is reached and what may be read. The scripts fill it from their flags
    (flax_lm.command_line.model_loading.model_loading)."""

    model_name_or_path: str | None = None
    config_name: str | None = None
    tokenizer_name: str | None = None
    model_type: str | None = None
    chat_template_path: str | None = None
    cache_dir: str | None = None
    token: str | None = None
    allow_pickle_weights: bool = False


def check_local_model_directory(flag: str, name_or_path: str):
    """Refuse, naming the path, a `flag` value meant as a local directory where there is none: the loaders would take
    it for a hub name and answer about the hub. A hub name is NAME or OWNER/NAME, starting with neither . nor ~; a
    value with more parts, or whose first part is a local directory, is a path."""
    parts = name_or_path.replace(os.sep, "/").split("/")
    meant_as_path = (
        name_or_path.startswith((".", "~")) or os.path.isabs(name_or_path) or len(parts) > 2 or os.path.isdir(parts[0])
    )
    if meant_as_path and not os.path.exists(name_or_path):
        raise UsageError(
            f"{flag} {name_or_path}: no such directory; pass an existing directory, or a hub name such as "
            "openai-community/gpt2"
        )


def check_config_values(config, source: str):
    """Refuse a config (of `source`, a flag and its value) with a value no model computes with (config_problem: a
    number that is not finite, a size no model can be built with ...), before anything is built or written."""
    if problem := config_problem(config):
        raise UsageError(f"{source}: the config's {problem.text}; fix its config.json (create_config.py writes one)")


def load_config_and_tokenizer(loading: ModelLoading, default_model_type: str):
    """The config (of --config_name or --model_name_or_path; without either the default one of --model_type, else of
    `default_model_type`) and the fast tokenizer, checked against each other."""

    def load(loader, name, flag):
        try:
            return loader.from_pretrained(name, cache_dir=loading.cache_dir, token=loading.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load {flag} {name}: {first_line(error)}") from None

    if loading.config_name or loading.model_name_or_path:
        config_flag = "--config_name" if loading.config_name else "--model_name_or_path"
        config_source = loading.config_name or loading.model_name_or_path
        config = load(AutoConfig, config_source, config_flag)
        check_config_values(config, f"{config_flag} {config_source}")
        if loading.model_type and loading.model_type != config.model_type:
            raise UsageError(
                f"--model_type {loading.model_type} contradicts {config_flag} {config_source}, a "
                f"{config.model_type} model: the config chooses the model; leave --model_type out"
            )
    else:
        model_type = loading.model_type or default_model_type
        logger.warning("No --config_name: training a %s with the default configuration", model_type)
        config = transformers.CONFIG_MAPPING[model_type]()

    tokenizer_flag = "--tokenizer_name" if loading.tokenizer_name else "--model_name_or_path"
    tokenizer_source = loading.tokenizer_name or loading.model_name_or_path
    tokenizer = load(AutoTokenizer, tokenizer_source, tokenizer_flag)
    if not tokenizer.is_fast:
        raise UsageError(f"{tokenizer_flag} {tokenizer_source} is not a fast (tokenizers-backed) tokenizer")
    if loading.chat_template_path:
        tokenizer.chat_template = read_chat_template(loading.chat_template_path)
    if isinstance(tokenizer.chat_template, str):
        tokenizer.chat_template = training_chat_template(tokenizer.chat_template)
    backend = tokenizer.backend_tokenizer
    if backend.get_vocab_size(with_added_tokens=False) == 0:
        raise UsageError(
            f"{tokenizer_flag} {tokenizer_source} has no vocabulary (no tokenizer.json or vocabulary files), so it "
            "cannot encode text; pass a tokenizer directory made by train_tokenizer.py"
        )
    added_beyond = [
        token for token_id, token in backend.get_added_tokens_decoder().items() if token_id >= config.vocab_size
    ]
    # Every id a text can be encoded to must have an embedding; special tokens beyond it are made plain text below.
    any_text_token_beyond = any(not token.special for token in added_beyond)
    if backend.get_vocab_size(with_added_tokens=False) > config.vocab_size or any_text_token_beyond:
        raise UsageError(
            f"the tokenizer has {len(tokenizer)} tokens but the config's vocab_size is {config.vocab_size}; "
            "ids beyond it would be clamped silently, so raise vocab_size in the config "
            "(create_config.py --tokenizer_dir)"
        )
    if added_beyond:
        # AutoTokenizer gives a GPT-2 tokenizer that lacks it an <|endoftext|> past the vocabulary. Such special
        # tokens are never inserted here; written in a text, they are encoded as the plain text they are.
        tokenizer.split_special_tokens = backend.encode_special_tokens = True  # the wrapper resets the backend's
        logger.warning(
            "The special tokens %s lie beyond the model's vocabulary of %d; they are not used, and special tokens "
            "written in the texts are encoded as text",
            ", ".join(token.content for token in added_beyond),
            config.vocab_size,
        )
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id < config.vocab_size:
        eos_source = "the tokenizer's end-of-text token"
    elif config.eos_token_id is not None and 0 <= config.eos_token_id < config.vocab_size:
        # The model's own end-of-text token; the exported tokenizer names it too, so generation stops there.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
        eos_source = "the config's eos_token_id"
    else:
        raise UsageError(
            f"the tokenizer's end-of-text token {tokenizer.eos_token} is not among the model's {config.vocab_size} "
            "ids and the config names none that is; set eos_token_id in the config or eos_token in "
            "tokenizer_config.json"
        )
    logger.info("Documents end with %s, id %d (%s)", tokenizer.eos_token, tokenizer.eos_token_id, eos_source)
    return config, tokenizer


def read_chat_template(path: str) -> str:
    """The template of --chat_template_path: a Jinja file, or a tokenizer directory's chat_template.jinja."""
    file_path = os.path.join(path, CHAT_TEMPLATE_FILE) if os.path.isdir(path) else path
    try:
        with open(file_path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise UsageError(
            f"cannot read --chat_template_path {path} ({file_path}: {reason}); pass a Jinja file or a tokenizer "
            "directory holding chat_template.jinja"
        ) from None


# safetensors dtype names -> numpy dtypes; bfloat16 (how Llama checkpoints are saved) through ml_dtypes, which
# safetensors' own numpy reader does not use.
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as numpy arrays of their own dtype, bfloat16 included, memory-mapped: a
    tensor is read from disk when it is used. The format: an 8-byte little-endian header size, a JSON header of each
    tensor's dtype, shape and byte range, then the bytes. A file this repository exported carries the checksum of its
    tensors, which is compared here: a file whose bytes changed since is refused in one line."""
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        if header_size > os.path.getsize(path) - 8:
            raise SafetensorError(f"its header claims {header_size} bytes, more than the file holds")
        header = json.loads(file.read(header_size))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise SafetensorError(f"tensor {name} has dtype {entry['dtype']}, which cannot be read here")
        start, end = entry["data_offsets"]
        tensors[name] = data[start:end].view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    recorded = (header.get("__metadata__") or {}).get(TENSORS_CHECKSUM_KEY)
    if recorded is not None and recorded != tensors_checksum(tensors):
        raise UsageError(
            f"{path} does not hold the tensors it was saved with (their checksum differs from the one saved in it): "
            "its bytes changed since; export the model again from its training checkpoint, or copy the file again"
        )
    return tensors


# The key of the metadata of a safetensors file this repository writes under which it records tensors_checksum of
# the file's tensors, which load_safetensors compares. Other programs' files have none, and a model saved again by
# transformers (which writes only its own metadata) is read as any other.
TENSORS_CHECKSUM_KEY = "flax_lm_tensors_checksum"


def tensors_checksum(tensors: dict[str, np.ndarray]) -> str:
    """XXH3-128 (flax_lm.run.checksums' hash) of the tensors' names, dtypes, shapes and bytes, in the order of their
    names: of what a safetensors file holds, however its bytes are laid out."""
    hasher = xxhash.xxh3_128()
    for name in sorted(tensors):
        tensor = np.ascontiguousarray(tensors[name])
        hasher.update(f"{name} {tensor.dtype.name} {tensor.shape}\n".encode())
        hasher.update(tensor.reshape(-1).view(np.uint8))
    return hasher.hexdigest()


SAFETENSORS_WEIGHTS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# How transformers names the shards of sharded weights (model-00001-of-00003.safetensors).
SHARD_NAME = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
# The shards save_pretrained writes, model-00001-of-00003.safetensors, ..., which its index names.
SAFETENSORS_SHARD_PATTERN = "model{suffix}.safetensors"


def read_safetensors_checkpoint(name_or_path: str, loading: ModelLoading | None) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors (or its shards) from a local directory or the hub (as `loading` reaches it;
    None: with no cache directory or token of its own, and no pickled weights read)."""
    loading = loading or ModelLoading()
    import huggingface_hub

    def fetch(filename):
        """The file's local path, or None where there is no such file."""
        if os.path.isdir(name_or_path):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
        try:
            return huggingface_hub.hf_hub_download(
                name_or_path, filename, cache_dir=loading.cache_dir, token=loading.token
            )
        except huggingface_hub.errors.EntryNotFoundError:
            return None
        except (huggingface_hub.errors.HfHubHTTPError, OSError, ValueError) as error:
            raise UsageError(f"cannot download {filename} of {name_or_path}: {error}") from None

    def read(path):
        try:
            return load_safetensors(path)
        except (SafetensorError, OSError, ValueError, KeyError, struct.error) as error:
            raise UsageError(
                f"{path} is not a readable safetensors file ({first_line(error)}); save it again"
            ) from None

    # In transformers' order (modeling_utils' checkpoint files): model.safetensors before an index beside it.
    if (path := fetch(SAFETENSORS_WEIGHTS)) is not None:
        return read(path)
    if (index_path := fetch(SAFETENSORS_INDEX)) is not None:
        try:
            with open(index_path) as index_file:
                shard_names = sorted(set(json.load(index_file)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{index_path} is not a safetensors index (JSON with a weight_map)") from None
        state_dict = {}
        for shard_name in shard_names:
            if (shard_path := fetch(shard_name)) is None:
                raise UsageError(f"{name_or_path} has no {shard_name}, a shard its {SAFETENSORS_INDEX} names")
            state_dict.update(read(shard_path))
        return state_dict
    if (pickle_path := fetch("pytorch_model.bin")) is None:
        raise UsageError(f"{name_or_path} has no model.safetensors")
    if not loading.allow_pickle_weights:
        raise UsageError(
            f"{name_or_path} holds only pytorch_model.bin, a pickle that can run code when loaded; convert it to "
            "model.safetensors, or pass --allow_pickle_weights if you trust the file"
        )
    try:
        import torch
    except ImportError:
        raise UsageError("reading pytorch_model.bin needs PyTorch: pip install torch") from None
    # weights_only refuses anything in the pickle but tensors and plain containers, before running any of it.
    try:
        state_dict = torch.load(pickle_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):
        raise UsageError(
            f"{pickle_path} cannot be loaded as plain tensors: it holds other objects (none of them was run) or is "
            "damaged; convert it to model.safetensors where you trust it"
        ) from None
    if not (isinstance(state_dict, dict) and all(isinstance(tensor, torch.Tensor) for tensor in state_dict.values())):
        raise UsageError(f"{pickle_path} is not a state dict of named tensors; convert it to model.safetensors")
    return {name: tensor.float().numpy() for name, tensor in state_dict.items()}


def write_model_weights(output_dir: str, state_dict: dict[str, np.ndarray], file_name: str):
    """The weights file `file_name` in `output_dir`, replaced in one step so that no reader sees it half written, with
    the checksum of its tensors in its metadata (TENSORS_CHECKSUM_KEY), which load_safetensors compares."""
    os.makedirs(output_dir, exist_ok=True)
    weights_path = os.path.join(output_dir, file_name)
    try:
        metadata = {"format": "pt", TENSORS_CHECKSUM_KEY: tensors_checksum(state_dict)}
        save_file(state_dict, f"{weights_path}.tmp", metadata=metadata)
    except BaseException:  # a full disk, say: the part written would only keep the disk full
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{weights_path}.tmp")
        raise
    # safetensors writes 0600; the other files follow the umask. It can only be read by setting it: to the strictest
    # value, so that a file another thread creates meanwhile is never more open than the user asked for.
    umask = os.umask(0o077)
    os.umask(umask)
    os.chmod(f"{weights_path}.tmp", 0o666 & ~umask)
    os.replace(f"{weights_path}.tmp", weights_path)


# The units of --max_shard_size: the decimal ones save_pretrained takes (huggingface_hub's parse_size_to_int: 5GB,
# 500MB, 1.5GB) and the binary ones of transformers' own size parser (transformers.utils.hub.convert_file_size_to_int:
# 5GiB, 64KiB); none, a number of bytes.
SIZE_UNITS = {
    "": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def shard_size_in_bytes(size: str) -> int:
    """--max_shard_size in bytes: a number and a unit of SIZE_UNITS, in any case, as transformers takes them (5GB,
    1.5GB, 500MiB, 5KiB), or a number of bytes. ValueError for anything else."""
    parts = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", size)
    if parts is None or parts[2].upper() not in SIZE_UNITS or int(float(parts[1]) * SIZE_UNITS[parts[2].upper()]) < 1:
        raise ValueError(f"{size} is not a positive size with a unit of {', '.join(SIZE_UNITS)[2:]}")
    return int(float(parts[1]) * SIZE_UNITS[parts[2].upper()])


def write_transformers_weights(output_dir: str, state_dict: dict[str, np.ndarray], max_shard_size: str | None) -> set:
    """model.safetensors or, for weights larger than `max_shard_size` ("5GB", "500MB", a number of bytes), shards of
    at most that size with their index (model.safetensors.index.json), laid out and named as save_pretrained lays them
    out; the index last, so that a reader finds the shards it names all there. Returns the names of the files written
    (remove_replaced_weights then removes the earlier layout's)."""
    split = split_state_dict_into_shards_factory(
        state_dict,
        get_storage_size=lambda tensor: tensor.nbytes,
        filename_pattern=SAFETENSORS_SHARD_PATTERN,
        max_shard_size=shard_size_in_bytes(max_shard_size)
        if max_shard_size
        else sum(t.nbytes for t in state_dict.values()),
    )
    index_path = os.path.join(output_dir, SAFETENSORS_INDEX)
    for file_name, tensor_names in split.filename_to_tensors.items():
        write_model_weights(output_dir, {name: state_dict[name] for name in tensor_names}, file_name)
    written = set(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(f"{index_path}.tmp", "w") as file:
            json.dump(index, file, indent=2, sort_keys=True)
        os.replace(f"{index_path}.tmp", index_path)
        written.add(SAFETENSORS_INDEX)
    return written


def check_architecture_fits(params, config, model):
    """Refuse, in one line, parameters that do not map onto the architecture an export of them names
    (`model.HF_ARCHITECTURES[config.model_type]` in config.json): transformers would load such weights with some of
    them dropped or initialised at random, and no error. `params` may be abstract (shapes only); `model` is the
    model's module, whose hf_shapes lays them out as its to_hf_state_dict does and whose hf_architecture_shapes lists
    the architecture's tensors for `config`."""
    exported, expected = model.hf_shapes(params), model.hf_architecture_shapes(config)
    architecture = model.HF_ARCHITECTURES[config.model_type]
    problems = [
        f"the parameter {name} {shape} is not part of {architecture}"
        if name not in expected
        else f"the parameter {name} has shape {shape} where {architecture} has {expected[name]}"
        for name, shape in exported.items()
        if expected.get(name) != shape
    ]
    problems += [
        f"no parameter maps onto {architecture}'s {name} {shape}"
        for name, shape in expected.items()
        if name not in exported
    ]
    if problems:
        raise UsageError(
            f"the model no longer maps onto {architecture}, which its export names in config.json: {problems[0]}; "
            f"map the model onto it in to_hf_state_dict and hf_shapes of {model.__name__}, or name there an "
            "architecture the model fits (HF_ARCHITECTURES, and its tensors in hf_architecture_shapes)"
        )


def save_model(output_dir: str, params, config, tokenizer, model_code: ModelCode, max_shard_size: str | None = None):
    """A Hugging Face model directory: config.json, the weights, the tokenizer and, for a model that generates text
    (GENERATES_TEXT, or an encoder-decoder: ENCODER_DECODER), its generation config (for one that does not, an
    earlier model's there is removed). Where
    `model_code` claims its architecture (flax_lm.models.model_code), the config names it and model.safetensors holds
    the weights as the module maps them (to_hf_state_dict), for transformers; otherwise flax_model.safetensors holds
    the Flax parameters, beside a copy of the model file, for the tools of this repository (--model_file), and
    transformers finds no weights it could load as another model. With `max_shard_size`, model.safetensors is split
    into shards of at most that size, with their index (write_transformers_weights).

    An export of code other than a verified stock module that names the architecture is read back as that class and
    compared with the model that trained (export_difference); where it computes another model (parameters the
    architecture lacks, left out of its layout, such as adapters never merged), the claim is withdrawn, for this
    export and the run's later ones, and the export written again as of code of its own.

    Every process takes part in gathering the parameters; process 0 writes. Parameters that would not load as the
    architecture the config names are refused first (check_architecture_fits), by every process, with nothing written.
    """
    if model_code.claims_architecture:
        check_architecture_fits(params, config, model_code.module)
    host_params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return
    write_export(output_dir, host_params, config, tokenizer, model_code, max_shard_size)
    if not model_code.claims_architecture or model_code.is_verified_stock:
        return
    architecture = model_code.module.HF_ARCHITECTURES[config.model_type]
    float32_params = jax.tree.map(lambda value: np.asarray(value, np.float32), host_params)
    difference = export_difference(output_dir, model_code.module.MODEL_CLASS(config), float32_params)
    if isinstance(difference, float) and difference <= PROBE_TOLERANCE:
        logger.info(
            "The export to %s, read back as %s, computes the trained model (within %.1g)",
            output_dir,
            architecture,
            difference,
        )
        return
    found = (
        difference
        if isinstance(difference, str)
        else f"its logits differ from the trained model's by up to {difference:.2g} of the largest"
    )
    model_code.withdraw_claim(
        f"the export to {output_dir}, read back as {architecture}, is not the model that trained ({found}: parameters "
        f"of the model file that {architecture} lacks are left out of its layout, adapters never merged for one), so "
        f"exports do not name {architecture}; they hold {FLAX_WEIGHTS_NAME} and the model file"
    )
    write_export(output_dir, host_params, config, tokenizer, model_code, max_shard_size)


def write_export(output_dir: str, host_params, config, tokenizer, model_code: ModelCode, max_shard_size: str | None):
    """The files of save_model's export of `host_params` (on this host)."""
    model = model_code.module
    config = copy_of(config)
    for key in (MODEL_FILE_KEY, FINGERPRINT_KEY):
        if hasattr(config, key):
            delattr(config, key)
    with naming_a_full_disk("--output_dir", output_dir):
        if model_code.claims_architecture:
            written = write_transformers_weights(output_dir, model.to_hf_state_dict(host_params), max_shard_size)
            remove_replaced_weights(output_dir, written)
            # What AutoModelFor... and pipeline(...) build.
            config.architectures = [model.HF_ARCHITECTURES[config.model_type]]
        else:
            flat = {"/".join(path): np.asarray(value) for path, value in flatten_dict(host_params).items()}
            write_model_weights(output_dir, flat, FLAX_WEIGHTS_NAME)
            # Weights for transformers there would load as the architecture the earlier config named.
            remove_replaced_weights(output_dir, {FLAX_WEIGHTS_NAME})
            model_file = os.path.basename(model_code.own_file or model.__file__)
            shutil.copyfile(model.__file__, os.path.join(output_dir, model_file))
            config.architectures = None
            setattr(config, MODEL_FILE_KEY, model_file)
            setattr(config, FINGERPRINT_KEY, model_code.fingerprint)
        config.save_pretrained(output_dir)
        add_transformers_4_keys(os.path.join(output_dir, "config.json"))
        if model.GENERATES_TEXT or getattr(model, "ENCODER_DECODER", False):
            generation_config = GenerationConfig.from_model_config(config)
            if getattr(model, "ENCODER_DECODER", False):  # generate starts the decoder there (T5's: from pad)
                generation_config.decoder_start_token_id = model.decoder_start_id(config)
            # Where the tokenizer's chat template ends a turn with a token of its own, generation stops there too.
            if len(stop_ids := stop_token_ids(tokenizer, config.eos_token_id)) > 1:
                generation_config.eos_token_id = stop_ids
            generation_config.save_pretrained(output_dir)
        else:
            remove_if_there(os.path.join(output_dir, "generation_config.json"))  # an earlier model's, here
        save_tokenizer_files(tokenizer, output_dir)


def export_difference(export_dir: str, trained_model, trained_params) -> float | str:
    """How far the export in `export_dir` is from the model that trained (`trained_model`, a flax_lm model module's
    model class, with `trained_params` in float32): the export is read as the architecture its config.json names, by
    flax_lm's own module of that class (its family's model.py, the code the parity tests compare with transformers,
    so no PyTorch is needed), and the largest difference of their logits is returned, relative to the largest logit
    where that is over 1 (routes_difference), on the rows of the probe: every token id and position, through every
    layer, and the trained model's key/value cache too. Or why the export cannot be read as that class.

    A model file's parameters that the architecture lacks are left out of the export (its to_hf_state_dict); what the
    random weights of the probe could not show, the trained ones do: a low-rank adapter whose second factor starts at
    zero and that is never merged into the weights computes as the base model until trained."""
    config = AutoConfig.from_pretrained(export_dir)
    if family_of(config.model_type) is None or not config.architectures:
        return f"its config.json names no architecture of flax_lm/models ({config.model_type})"
    module = stock_module(config.model_type)
    if config.architectures != [module.HF_ARCHITECTURES[config.model_type]]:
        return f"its config.json names {config.architectures}, not {module.HF_ARCHITECTURES[config.model_type]}"
    model = module.MODEL_CLASS(config)
    ids = probe_ids(config.vocab_size, probe_length(module, config))
    abstract = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), ids[:1])["params"])
    try:
        params = module.from_hf_state_dict(read_safetensors_checkpoint(export_dir, None), abstract)
    except UsageError as error:
        return str(error)
    exported_logits = jax.jit(lambda params, rows: model.apply({"params": params}, rows))

    def expected_logits(rows):
        return np.asarray(exported_logits(params, rows))

    encoder_decoder = getattr(module, "ENCODER_DECODER", False)
    return routes_difference(
        trained_model, trained_params, ids, expected_logits, module.GENERATES_TEXT, encoder_decoder
    )


def add_transformers_4_keys(config_path: str):
    """Write into config.json what transformers 4 reads under other names than transformers 5 writes: the rotary
    settings (rope_theta, rope_scaling, Gemma 3's rope_local_base_freq for its sliding layers, GPT-NeoX's
    rotary_emb_base and rotary_pct) beside transformers 5's rope_parameters, which transformers 4 ignores: without them
    it would rotate with its own defaults (a base of 10,000, a quarter of each GPT-NeoX head), whatever the model was
    trained with; and whether a T5's output layer is its own (v1.1): transformers 5 writes tie_word_embeddings true for
    every T5 and keeps that in scale_decoder_outputs, transformers 4 reads tie_word_embeddings alone and would replace
    the head with the embedding. transformers 5 reads both consistently."""
    with open(config_path) as file:
        config = json.load(file)
    if config.get("model_type") == "t5" and config.get("scale_decoder_outputs") is False:
        config["tie_word_embeddings"] = False
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        add_transformers_4_rope_keys(config, rope)
    with open(f"{config_path}.tmp", "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    os.replace(f"{config_path}.tmp", config_path)


def add_transformers_4_rope_keys(config: dict, rope: dict):
    """The rotary settings of `rope` (rope_parameters) added to `config` under transformers 4's names."""
    if "full_attention" in rope:  # one setting per layer type (Gemma 3): transformers 4 scales the global layers only
        if "rope_theta" in rope.get("sliding_attention", {}):
            config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if config.get("model_type") == "gpt_neox":  # which transformers 4 reads under names of its own
        config["rotary_emb_base"] = rope.get("rope_theta", 10000.0)
        config["rotary_pct"] = rope.get("partial_rotary_factor", 1.0)
    scaling = {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", "default") == "default":
        config["rope_scaling"] = None
    elif config.get("model_type") == "olmo2":  # transformers 4's OLMo 2 takes these two fields and no others
        config["rope_scaling"] = {"type": scaling["rope_type"], "factor": scaling.get("factor")}
    else:
        config["rope_scaling"] = scaling


def remove_replaced_weights(output_dir: str, written: set[str]):
    """Remove every weights file in `output_dir` but those `written` by the export just made: the other format's, and
    the model that a run continuing in place (--model_name_or_path and --output_dir the same) started from: sharded
    safetensors (the index and the shards it names), pytorch_model.bin, its index and shards. Left there, they would be
    a second model in the directory, which a loader with another order than transformers' would read."""
    names = {SAFETENSORS_WEIGHTS, FLAX_WEIGHTS_NAME, SAFETENSORS_INDEX, PICKLE_WEIGHTS, PICKLE_INDEX}
    names.update(name for name in os.listdir(output_dir) if SHARD_NAME.fullmatch(name))
    for index_name in (SAFETENSORS_INDEX, PICKLE_INDEX):
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError, TypeError):
            with open(os.path.join(output_dir, index_name)) as index_file:
                shard_names = set(json.load(index_file)["weight_map"].values())
            names.update(name for name in shard_names if isinstance(name, str) and os.path.basename(name) == name)
    removed = sorted(name for name in names - written if os.path.isfile(os.path.join(output_dir, name)))
    for name in removed:
        os.remove(os.path.join(output_dir, name))
    if removed:
        logger.warning(
            "removed %s from %s: the exported %s replace them",
            ", ".join(removed),
            output_dir,
            ", ".join(sorted(written)),
        )


def copy_of(config):
    return config.__class__.from_dict(config.to_dict())


def remove_if_there(path: str):
    if os.path.isfile(path):
        os.remove(path)


def read_exported_params(source: str, loading: ModelLoading | None, model_code: ModelCode, abstract_params) -> dict:
    """The weights of a model directory or hub name `source` (reached as `loading` says) as parameters shaped like
    `abstract_params`: those of an export of this code's own (flax_model.safetensors), or a transformers checkpoint
    mapped by the module (from_hf_state_dict)."""
    flax_weights = os.path.join(source, FLAX_WEIGHTS_NAME)
    if os.path.isdir(source) and os.path.isfile(flax_weights):
        # transformers, which knows no flax_model.safetensors, would load the other: two loaders, two models.
        if others := [
            name for name in (SAFETENSORS_WEIGHTS, SAFETENSORS_INDEX) if os.path.isfile(os.path.join(source, name))
        ]:
            raise UsageError(
                f"{source} holds both {FLAX_WEIGHTS_NAME} and {others[0]}, which transformers would load instead; "
                "remove the one that is not the model"
            )
        directory_config = AutoConfig.from_pretrained(source)
        if getattr(directory_config, MODEL_FILE_KEY, None) is None:
            raise UsageError(f"{source} holds {FLAX_WEIGHTS_NAME} but its config.json names no model file")
        check_model_file_of(directory_config, model_code, source)
        try:
            flat = load_safetensors(flax_weights)
        except (SafetensorError, OSError, ValueError, KeyError, struct.error) as error:
            raise UsageError(f"{flax_weights} is not a readable safetensors file ({error}); save it again") from None
        params = {}
        for path, expected in flatten_dict(abstract_params).items():
            name = "/".join(path)
            if name not in flat or flat[name].shape != expected.shape:
                raise UsageError(
                    f"{flax_weights} has no parameter {name} of shape {expected.shape}; it is of another model"
                )
            params[path] = np.asarray(flat[name]).astype(expected.dtype)
        return unflatten_dict(params)
    return model_code.module.from_hf_state_dict(read_safetensors_checkpoint(source, loading), abstract_params)
