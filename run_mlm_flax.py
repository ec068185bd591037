#!/usr/bin/env python3
"""Pretrain a RoBERTa masked language model with JAX/Flax.

Trains from scratch (a config and a tokenizer, for example from create_config.py --preset roberta-tiny and
train_tokenizer.py --model_type roberta) or continues from a Hugging Face RoBERTa checkpoint, on text from
local files (txt, json/jsonl, csv, parquet; globs allowed), a local dataset directory or a `datasets` hub name.

Two ways to make examples:
- grouped (the default): texts are tokenized, joined with the separator </s> and cut into blocks, each
  framed as `<s> ... </s>`, of exactly --max_seq_length tokens;
- --line_by_line: every non-empty line (or text) is one example, framed the same way and truncated to
  --max_seq_length; batches are padded and carry an attention mask.

Every batch is masked on the host with numpy, reproducibly from --seed: each token that is not a special
token or padding is chosen with probability --mlm_probability; of the chosen, 80% become <mask>, 10% a random
token and 10% stay as they are. The loss and the accuracy count the chosen tokens only. Each global batch is
split over every device of every process with `jax.jit` over a device mesh. Training checkpoints in
OUTPUT_DIR/checkpoints let an interrupted run continue exactly with --resume_from_checkpoint.

The model is a Flax RoBERTa whose parameters map one-to-one onto the PyTorch `RobertaForMaskedLM` of
`transformers`: the output directory is an ordinary Hugging Face model directory (config.json,
model.safetensors, tokenizer files) that `AutoModelForMaskedLM` and `pipeline("fill-mask")` load in PyTorch.

    ./run_mlm_flax.py --output_dir roberta-run --config_name my-model --tokenizer_name my-model \
        --train_file "data/*.txt" --do_train --do_eval --max_seq_length 128

A single .json file holding the arguments works too: `./run_mlm_flax.py args.json`.
"""

import glob
import hashlib
import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Iterator, Optional, Union

import datasets
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import transformers
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

logger = logging.getLogger(__name__)


# Copied from run_clm_flax.UsageError
class UsageError(Exception):
    """A problem the user must fix (an argument, a file, a diverged run): reported as one line, no traceback."""


# ----------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "A RoBERTa masked-LM checkpoint to continue training from: a local directory holding config.json "
            "and model.safetensors, or a hub name. Leave unset to train from scratch."
        },
    )
    model_type: str = field(
        default="roberta",
        metadata={"help": "Model type when training from scratch without --config_name. Only roberta is supported."},
    )
    config_name: Optional[str] = field(
        default=None,
        metadata={"help": "Config directory or hub name, if not the same as --model_name_or_path."},
    )
    tokenizer_name: Optional[str] = field(
        default=None,
        metadata={"help": "Tokenizer directory or hub name, if not the same as --model_name_or_path."},
    )
    cache_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Where downloaded models and datasets, and the tokenized data, are cached."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Computation dtype: float32, bfloat16 or float16. Logits and the loss are always computed in "
            "float32.",
            "choices": ["float32", "bfloat16", "float16"],
        },
    )
    param_dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the parameters and the optimizer state. float32 (the default) keeps small updates "
            "from being rounded away; bfloat16 halves their memory.",
            "choices": ["float32", "bfloat16"],
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer's activations in the backward pass instead of storing them."},
    )
    remat_policy: str = field(
        default="nothing_saveable",
        metadata={
            "help": "What --gradient_checkpointing keeps: nothing_saveable (least memory), dots_saveable (matmul "
            "outputs: less recomputation), dots_with_no_batch_dims_saveable (in between).",
            "choices": ["nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"],
        },
    )
    token: Optional[str] = field(
        default=None,
        metadata={"help": "Hugging Face hub token for private models or datasets. Never logged or saved."},
    )
    allow_pickle_weights: bool = field(
        default=False,
        metadata={
            "help": "Also load --model_name_or_path from a pytorch_model.bin (a pickle; needs PyTorch). Only for "
            "files you trust; safetensors needs no such opt-in."
        },
    )


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(
        default=None,
        metadata={
            "help": "A `datasets` hub name, or a local directory: one written by Dataset.save_to_disk, or one "
            "holding data files."
        },
    )
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "The configuration of the dataset given by --dataset_name."}
    )
    train_file: Optional[str] = field(
        default=None,
        metadata={"help": "Training text: a .txt, .json/.jsonl, .csv or .parquet file, or a glob such as 'data/*.txt'."},
    )
    validation_file: Optional[str] = field(
        default=None,
        metadata={"help": "Evaluation text, in the same formats as --train_file."},
    )
    text_column_name: str = field(
        default="text", metadata={"help": "The column holding the text (txt files always give 'text')."}
    )
    max_train_samples: Optional[int] = field(
        default=None,
        metadata={"help": "Keep only this many training examples (blocks, or lines with --line_by_line)."},
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only this many evaluation examples."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Tokenize again even if a cached result exists."}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={"help": "Percentage of the training texts held out for evaluation when there is no validation split."},
    )
    max_seq_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "Tokens per example, <s> and </s> included. Defaults to the smaller of the tokenizer's "
            "model_max_length and the positions the model has (max_position_embeddings - pad_token_id - 1)."
        },
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Fraction of the tokens chosen for the model to predict."}
    )
    line_by_line: bool = field(
        default=False,
        metadata={
            "help": "Make every non-empty line (or text) one example, truncated to --max_seq_length, instead of "
            "joining the texts and cutting them into full blocks."
        },
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "With --line_by_line, pad every batch to --max_seq_length. Otherwise a batch is padded to the "
            "next power of two (at least 16) above its longest example, so jit compiles only a few shapes."
        },
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes used to tokenize the texts."}
    )
    keep_linebreaks: bool = field(
        default=True,
        metadata={
            "help": "Keep the line breaks at the end of each line of .txt files (with --line_by_line they are "
            "always removed, since every line is an example of its own)."
        },
    )


@dataclass
class TrainingArguments:
    output_dir: str = field(
        metadata={"help": "Where the model, its tokenizer, the results and the TensorBoard logs are written."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow training into an output directory that already holds files."}
    )
    do_train: bool = field(
        default=False,
        metadata={"help": "Train the model. With neither --do_train nor --do_eval, the script does both."},
    )
    do_eval: bool = field(default=False, metadata={"help": "Evaluate on the validation set."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Sequences per device per step; the global batch is this times the device count."}
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Sequences per device per evaluation step."})
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={
            "help": "Micro-batches whose gradients are summed into one update: the global batch becomes "
            "per_device_train_batch_size x devices x this, in the memory of one micro-batch."
        },
    )
    mesh_shape: Optional[str] = field(
        default=None,
        metadata={
            "help": "How the devices are arranged, e.g. data=2,fsdp=4: the batch is split over all devices, and "
            "parameters, gradients and optimizer state over the fsdp axis (like ZeRO-3). Default: data=all devices."
        },
    )
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW weight decay; biases and LayerNorm parameters are never decayed."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    adafactor: bool = field(default=False, metadata={"help": "Use Adafactor instead of AdamW."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Passes over the training data."})
    max_steps: int = field(
        default=-1, metadata={"help": "Number of optimizer steps; when positive it overrides --num_train_epochs."}
    )
    warmup_steps: int = field(default=0, metadata={"help": "Steps of linear warm-up from 0 to the learning rate."})
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warm-up as a fraction of all steps; used when --warmup_steps is 0."}
    )
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": "Decay after warm-up: linear or cosine (both to 0), or constant.",
                  "choices": ["linear", "cosine", "constant"]},
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip gradients to this global norm; 0 turns clipping off."}
    )
    logging_steps: int = field(default=500, metadata={"help": "Log the training loss every this many steps."})
    save_steps: int = field(
        default=500,
        metadata={"help": "Save a training checkpoint and the model every this many steps."},
    )
    save_total_limit: int = field(
        default=3, metadata={"help": "Keep this many newest training checkpoints in OUTPUT_DIR/checkpoints."}
    )
    resume_from_checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "help": "Continue an interrupted run from a training checkpoint: a directory OUTPUT_DIR/checkpoints/STEP, "
            "or no value for the newest checkpoint in --output_dir.",
            "nargs": "?",
            "const": "newest",
        },
    )
    skip_nonfinite_steps: bool = field(
        default=False,
        metadata={
            "help": "When the loss or gradient norm is not finite, skip that update and go on, instead of stopping."
        },
    )
    eval_steps: Optional[int] = field(
        default=None, metadata={"help": "Evaluate every this many steps; defaults to --logging_steps."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for initialisation, data order, masking and dropout."})
    fill_mask_text: str = field(
        default="",
        metadata={
            "help": "Text with one <mask> (the tokenizer's mask token) for the fill-mask demo run on the saved model "
            "at the end of training. Default: the start of the first validation text, its middle word masked."
        },
    )
    fill_mask_top_k: int = field(
        default=5, metadata={"help": "Predictions shown by the fill-mask demo; 0 for no demo."}
    )


# Copied from run_clm_flax.parse_arguments
def parse_arguments() -> tuple[ModelArguments, DataTrainingArguments, TrainingArguments]:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        json_path = os.path.abspath(sys.argv[1])
        if not os.path.isfile(json_path):
            raise UsageError(f"arguments file {sys.argv[1]} does not exist")
        try:
            return parser.parse_json_file(json_file=json_path)
        except (ValueError, json.JSONDecodeError) as error:
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    *arguments, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        if any(argument.split("=")[0] in ("--push_to_hub", "--push-to-hub") for argument in unknown):
            raise UsageError("--push_to_hub is not supported: upload --output_dir after training, e.g. with `hf upload`")
        raise UsageError(f"unknown argument {unknown[0]}; see --help for the arguments this script takes")
    return tuple(arguments)


def check_arguments(model_args, data_args, training_args):
    if model_args.model_type != "roberta":
        raise UsageError(
            f"--model_type {model_args.model_type} is not supported; this script trains roberta "
            "(run_clm_flax.py trains gpt2)"
        )
    if training_args.per_device_train_batch_size < 1 or training_args.per_device_eval_batch_size < 1:
        raise UsageError("--per_device_train_batch_size and --per_device_eval_batch_size must be at least 1")
    if training_args.gradient_accumulation_steps < 1:
        raise UsageError("--gradient_accumulation_steps must be at least 1")
    if training_args.do_train and training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise UsageError("no training steps: set --num_train_epochs or --max_steps to a positive number")
    for name in ("logging_steps", "save_steps", "save_total_limit"):
        if getattr(training_args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    if training_args.eval_steps is not None and training_args.eval_steps < 1:
        raise UsageError("--eval_steps must be at least 1")
    if not 0 <= training_args.warmup_ratio < 1:
        raise UsageError("--warmup_ratio must be in [0, 1)")
    if training_args.fill_mask_top_k < 0:
        raise UsageError("--fill_mask_top_k must be 0 (no demo) or more")
    if data_args.dataset_name is None and data_args.train_file is None and data_args.validation_file is None:
        raise UsageError("no data: pass --train_file (and optionally --validation_file) or --dataset_name")
    if training_args.do_train and data_args.dataset_name is None and data_args.train_file is None:
        raise UsageError("--do_train needs --train_file or --dataset_name")
    if not 0 < data_args.validation_split_percentage < 100:
        raise UsageError("--validation_split_percentage must be between 1 and 99")
    if data_args.max_seq_length is not None and data_args.max_seq_length < 3:
        raise UsageError("--max_seq_length must be at least 3: <s>, one token and </s>")
    if not 0 < data_args.mlm_probability < 1:
        raise UsageError(f"--mlm_probability {data_args.mlm_probability} must be between 0 and 1, such as 0.15")
    output_dir = training_args.output_dir
    if os.path.isfile(output_dir):
        raise UsageError(f"--output_dir {output_dir} is a file; pass a directory")
    if training_args.resume_from_checkpoint and not training_args.do_train:
        raise UsageError("--resume_from_checkpoint continues training; add --do_train")
    if (
        training_args.do_train
        and os.path.isdir(output_dir)
        and os.listdir(output_dir)
        and not training_args.overwrite_output_dir
        and not training_args.resume_from_checkpoint
    ):
        raise UsageError(
            f"--output_dir {output_dir} already holds files; pass --resume_from_checkpoint to continue its run, "
            "or --overwrite_output_dir to train into it anyway"
        )


# ----------------------------------------------------------------------------------------------------
# Data: load texts, tokenize into blocks or lines, batch and mask
# ----------------------------------------------------------------------------------------------------

# Copied from run_clm_flax.DATA_FILE_BUILDERS
DATA_FILE_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


# Copied from run_clm_flax.resolve_data_files
def resolve_data_files(pattern: str, flag: str) -> tuple[str, list[str]]:
    """The `datasets` builder and the sorted file list for a file path or glob given to --`flag`."""
    files = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not files:
        raise UsageError(f"--{flag} {pattern} matches no file")
    builders = set()
    for path in files:
        if not os.path.isfile(path):
            raise UsageError(f"--{flag}: {path} does not exist or is not a file")
        if not os.access(path, os.R_OK):
            raise UsageError(f"--{flag}: {path} is not readable")
        if os.path.getsize(path) == 0:
            raise UsageError(f"--{flag}: {path} is empty")
        extension = os.path.splitext(path)[1].lower()
        if extension not in DATA_FILE_BUILDERS:
            supported = ", ".join(DATA_FILE_BUILDERS)
            raise UsageError(f"--{flag}: {path} has an unsupported extension; use one of {supported}")
        builders.add(DATA_FILE_BUILDERS[extension])
    if len(builders) > 1:
        raise UsageError(f"--{flag} {pattern} mixes file formats; give files of one format")
    return builders.pop(), files


# Copied from run_clm_flax.load_raw_datasets
def load_raw_datasets(model_args, data_args) -> datasets.DatasetDict:
    """Train and validation texts; a validation split is carved from the start of train when none exists."""
    try:
        if data_args.dataset_name is not None:
            name = data_args.dataset_name
            if os.path.isdir(name) and any(
                os.path.exists(os.path.join(name, marker)) for marker in ("dataset_dict.json", "state.json")
            ):
                raw = datasets.load_from_disk(name)
            else:
                raw = datasets.load_dataset(
                    name, data_args.dataset_config_name, cache_dir=model_args.cache_dir, token=model_args.token
                )
            if isinstance(raw, datasets.Dataset):
                raw = datasets.DatasetDict({"train": raw})
        else:
            data_files, builder = {}, None
            for split, flag in (("train", "train_file"), ("validation", "validation_file")):
                pattern = getattr(data_args, flag)
                if pattern is not None:
                    builder, data_files[split] = resolve_data_files(pattern, flag)
            options = {"keep_linebreaks": data_args.keep_linebreaks} if builder == "text" else {}
            raw = datasets.load_dataset(builder, data_files=data_files, cache_dir=model_args.cache_dir, **options)
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise UsageError(f"cannot load the dataset: {error}") from None
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, ValueError) as error:
        cause = error.__cause__ or error
        raise UsageError(f"cannot read the data files ({type(cause).__name__}: {cause}); check their format and encoding") from None

    if "train" in raw and "validation" not in raw:
        train = raw["train"]
        validation_size = max(1, len(train) * data_args.validation_split_percentage // 100)
        if len(train) < 2:
            raise UsageError("the training data holds fewer than 2 texts; there is nothing to hold out for evaluation")
        raw = datasets.DatasetDict(
            {"validation": train.select(range(validation_size)), "train": train.select(range(validation_size, len(train)))}
        )
    for split, dataset in raw.items():
        if len(dataset) == 0:
            raise UsageError(f"the {split} data is empty")
        if data_args.text_column_name not in dataset.column_names:
            columns = ", ".join(dataset.column_names)
            raise UsageError(
                f"the {split} data has no column '{data_args.text_column_name}' (it has: {columns}); "
                "pass --text_column_name"
            )
    return raw


# Copied from run_clm_flax.tokenized_fingerprint
def tokenized_fingerprint(dataset: datasets.Dataset, tokenizer, *settings) -> str:
    """A cache key that changes with the texts, the tokenizer and any setting that changes the tokens."""
    digest = hashlib.sha256()
    for part in (dataset._fingerprint, tokenizer.backend_tokenizer.to_str(), *map(repr, settings)):
        digest.update(part.encode())
    return digest.hexdigest()[:24]


# Grouped mode: the texts, each followed by </s>, joined and cut into blocks of max_seq_length - 2 tokens;
# BatchMaker frames every block as <s> block </s>. RoBERTa's pretraining data is made the same way: full
# sentences across document boundaries, with a separator between documents.
# Copied from run_clm_flax.tokenize_and_pack
def tokenize_and_pack(dataset, tokenizer, text_column, block_size, num_workers, overwrite_cache, split) -> np.ndarray:
    """Token blocks of shape (num_blocks, block_size): every text followed by EOS, all joined, then cut.

    The result is cached beside the dataset's own cache files and memory-mapped on later runs. The
    tail that does not fill a whole block is dropped (at most block_size - 1 tokens).
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UsageError("the tokenizer has no end-of-text token; set eos_token in its tokenizer_config.json")
    fingerprint = tokenized_fingerprint(dataset, tokenizer, text_column, eos_id)
    cache_path = None
    if dataset.cache_files:
        cache_dir = os.path.dirname(dataset.cache_files[0]["filename"])
        cache_path = os.path.join(cache_dir, f"packed-{fingerprint}-block{block_size}.npy")
        if os.path.exists(cache_path) and not overwrite_cache:
            logger.info("Loading packed %s blocks from cache %s", split, cache_path)
            return np.load(cache_path, mmap_mode="r")

    # The Rust tokenizer directly: the transformers wrapper would also build attention masks and warn
    # about texts longer than model_max_length, which is expected here since texts get packed.
    backend = tokenizer.backend_tokenizer

    def tokenize(batch):
        encodings = backend.encode_batch(batch[text_column], add_special_tokens=False)
        return {"input_ids": [encoding.ids + [eos_id] for encoding in encodings]}

    tokenized = dataset.map(
        tokenize,
        batched=True,
        num_proc=num_workers,
        remove_columns=dataset.column_names,
        new_fingerprint=fingerprint,
        load_from_cache_file=not overwrite_cache,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        desc=f"Tokenizing {split} texts",
    )
    # Arrow stores the token lists of each chunk as one flat buffer: flattening is a copy, not a Python
    # loop. Chunk by chunk, because one list array cannot hold more than 2**31 tokens.
    tokens = np.concatenate([chunk.flatten().to_numpy() for chunk in tokenized.data.column("input_ids").chunks])
    num_blocks = len(tokens) // block_size
    blocks = np.ascontiguousarray(tokens[: num_blocks * block_size].reshape(num_blocks, block_size))
    logger.info("%s: %d tokens packed into %d blocks of %d", split, len(tokens), num_blocks, block_size)
    if cache_path is not None:
        temporary_path = f"{cache_path}.{os.getpid()}.tmp.npy"
        np.save(temporary_path, blocks, allow_pickle=False)
        os.replace(temporary_path, cache_path)
    return blocks


@dataclass(frozen=True)
class LineExamples:
    """One example per line (or text) in line-by-line mode, stored flat rather than as Python lists:
    example i is tokens[offsets[i] : offsets[i + 1]], without special tokens and not yet truncated."""

    tokens: np.ndarray  # int32, every example end to end
    offsets: np.ndarray  # int64, len(self) + 1 entries

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def head(self, count: int) -> "LineExamples":
        return LineExamples(self.tokens, self.offsets[: count + 1])


def tokenize_lines(dataset, tokenizer, text_column, num_workers, overwrite_cache, split) -> LineExamples:
    """The token ids of every non-empty text (every line of a .txt file), for --line_by_line.

    Line breaks at the end are removed and texts of only whitespace skipped. Like the packed blocks of
    tokenize_and_pack, the result is cached beside the dataset's own cache files and memory-mapped on
    later runs; it does not depend on --max_seq_length, since examples are truncated when batched.
    """
    fingerprint = tokenized_fingerprint(dataset, tokenizer, text_column, "line_by_line")
    cache_paths = None
    if dataset.cache_files:
        cache_dir = os.path.dirname(dataset.cache_files[0]["filename"])
        cache_paths = {part: os.path.join(cache_dir, f"lines-{fingerprint}-{part}.npy") for part in ("tokens", "offsets")}
        if all(os.path.exists(path) for path in cache_paths.values()) and not overwrite_cache:
            logger.info("Loading tokenized %s lines from cache %s", split, cache_paths["tokens"])
            return LineExamples(**{part: np.load(path, mmap_mode="r") for part, path in cache_paths.items()})

    backend = tokenizer.backend_tokenizer

    def tokenize(batch):
        texts = [text.rstrip("\r\n") for text in batch[text_column] if text and not text.isspace()]
        return {"input_ids": [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]}

    tokenized = dataset.map(
        tokenize,
        batched=True,
        num_proc=num_workers,
        remove_columns=dataset.column_names,
        new_fingerprint=fingerprint,
        load_from_cache_file=not overwrite_cache,
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        desc=f"Tokenizing {split} lines",
    )
    # Chunk by chunk, so that the 32-bit offsets of one Arrow list array never have to cover every token.
    chunks = tokenized.data.column("input_ids").chunks
    lengths = np.concatenate([np.zeros(0, np.int64)] + [chunk.value_lengths().to_numpy() for chunk in chunks])
    tokens = np.concatenate([np.zeros(0, np.int32)] + [chunk.flatten().to_numpy() for chunk in chunks])
    examples = LineExamples(tokens.astype(np.int32), np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    logger.info("%s: %d lines of %d tokens in all", split, len(examples), len(tokens))
    if cache_paths is not None:
        for part, path in cache_paths.items():  # offsets last: their presence marks a complete cache
            temporary_path = f"{path}.{os.getpid()}.tmp.npy"
            np.save(temporary_path, getattr(examples, part), allow_pickle=False)
            os.replace(temporary_path, path)
    return examples


def first_examples(examples: Union[np.ndarray, LineExamples], count: int):
    """The first `count` examples, as blocks or as lines (for --max_train_samples, --max_eval_samples)."""
    return examples.head(count) if isinstance(examples, LineExamples) else examples[:count]


# Copied from run_clm_flax.prefetch
def prefetch(iterator: Iterator, size: int = 2) -> Iterator:
    """Run `iterator` in a background thread, `size` items ahead, so the host prepares the next batches
    while the devices compute."""
    items = queue.Queue(maxsize=size)
    end = object()

    def produce():
        try:
            for item in iterator:
                items.put(item)
        except BaseException as error:  # handed to the consumer, which re-raises it
            items.put(error)
        items.put(end)

    threading.Thread(target=produce, daemon=True).start()
    while (item := items.get()) is not end:
        if isinstance(item, BaseException):
            raise item
        yield item


# Copied from run_clm_flax.process_slice
def process_slice(global_batch_size: int) -> slice:
    """The rows of each global batch that this process loads; jax assembles them into one global array."""
    local_size = global_batch_size // jax.process_count()
    return slice(jax.process_index() * local_size, (jax.process_index() + 1) * local_size)


# Masking and batches, on the host: numpy, per batch, reproducible from the seed.


def mask_tokens(input_ids, special_tokens_mask, mask_token_id, vocab_size, mlm_probability, rng):
    """Choose positions to predict and corrupt them the BERT way.

    input_ids: (batch, seq) int; special_tokens_mask: (batch, seq) bool, True for special tokens and
    padding, which are never chosen; rng: np.random.Generator, so a seed reproduces the batch.
    Each other position is chosen with probability mlm_probability; of the chosen, 80% become
    mask_token_id, 10% a random id in [0, vocab_size) and 10% stay as they are (so the model cannot
    learn that only masked positions matter).
    Returns (masked input_ids, labels = the original ids, label_weights: float32, 1.0 where chosen).
    """
    shape = input_ids.shape
    chosen = (rng.random(shape) < mlm_probability) & ~special_tokens_mask
    action = rng.random(shape)  # below 0.8: mask, 0.8 to 0.9: random token, above 0.9: keep
    random_ids = rng.integers(0, vocab_size, shape, dtype=input_ids.dtype)
    masked = np.where(chosen & (action < 0.8), mask_token_id, input_ids)
    masked = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, masked).astype(input_ids.dtype)
    return masked, input_ids.copy(), chosen.astype(np.float32)


@dataclass(frozen=True)
class BatchMaker:
    """Turns examples into masked model inputs: every example framed as <s> tokens </s>, padded, masked.

    Examples are blocks (a 2-D array of max_seq_length - 2 tokens per row, grouped mode) or LineExamples.
    Padding takes the place after </s>; the attention mask is 1 for tokens and 0 for padding.
    """

    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    mask_token_id: int
    special_token_ids: tuple  # never chosen for prediction
    random_token_count: int  # random replacements are drawn from the ids [0, random_token_count)
    mlm_probability: float
    max_seq_length: int
    pad_to_max_length: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer, max_seq_length: int, mlm_probability: float, pad_to_max_length: bool):
        return cls(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.mask_token_id,
            special_token_ids=tuple(sorted(set(tokenizer.all_special_ids))), random_token_count=len(tokenizer),
            mlm_probability=mlm_probability, max_seq_length=max_seq_length, pad_to_max_length=pad_to_max_length,
        )

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest row has `longest` tokens is padded to. jit compiles the step once
        per length, so padded batches take only a few: powers of two from 16, capped at max_seq_length."""
        if self.pad_to_max_length:
            return self.max_seq_length
        return min(self.max_seq_length, max(16, 1 << (longest - 1).bit_length()))

    def token_ids(self, examples, indices: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), int32 (num_rows, length), unmasked. Rows past len(indices) fill up a
        partial batch: empty examples (<s> </s>), which have nothing to predict."""
        if isinstance(examples, LineExamples):
            starts = examples.offsets[indices]
            lengths = np.minimum(examples.offsets[indices + 1] - starts, self.max_seq_length - 2)
        else:
            lengths = np.full(len(indices), examples.shape[1])
        row_lengths = np.zeros(num_rows, np.int64)  # tokens between <s> and </s>
        row_lengths[: len(indices)] = lengths
        length = self.padded_length(int(row_lengths.max()) + 2)

        input_ids = np.full((num_rows, length), self.pad_token_id, np.int32)
        input_ids[:, 0] = self.bos_token_id
        if isinstance(examples, LineExamples):
            for row, (start, size) in enumerate(zip(starts, lengths)):
                input_ids[row, 1 : size + 1] = examples.tokens[start : start + size]
        elif len(indices):
            input_ids[: len(indices), 1:-1] = examples[indices]
        input_ids[np.arange(num_rows), row_lengths + 1] = self.eos_token_id
        attention_mask = (np.arange(length)[None, :] < row_lengths[:, None] + 2).astype(np.int32)
        return input_ids, attention_mask

    def predictions_per_row(self, length: int) -> int:
        """Room for the positions to predict in a row of `length` tokens: the mean number chosen plus five
        standard deviations, rounded up to a multiple of 8. About one row in a million needs more; its batch
        then gets room for every position (and the step one more compilation)."""
        mean = length * self.mlm_probability
        bound = mean + 5 * math.sqrt(mean * (1 - self.mlm_probability))
        return min(length, 8 * math.ceil(bound / 8))

    def __call__(self, examples, indices: np.ndarray, num_rows: int, rng: np.random.Generator) -> dict:
        """The masked batch: input_ids (masked) and attention_mask, (rows, length); and for the positions
        to predict, masked_positions, masked_labels (the original ids) and masked_weights (1.0, or 0.0 for
        the unused room), (rows, predictions)."""
        input_ids, attention_mask = self.token_ids(examples, indices, num_rows)
        special_tokens_mask = np.isin(input_ids, self.special_token_ids) | (attention_mask == 0)
        masked_ids, labels, label_weights = mask_tokens(
            input_ids, special_tokens_mask, self.mask_token_id, self.random_token_count, self.mlm_probability, rng
        )
        chosen = label_weights > 0
        predictions = self.predictions_per_row(input_ids.shape[1])
        if chosen.sum(axis=1).max() > predictions:
            predictions = input_ids.shape[1]
        # The chosen positions of each row first, in order; then unchosen ones, with weight 0, as filler.
        positions = np.argsort(~chosen, axis=1, kind="stable")[:, :predictions]
        return {
            "input_ids": masked_ids,
            "attention_mask": attention_mask,
            "masked_positions": positions.astype(np.int32),
            "masked_labels": np.take_along_axis(labels, positions, axis=1),
            "masked_weights": np.take_along_axis(label_weights, positions, axis=1),
        }


# Separate random streams for the masks of training and of evaluation batches.
TRAIN_MASKING, EVAL_MASKING = 0, 1


def train_batches(
    examples, make_batch: BatchMaker, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[tuple[dict, int]]:
    """This process's rows of each masked global batch of one epoch, from batch `first_batch` on, with the
    batch's number of tokens (padding left out).

    The order and the masks are fixed by seed, epoch and batch, so a resumed run continues with the very
    batches, masked the very same way, that the interrupted run would have seen. Every
    process makes the whole global batch (a few megabytes) and keeps its own rows, so the masks do not
    depend on the number of processes. The examples left over after the last full batch differ from epoch to
    epoch, so all data is seen.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    rows = process_slice(global_batch_size)
    for step in range(first_batch, len(examples) // global_batch_size):
        indices = np.sort(order[step * global_batch_size : (step + 1) * global_batch_size])
        batch = make_batch(examples, indices, global_batch_size, np.random.default_rng([seed, TRAIN_MASKING, epoch, step]))
        yield {name: values[rows] for name, values in batch.items()}, int(batch["attention_mask"].sum())


def eval_batches(examples, make_batch: BatchMaker, global_batch_size: int, seed: int) -> Iterator[dict]:
    """Every example once, in order, masked the same way at every evaluation (the masks are seeded by the
    batch's index), so evaluations are comparable. The last batch is filled up with empty rows, none dropped."""
    rows = process_slice(global_batch_size)
    for batch_index, start in enumerate(range(0, len(examples), global_batch_size)):
        indices = np.arange(start, min(start + global_batch_size, len(examples)))
        batch = make_batch(examples, indices, global_batch_size, np.random.default_rng([seed, EVAL_MASKING, batch_index]))
        yield {name: values[rows] for name, values in batch.items()}


# ----------------------------------------------------------------------------------------------------
# Model: RoBERTa in Flax, parameter names one-to-one with the Hugging Face checkpoint
# ----------------------------------------------------------------------------------------------------

# Copied from run_clm_flax.ACTIVATIONS
ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def check_model_config(config):
    """Raise UsageError if `config` asks for a RoBERTa variant this model does not implement."""
    if config.model_type != "roberta":
        raise UsageError(
            f"this script trains RoBERTa but the config is of model type '{config.model_type}'; "
            "use a roberta config (create_config.py --preset roberta-tiny) or run_clm_flax.py for gpt2"
        )
    if config.is_decoder or config.add_cross_attention:
        raise UsageError("the config makes RoBERTa a decoder (is_decoder or add_cross_attention); "
                         "masked language modelling needs an encoder, so set both to false")
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise UsageError(f"position_embedding_type {position_embedding_type!r} in the config is not supported; "
                         "only 'absolute' is")
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATIONS:
        raise UsageError(f"hidden_act {config.hidden_act!r} in the config is not supported; "
                         f"use one of {', '.join(ACTIVATIONS)}")
    if config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(f"hidden_size {config.hidden_size} in the config is not a multiple of "
                         f"num_attention_heads {config.num_attention_heads}")
    if config.pad_token_id is None:
        raise UsageError("the config has no pad_token_id; RoBERTa needs one to number the positions")
    if not config.tie_word_embeddings:
        raise UsageError("tie_word_embeddings is false in the config; this model always shares the "
                         "output projection with the word embeddings")


def embedding_init(stddev, padding_idx):
    """Normal initializer that leaves the padding row at zero, as PyTorch's nn.Embedding(padding_idx=...) does."""
    def init(key, shape, dtype=jnp.float32):
        table = jax.random.normal(key, shape, dtype) * stddev
        return table.at[padding_idx].set(0)
    return init


class RobertaModule(nn.Module):
    """Base of every part of the model: the config, the two dtypes and factories for its layers.

    `dtype` is the dtype of the computation (e.g. bfloat16), `param_dtype` the dtype the parameters are
    stored in. Every parameter gets logical axis names so that a mesh can shard it. `remat_policy`, a
    jax.checkpoint_policies name, makes the encoder recompute each layer in the backward pass.
    """
    config: transformers.RobertaConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat_policy: Optional[str] = None

    def dense(self, features, kernel_axes, bias_axes, name):
        kernel_init = nn.initializers.normal(self.config.initializer_range)
        return nn.Dense(
            features, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            kernel_init=nn.with_logical_partitioning(kernel_init, kernel_axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes),
        )

    def layer_norm(self, name):
        return nn.LayerNorm(
            epsilon=self.config.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        )

    def embed(self, num_embeddings, axes, padding_idx=None, name=None):
        stddev = self.config.initializer_range
        init = nn.initializers.normal(stddev) if padding_idx is None else embedding_init(stddev, padding_idx)
        return nn.Embed(num_embeddings, self.config.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                        embedding_init=nn.with_logical_partitioning(init, axes), name=name)

    def child(self, module_class, name):
        """A submodule that shares this module's config, dtypes and remat policy."""
        return module_class(self.config, self.dtype, self.param_dtype, self.remat_policy, name=name)


class RobertaEmbeddings(RobertaModule):
    """Word + position + token type embeddings, then LayerNorm and dropout."""

    def setup(self):
        config = self.config
        self.word_embeddings = self.embed(config.vocab_size, ("vocab", "embed"), config.pad_token_id)
        self.position_embeddings = self.embed(config.max_position_embeddings, ("positions", "embed"),
                                              config.pad_token_id)
        self.token_type_embeddings = self.embed(config.type_vocab_size, (None, "embed"))
        self.LayerNorm = self.layer_norm("LayerNorm")
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def __call__(self, input_ids, token_type_ids, deterministic):
        # RoBERTa (after fairseq) numbers real tokens pad+1, pad+2, ... and gives padding the position
        # pad itself, so a sequence of length L needs max_position_embeddings >= L + pad + 1.
        pad = self.config.pad_token_id
        is_token = (input_ids != pad).astype(jnp.int32)
        position_ids = jnp.cumsum(is_token, axis=1) * is_token + pad
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))  # (batch, seq, hidden)
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)


# Copied from run_clm_flax.attention_implementation
def attention_implementation(dtype) -> Optional[str]:
    """cuDNN's fused (flash) attention on NVIDIA GPUs in half precision, XLA's attention elsewhere.

    jax.nn.dot_product_attention does not choose cuDNN by itself, and cuDNN has no float32 kernel.
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


def attention_with_dropout(query, key, value, mask, dropout):
    """Softmax attention with dropout on the attention probabilities, written out step by step.

    query, key, value: (batch, seq, heads, head_dim); mask: (batch, 1, 1, seq) bool or None;
    dropout: a callable applied to the (batch, heads, seq, seq) probabilities.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(query.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1)).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


class RobertaSelfAttention(RobertaModule):
    """Multi-head self-attention: the query, key and value projections and the attention itself."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        config = self.config
        num_heads = config.num_attention_heads
        head_dim = config.hidden_size // num_heads
        batch, seq, _ = hidden_states.shape

        def project(name):
            x = self.dense(config.hidden_size, ("embed", "heads"), ("heads",), name)(hidden_states)
            return x.reshape(batch, seq, num_heads, head_dim)

        query, key, value = project("query"), project("key"), project("value")
        if not deterministic and config.attention_probs_dropout_prob > 0:
            # jax.nn.dot_product_attention cannot drop attention probabilities, so training with
            # attention dropout takes the explicit path; evaluation and dropout-free training use the
            # library function, the place where JAX plugs in fused attention kernels.
            dropout = partial(nn.Dropout(config.attention_probs_dropout_prob), deterministic=False)
            out = attention_with_dropout(query, key, value, mask, dropout)
        else:
            # Softmax runs in float32 inside, whatever the dtype of query and key. With cuDNN the padding
            # mask becomes an additive bias of the fused kernel.
            out = jax.nn.dot_product_attention(
                query, key, value, mask=mask, implementation=attention_implementation(query.dtype)
            )
        return out.reshape(batch, seq, config.hidden_size)


class RobertaResidualOutput(RobertaModule):
    """Dense, dropout, then LayerNorm of the residual sum; ends both the attention and the MLP."""

    @nn.compact
    def __call__(self, hidden_states, residual, deterministic, kernel_axes):
        x = self.dense(self.config.hidden_size, kernel_axes, ("embed",), "dense")(hidden_states)
        x = nn.Dropout(self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        return self.layer_norm("LayerNorm")(x + residual)


class RobertaAttention(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        attended = self.child(RobertaSelfAttention, "self")(hidden_states, mask, deterministic)
        return self.child(RobertaResidualOutput, "output")(attended, hidden_states, deterministic,
                                                           kernel_axes=("heads", "embed"))


class RobertaIntermediate(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states):
        x = self.dense(self.config.intermediate_size, ("embed", "mlp"), ("mlp",), "dense")(hidden_states)
        return ACTIVATIONS[self.config.hidden_act](x)  # (batch, seq, intermediate)


class RobertaLayer(RobertaModule):
    """One post-LayerNorm transformer block: attention, then the MLP, each followed by residual + LayerNorm."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        x = self.child(RobertaAttention, "attention")(hidden_states, mask, deterministic)
        h = self.child(RobertaIntermediate, "intermediate")(x)
        return self.child(RobertaResidualOutput, "output")(h, x, deterministic, kernel_axes=("mlp", "embed"))


class RobertaEncoder(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        layer = RobertaLayer
        if self.remat_policy:
            # Argument 3 (deterministic) is a Python bool that selects code, not an array.
            layer = nn.remat(RobertaLayer, policy=getattr(jax.checkpoint_policies, self.remat_policy), static_argnums=(3,))
        for i in range(self.config.num_hidden_layers):
            hidden_states = self.child(layer, f"layer_{i}")(hidden_states, mask, deterministic)
        return hidden_states


class RobertaModel(RobertaModule):
    """Embeddings and encoder, without a head: returns hidden states (batch, seq, hidden)."""

    def setup(self):
        self.embeddings = self.child(RobertaEmbeddings, "embeddings")
        self.encoder = self.child(RobertaEncoder, "encoder")

    def __call__(self, input_ids, attention_mask, token_type_ids, deterministic):
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].astype(bool)  # (batch, 1, 1, seq): True = may attend
        x = self.embeddings(input_ids, token_type_ids, deterministic)
        return self.encoder(x, mask, deterministic)


class RobertaLMHead(RobertaModule):
    """Dense + GELU + LayerNorm, then scores against the (shared) word embeddings plus a bias."""

    @nn.compact
    def __call__(self, hidden_states, word_embeddings):
        x = self.dense(self.config.hidden_size, ("embed", None), ("embed",), "dense")(hidden_states)
        x = self.layer_norm("layer_norm")(ACTIVATIONS["gelu"](x))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                          (self.config.vocab_size,), self.param_dtype)
        # Accumulate in float32 so that bfloat16 compute still gives float32 logits for the loss.
        logits = jnp.einsum("bsh,vh->bsv", x, word_embeddings.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return logits + bias.astype(jnp.float32)  # (batch, seq, vocab)


class FlaxRobertaForMaskedLM(RobertaModule):
    """RoBERTa encoder with its masked-language-modelling head; returns float32 logits (batch, seq, vocab),
    or (batch, predictions, vocab) at `masked_positions` only.

    The parameter tree mirrors the PyTorch names of `transformers.RobertaForMaskedLM`
    (see `hf_name`): e.g. params["roberta"]["encoder"]["layer_0"]["attention"]["self"]["query"]["kernel"]
    is `roberta.encoder.layer.0.attention.self.query.weight`, transposed.
    """

    def setup(self):
        check_model_config(self.config)
        self.roberta = self.child(RobertaModel, "roberta")
        self.lm_head = self.child(RobertaLMHead, "lm_head")

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, deterministic: bool = True,
                 masked_positions=None):
        hidden_states = self.roberta(input_ids, attention_mask, token_type_ids, deterministic)
        if masked_positions is not None:
            # masked_positions: (batch, predictions) int. Training predicts about 15% of the tokens, so running
            # the head (whose vocabulary projection is the largest matmul of a small model) only there saves
            # most of its work.
            rows = jnp.arange(hidden_states.shape[0])[:, None]
            hidden_states = hidden_states[rows, masked_positions]  # (batch, predictions, hidden)
        # The output projection is the word embedding table itself (tied weights, as in RoBERTa).
        word_embeddings = self.roberta.embeddings.word_embeddings.embedding  # (vocab, hidden)
        return self.lm_head(hidden_states, word_embeddings)


# ----------------------------------------------------------------------------------------------------
# Checkpoint conversion to and from the PyTorch layout of transformers
# ----------------------------------------------------------------------------------------------------

# Tensors a RobertaForMaskedLM checkpoint may hold that this model does not need: the decoder weight and
# bias are tied to the word embeddings and lm_head.bias (save_pretrained leaves them out), the pooler
# belongs to RobertaModel, and older checkpoints saved the constant position_ids/token_type_ids buffers.
IGNORED_HF_TENSORS = ("lm_head.decoder.weight", "lm_head.decoder.bias", "roberta.embeddings.position_ids",
                      "roberta.embeddings.token_type_ids")
IGNORED_HF_PREFIXES = ("roberta.pooler.",)


def hf_name(path):
    """PyTorch name of the Flax parameter at `path`, e.g. ("roberta", "encoder", "layer_0", ..., "kernel")."""
    *modules, leaf = path
    # "layer_3" is the Flax name of PyTorch's "layer.3"; "layer_norm" stays as it is.
    modules = [f"layer.{m[6:]}" if m.startswith("layer_") and m[6:].isdigit() else m for m in modules]
    leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(leaf, leaf)
    return ".".join([*modules, leaf])


def param_shapes(config):
    """{flax path: shape} of the model's parameters in creation order, computed without allocating them."""
    model = FlaxRobertaForMaskedLM(config)
    paths = []

    def init_flat():
        params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
        flat = traverse_util.flatten_dict(params)  # Partitioned boxes are leaves here
        # Recorded here because jax's tree functions (eval_shape, unbox) return dicts with sorted keys.
        paths.extend(flat)
        return [nn.meta.unbox(leaf) for leaf in flat.values()]

    return {path: tuple(leaf.shape) for path, leaf in zip(paths, jax.eval_shape(init_flat))}


def to_hf_state_dict(params, config):
    """Unboxed Flax params -> {PyTorch name: float32 numpy array} for RobertaForMaskedLM's model.safetensors.

    Dense kernels are (in, out) in Flax and (out, in) in PyTorch, so they are transposed. The tied
    lm_head.decoder tensors are left out, as save_pretrained does.
    """
    flat_params = traverse_util.flatten_dict(params)
    state_dict = {}
    for path, shape in param_shapes(config).items():
        array = np.asarray(flat_params[path], dtype=np.float32)
        if array.shape != shape:  # params are built from the config, so this is a bug, not a user's mistake
            raise ValueError(f"parameter {'/'.join(path)} has shape {array.shape}, the config needs {shape}")
        if path[-1] == "kernel":
            array = array.T
        state_dict[hf_name(path)] = np.ascontiguousarray(array)
    return state_dict


def from_hf_state_dict(state_dict, config):
    """{PyTorch name: array} of a RobertaForMaskedLM checkpoint -> unboxed Flax params (float32 numpy).

    Accepts checkpoints with or without the tied lm_head.decoder tensors and the pooler. Raises
    UsageError naming the first tensor that is missing, unexpected or of the wrong shape for `config`.
    """
    check_model_config(config)
    expected = param_shapes(config)
    flat_params = {}
    for path, shape in expected.items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"checkpoint has no tensor {name}; is it a RobertaForMaskedLM checkpoint?")
        array = np.asarray(state_dict[name], dtype=np.float32)
        is_kernel = path[-1] == "kernel"
        needed_shape = shape[::-1] if is_kernel else shape  # in the PyTorch layout
        if array.shape != needed_shape:
            raise UsageError(f"checkpoint tensor {name} has shape {array.shape} but the config needs "
                             f"{needed_shape}; pass the matching --config_name")
        if is_kernel:
            array = array.T
        flat_params[path] = np.ascontiguousarray(array)
    used_names = {hf_name(path) for path in expected}
    for name in state_dict:
        if name not in used_names and name not in IGNORED_HF_TENSORS and not name.startswith(IGNORED_HF_PREFIXES):
            raise UsageError(f"checkpoint tensor {name} is not part of RobertaForMaskedLM with this config; "
                             "pass the matching --config_name")
    return traverse_util.unflatten_dict(flat_params)


# Copied from run_clm_flax.read_safetensors_checkpoint
def read_safetensors_checkpoint(name_or_path: str, model_args) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors (or its shards) from a local directory or the hub."""
    index_name, single_name = "model.safetensors.index.json", "model.safetensors"
    if os.path.isdir(name_or_path):
        def fetch(filename):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
    else:
        import huggingface_hub

        def fetch(filename):
            try:
                return huggingface_hub.hf_hub_download(
                    name_or_path, filename, cache_dir=model_args.cache_dir, token=model_args.token
                )
            except huggingface_hub.errors.EntryNotFoundError:
                return None
            except (huggingface_hub.errors.HfHubHTTPError, OSError, ValueError) as error:
                raise UsageError(f"cannot download {filename} of {name_or_path}: {error}") from None

    if (index_path := fetch(index_name)) is not None:
        with open(index_path) as index_file:
            shard_names = sorted(set(json.load(index_file)["weight_map"].values()))
        state_dict = {}
        for shard_name in shard_names:
            state_dict.update(load_file(fetch(shard_name)))
        return state_dict
    if (path := fetch(single_name)) is not None:
        return load_file(path)
    if (pickle_path := fetch("pytorch_model.bin")) is None:
        raise UsageError(f"{name_or_path} has no model.safetensors")
    if not model_args.allow_pickle_weights:
        raise UsageError(
            f"{name_or_path} holds only pytorch_model.bin, a pickle that can run code when loaded; convert it to "
            "model.safetensors, or pass --allow_pickle_weights if you trust the file"
        )
    try:
        import torch
    except ImportError:
        raise UsageError("reading pytorch_model.bin needs PyTorch: pip install torch") from None
    # weights_only refuses anything in the pickle but tensors and plain containers.
    return {name: tensor.float().numpy() for name, tensor in torch.load(pickle_path, map_location="cpu", weights_only=True).items()}


# ----------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------


def masked_lm_loss_sums(logits, labels, label_weights):
    """Sum of cross-entropy, number of correct predictions and number of counted positions.

    logits: (batch, positions, vocab), at every position or only at those to predict; labels: (batch,
    positions) int; label_weights: (batch, positions), 1.0 where the position counts. Returns three float32
    scalars; summing them over batches and dividing once on the host gives exact averages whatever the
    number of masked positions per batch.
    """
    logits = logits.astype(jnp.float32)
    label_weights = label_weights.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # (batch, positions)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (loss * label_weights).sum(), (correct * label_weights).sum(), label_weights.sum()


# ----------------------------------------------------------------------------------------------------
# Training state, sharding, optimizer, steps
# ----------------------------------------------------------------------------------------------------

# Copied from run_clm_flax.MESH_AXES
MESH_AXES = ("data", "fsdp")
# Copied from run_clm_flax.BATCH_AXES
BATCH_AXES = ("data", "fsdp")
# Copied from run_clm_flax.LOGICAL_AXIS_RULES
LOGICAL_AXIS_RULES = (
    ("vocab", None),
    ("positions", None),
    ("embed", "fsdp"),
    ("heads", None),
    ("mlp", None),
)


# Copied from run_clm_flax.TrainState
class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


# Copied from run_clm_flax.learning_rate_schedule
def learning_rate_schedule(training_args, total_steps: int) -> optax.Schedule:
    warmup_steps = training_args.warmup_steps or math.ceil(training_args.warmup_ratio * total_steps)
    warmup_steps = min(warmup_steps, total_steps)
    peak = training_args.learning_rate
    decay_steps = max(total_steps - warmup_steps, 1)
    decay = {
        "linear": optax.linear_schedule(peak, 0.0, decay_steps),
        "cosine": optax.cosine_decay_schedule(peak, decay_steps),
        "constant": optax.constant_schedule(peak),
    }[training_args.lr_scheduler_type]
    warmup = optax.linear_schedule(0.0, peak, max(warmup_steps, 1))
    return optax.join_schedules([warmup, decay], [warmup_steps])


# Copied from run_clm_flax.decay_mask
def decay_mask(params):
    """True for the weights AdamW decays: matrices and embeddings, not biases or LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


# Copied from run_clm_flax.create_optimizer
def create_optimizer(training_args, schedule: optax.Schedule) -> optax.GradientTransformation:
    if training_args.adafactor:
        optimizer = optax.adafactor(learning_rate=schedule)
    else:
        optimizer = optax.adamw(
            learning_rate=schedule,
            b1=training_args.adam_beta1,
            b2=training_args.adam_beta2,
            eps=training_args.adam_epsilon,
            weight_decay=training_args.weight_decay,
            mask=decay_mask,
        )
    if training_args.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(training_args.max_grad_norm), optimizer)
    return optimizer


# Copied from run_clm_flax.create_mesh
def create_mesh(mesh_shape: Optional[str] = None) -> jax.sharding.Mesh:
    """All devices of all processes on the axes of MESH_AXES, sized by `mesh_shape` ("data=2,fsdp=4");
    by default all on "data"."""
    sizes = {"data": jax.device_count(), "fsdp": 1}
    if mesh_shape:
        try:
            given = {name.strip(): int(size) for name, size in (part.split("=") for part in mesh_shape.split(","))}
        except ValueError:
            raise UsageError(f"--mesh_shape {mesh_shape}: write it as data=N,fsdp=M") from None
        if not set(given) <= set(MESH_AXES) or min(given.values()) < 1:
            raise UsageError(f"--mesh_shape {mesh_shape}: the axes are {' and '.join(MESH_AXES)}, each at least 1")
        sizes = {"data": 1, "fsdp": 1, **given}
        if "data" not in given:
            sizes["data"] = max(1, jax.device_count() // sizes["fsdp"])
        if sizes["data"] * sizes["fsdp"] != jax.device_count():
            raise UsageError(
                f"--mesh_shape {mesh_shape} has {sizes['data'] * sizes['fsdp']} devices but there are "
                f"{jax.device_count()}; make the sizes multiply to the device count"
            )
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    )


# Copied from run_clm_flax.optimizer_state_shardings
def optimizer_state_shardings(abstract_opt_state, abstract_params, param_shardings, mesh):
    """Each optimizer-state leaf that mirrors a parameter (Adam's moments) is sharded like it; the rest
    (step counts, Adafactor's factored statistics) is replicated."""
    by_path = {
        jax.tree_util.keystr(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree_util.tree_leaves(param_shardings)
        )
    }
    replicated = NamedSharding(mesh, PartitionSpec())

    def choose(path, leaf):
        for start in range(len(path)):
            shape, sharding = by_path.get(jax.tree_util.keystr(path[start:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(choose, abstract_opt_state)


# Copied from run_clm_flax.abstract_model_params
def abstract_model_params(model, dummy_input, unbox: bool = True):
    """Shapes and dtypes of the model's parameters, without computing them. Unboxed: plain arrays;
    boxed: each carries its logical axis names."""
    variables = jax.eval_shape(partial(model.init, deterministic=True), jax.random.key(0), dummy_input)
    return nn.meta.unbox(variables["params"]) if unbox else variables["params"]


# Copied from run_clm_flax.abstract_train_state
def abstract_train_state(model, optimizer, mesh, dummy_input) -> TrainState:
    """Shape, dtype and sharding of every leaf of the training state, computed without allocating it."""
    boxed_params = abstract_model_params(model, dummy_input, unbox=False)
    param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_params), mesh, LOGICAL_AXIS_RULES)
    abstract_params = nn.meta.unbox(boxed_params)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=param_shardings,
        opt_state=optimizer_state_shardings(abstract_opt_state, abstract_params, param_shardings, mesh),
    )
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt_state)
    return jax.tree_util.tree_map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding), shapes, shardings)


# Copied from run_clm_flax.create_train_state
def create_train_state(model, optimizer, abstract_state: TrainState, seed: int, dummy_input, loaded_params=None):
    """The training state, created directly with its sharding: parameters are initialised (or placed,
    when loaded from a checkpoint) on the devices that hold them, never first in full on one device."""
    shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)

    def init(params):
        if params is None:
            params = nn.meta.unbox(model.init(jax.random.key(seed), dummy_input, deterministic=True)["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    if loaded_params is not None:
        loaded_params = jax.device_put(loaded_params, shardings.params)
    return jax.jit(init, out_shardings=shardings)(loaded_params)


def make_train_step(model, optimizer, schedule, seed: int):
    dropout_key = jax.random.key(seed + 1)

    def micro_batch_gradients(params, batch, dropout_rng):
        """Gradients of the summed loss of one micro-batch, with that sum, the correct predictions and the
        number of predicted tokens."""

        def loss_sum_fn(params):
            logits = model.apply(
                {"params": params}, batch["input_ids"], batch["attention_mask"], deterministic=False,
                masked_positions=batch["masked_positions"], rngs={"dropout": dropout_rng},
            )
            loss_sum, correct_sum, weight_sum = masked_lm_loss_sums(logits, batch["masked_labels"], batch["masked_weights"])
            return loss_sum, (correct_sum, weight_sum)

        (loss_sum, (correct_sum, weight_sum)), grads = jax.value_and_grad(loss_sum_fn, has_aux=True)(params)
        return grads, loss_sum, correct_sum, weight_sum

    def train_step(state: TrainState, batch):
        # Every array of the batch is (gradient_accumulation_steps, micro_batch, ...).
        # Dropout randomness depends only on the step, so a resumed run draws the same masks.
        step_rng = jax.random.fold_in(dropout_key, state.step)
        if batch["input_ids"].shape[0] == 1:
            micro_batch = jax.tree_util.tree_map(lambda values: values[0], batch)
            grads, loss_sum, correct_sum, weight_sum = micro_batch_gradients(state.params, micro_batch, step_rng)
        else:

            def accumulate(totals, index):
                micro_batch = jax.tree_util.tree_map(lambda values: values[index], batch)
                sums = micro_batch_gradients(state.params, micro_batch, jax.random.fold_in(step_rng, index))
                return jax.tree_util.tree_map(jnp.add, totals, sums), None

            zeros = (jax.tree_util.tree_map(jnp.zeros_like, state.params), *(jnp.float32(0),) * 3)
            sums, _ = jax.lax.scan(accumulate, zeros, jnp.arange(batch["input_ids"].shape[0]))
            grads, loss_sum, correct_sum, weight_sum = sums
        # The mean over every masked token of the whole batch, however it was split into micro-batches
        # (a batch with none leaves the gradients at 0).
        grads = jax.tree_util.tree_map(lambda grad: grad / jnp.maximum(weight_sum, 1.0), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        # A non-finite update is never applied: the step counter moves on, the weights stay as they were.
        params, opt_state = jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old),
            (optax.apply_updates(state.params, updates), opt_state),
            (state.params, state.opt_state),
        )
        metrics = {
            "loss_sum": loss_sum,
            "correct_sum": correct_sum,
            "weight_sum": weight_sum,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state.step),
            "finite": finite,
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model):
    def eval_step(params, batch):
        logits = model.apply(
            {"params": params}, batch["input_ids"], batch["attention_mask"], masked_positions=batch["masked_positions"]
        )
        loss_sum, correct_sum, weight_sum = masked_lm_loss_sums(logits, batch["masked_labels"], batch["masked_weights"])
        return {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    return eval_step


# Copied from run_clm_flax.to_global_batch
def to_global_batch(local_batch: dict, batch_sharding) -> dict:
    """This process's rows -> one array split over every device of every process."""
    return {
        name: jax.make_array_from_process_local_data(batch_sharding, rows) for name, rows in local_batch.items()
    }


def evaluate(eval_step, params, examples, make_batch, global_batch_size, seed, batch_sharding) -> dict:
    """Loss, perplexity and accuracy over the whole evaluation set, averaged exactly over masked tokens."""
    totals = {"loss_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
    num_batches = math.ceil(len(examples) / global_batch_size)
    batches = prefetch(
        to_global_batch(batch, batch_sharding) for batch in eval_batches(examples, make_batch, global_batch_size, seed)
    )
    for batch in tqdm(batches, total=num_batches, desc="Evaluating", leave=False, disable=jax.process_index() > 0):
        for name, value in jax.device_get(eval_step(params, batch)).items():
            totals[name] += float(value)
    masked_tokens = totals["weight_sum"]
    loss = totals["loss_sum"] / max(masked_tokens, 1.0)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 100.0)),
        "accuracy": totals["correct_sum"] / max(masked_tokens, 1.0),
        "masked_tokens": int(masked_tokens),
    }


# ----------------------------------------------------------------------------------------------------
# Training checkpoints, stopping on request, non-finite steps
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.open_checkpoints
def open_checkpoints(output_dir: str, save_total_limit: int) -> ocp.CheckpointManager:
    """The run's training checkpoints, OUTPUT_DIR/checkpoints/STEP, the newest `save_total_limit` kept.

    Orbax writes each checkpoint into a temporary directory and renames it once complete, so a process
    killed while saving leaves the earlier checkpoints intact; the unfinished one is deleted when the
    directory is next opened. With several processes, every process writes its own shards.
    """
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(output_dir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=save_total_limit, cleanup_tmp_directories=True),
    )


# Copied from run_clm_flax.save_checkpoint
def save_checkpoint(checkpoints: ocp.CheckpointManager, state: TrainState, progress_record: dict):
    """Returns once the arrays are copied off the devices; the files are written while training goes on."""
    checkpoints.save(
        progress_record["step"],
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress_record)),
    )


# Copied from run_clm_flax.restore_checkpoint
def restore_checkpoint(location: str, output_dir: str, abstract_state: TrainState) -> tuple[TrainState, dict, str]:
    """The training state (placed with the shardings of `abstract_state`), the progress record and the path
    of the checkpoint at `location`: "newest" (in output_dir), a checkpoints directory, or one STEP in it."""
    location_path = os.path.normpath(os.path.join(output_dir, "checkpoints") if location == "newest" else location)
    if os.path.basename(location_path).isdigit():
        directory, step = os.path.dirname(location_path), int(os.path.basename(location_path))
    else:
        directory, step = location_path, None
    if not os.path.isdir(directory):
        raise UsageError(f"--resume_from_checkpoint: there are no training checkpoints in {directory}")
    manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(create=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "progress": ocp.JsonCheckpointHandler()},
    )
    step = manager.latest_step() if step is None else step
    if step not in manager.all_steps():
        raise UsageError(f"--resume_from_checkpoint: there is no complete training checkpoint at {location_path}")
    path = os.path.join(directory, str(step))

    # Compare parameter shapes first: a mismatch found by the restore itself surfaces as a flood of
    # errors from Orbax's background reads.
    def parameter_shapes(tree):
        return {
            jax.tree_util.keystr(key_path[1:]): tuple(leaf.shape)
            for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if str(getattr(key_path[0], "key", getattr(key_path[0], "name", ""))) == "params"
        }

    stored, needed = parameter_shapes(manager.item_metadata(step)["state"]), parameter_shapes(abstract_state)
    if stored != needed:
        name = next(name for name in sorted(set(stored) | set(needed)) if stored.get(name) != needed.get(name))
        raise UsageError(
            f"the checkpoint {path} does not fit this model (parameter {name} has shape {stored.get(name)} there, "
            f"{needed.get(name)} here); resume with the config it was trained with"
        )
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), progress=ocp.args.JsonRestore())
        )
    except (ValueError, KeyError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(
            f"the checkpoint {path} does not fit this model ({reason}); resume with the config it was trained with"
        ) from None
    finally:
        manager.close()
    return restored.state, restored.progress, path


# Copied from run_clm_flax.saved_arguments
def saved_arguments(*argument_groups) -> dict:
    """All arguments, for the checkpoint's record; the hub token is never written."""
    return {name: value for group in argument_groups for name, value in asdict(group).items() if name != "token"}


# Copied from run_clm_flax.StopRequest
class StopRequest:
    """While active (a `with` block), Ctrl-C (SIGINT) or a preemption notice (SIGTERM) asks the loop to
    save a checkpoint and stop cleanly after the current step. A second Ctrl-C stops at once."""

    def __enter__(self):
        self.signal_name = None
        self._previous_handlers = {
            signal_number: signal.signal(signal_number, self._request) for signal_number in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def __exit__(self, *exception):
        for signal_number, handler in self._previous_handlers.items():
            signal.signal(signal_number, handler)

    def _request(self, signal_number, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signal_number).name
        logger.warning("%s: saving a checkpoint after this step, then stopping (Ctrl-C again stops at once)", self.signal_name)

    def requested(self, check_other_processes: bool) -> bool:
        """Whether to stop now. With several processes all must stop at the same step, so they agree on it
        only where `check_other_processes` (the same steps on every process) and otherwise carry on."""
        if jax.process_count() == 1:
            return self.signal_name is not None
        if not check_other_processes:
            return False
        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.signal_name is not None))))


# Copied from run_clm_flax.finite_steps
def finite_steps(step_metrics: list[dict], first_step: int, skip_nonfinite: bool, checkpoints) -> list[dict]:
    """The metrics of the steps whose loss and gradient norm were finite. A non-finite step stops the run,
    or is reported and skipped with --skip_nonfinite_steps (its update was never applied either way)."""
    bad_steps = [first_step + index for index, metrics in enumerate(step_metrics) if not metrics["finite"]]
    if bad_steps and not skip_nonfinite:
        newest = checkpoints.latest_step()
        last_good = os.path.join(str(checkpoints.directory), str(newest)) if newest is not None else "none was saved yet"
        raise UsageError(
            f"the loss or gradient norm is not finite at step {bad_steps[0]}; its update was not applied and nothing "
            f"was saved after it. Last good checkpoint: {last_good}. Lower --learning_rate and continue with "
            "--resume_from_checkpoint, or pass --skip_nonfinite_steps to skip such steps"
        )
    for step in bad_steps:
        logger.warning("step %d: the loss or gradient norm is not finite; the update was skipped", step)
    return [metrics for metrics in step_metrics if metrics["finite"]]


# ----------------------------------------------------------------------------------------------------
# Logging, saving and the fill-mask demo
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.TensorBoardWriter
class TensorBoardWriter:
    """Scalars and text for TensorBoard, written with the tensorboard package alone (no TensorFlow)."""

    def __init__(self, log_dir: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2, self._text_pb = event_pb2, summary_pb2, text_pb
        self._writer = EventFileWriter(log_dir)

    def _write(self, summary, step: int):
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalars(self, values: dict, step: int):
        summary_values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()]
        self._write(self._summary_pb2.Summary(value=summary_values), step)

    def text(self, tag: str, markdown: str, step: int = 0):
        self._write(self._text_pb(tag, markdown), step)

    def close(self):
        self._writer.close()


# Copied from run_clm_flax.arguments_markdown
def arguments_markdown(*argument_groups) -> str:
    """All arguments as a markdown table, for TensorBoard's text tab. The hub token is left out."""
    rows = ["| argument | value |", "| --- | --- |"]
    rows += [f"| {name} | {value} |" for name, value in sorted(saved_arguments(*argument_groups).items())]
    return "\n".join(rows)


# Copied from run_clm_flax.write_json
def write_json(path: str, values: dict):
    """Write via a temporary file, so an interrupted write never leaves a truncated file behind."""
    temporary_path = f"{path}.tmp"
    with open(temporary_path, "w") as file:
        json.dump(values, file, indent=2)
        file.write("\n")
    os.replace(temporary_path, path)


def save_model(output_dir: str, params, config, tokenizer):
    """A Hugging Face model directory: config, safetensors weights, tokenizer.

    Every process takes part in gathering the parameters; process 0 writes.
    """
    host_params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return
    os.makedirs(output_dir, exist_ok=True)
    weights_path = os.path.join(output_dir, "model.safetensors")
    save_file(to_hf_state_dict(host_params, config), f"{weights_path}.tmp", metadata={"format": "pt"})
    os.replace(f"{weights_path}.tmp", weights_path)
    config.architectures = ["RobertaForMaskedLM"]  # what AutoModelForMaskedLM and pipeline("fill-mask") build
    config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def fill_mask_demo_text(texts, mask_token: str) -> tuple[Optional[str], Optional[str]]:
    """(text, masked word): the first 16 words of the first text that has at least 6, the middle one masked."""
    for text in texts:
        words = (text or "").split()[:16]
        if len(words) >= 6:
            middle = len(words) // 2
            return " ".join(words[:middle] + [mask_token] + words[middle + 1 :]), words[middle]
    return None, None


def fill_mask(model, params, tokenizer, text: str, top_k: int, max_length: int) -> list[tuple[str, float]]:
    """The `top_k` most likely tokens, with their probabilities, at the first mask token of `text`."""
    input_ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
    if tokenizer.mask_token_id not in input_ids:
        return []
    position = input_ids.index(tokenizer.mask_token_id)
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray([input_ids], jnp.int32))[0, position]
    probabilities = np.asarray(jax.nn.softmax(logits))
    best = np.argsort(-probabilities)[:top_k]
    return [(tokenizer.decode([int(token_id)]), float(probabilities[token_id])) for token_id in best]


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.load_config_and_tokenizer
def load_config_and_tokenizer(model_args):
    def load(loader, name, flag):
        try:
            return loader.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load {flag} {name}: {str(error).splitlines()[0]}") from None

    config_source, config_flag = (
        (model_args.config_name, "--config_name") if model_args.config_name else (model_args.model_name_or_path, "--model_name_or_path")
    )
    if config_source:
        config = load(AutoConfig, config_source, config_flag)
    else:
        logger.warning("No --config_name: training a %s with the default configuration", model_args.model_type)
        config = transformers.CONFIG_MAPPING[model_args.model_type]()

    tokenizer_source, tokenizer_flag = (
        (model_args.tokenizer_name, "--tokenizer_name") if model_args.tokenizer_name else (model_args.model_name_or_path, "--model_name_or_path")
    )
    if not tokenizer_source:
        raise UsageError("training from scratch needs --tokenizer_name; make one with train_tokenizer.py")
    tokenizer = load(AutoTokenizer, tokenizer_source, tokenizer_flag)
    if not tokenizer.is_fast:
        raise UsageError(f"{tokenizer_flag} {tokenizer_source} is not a fast (tokenizers-backed) tokenizer")
    if len(tokenizer) > config.vocab_size:
        raise UsageError(
            f"the tokenizer has {len(tokenizer)} tokens but the config's vocab_size is {config.vocab_size}; "
            "ids beyond it would be clamped silently, so raise vocab_size in the config (create_config.py --tokenizer_dir)"
        )
    return config, tokenizer


def check_tokenizer(tokenizer, config):
    """The special tokens masked language modelling and RoBERTa's position numbering need."""
    if tokenizer.mask_token_id is None:
        raise UsageError(
            "the tokenizer has no mask token, which masked language modelling needs; "
            "train it with train_tokenizer.py --model_type roberta"
        )
    for role in ("bos", "eos", "pad"):
        if getattr(tokenizer, f"{role}_token_id") is None:
            raise UsageError(
                f"the tokenizer has no {role}_token, which RoBERTa needs; train it with train_tokenizer.py --model_type roberta"
            )
    if tokenizer.pad_token_id != config.pad_token_id:
        raise UsageError(
            f"the tokenizer's padding token has id {tokenizer.pad_token_id} but the config's pad_token_id is "
            f"{config.pad_token_id}; RoBERTa numbers positions from it, so make them equal "
            "(create_config.py --tokenizer_dir takes it from the tokenizer)"
        )


def choose_max_seq_length(data_args, tokenizer, config) -> int:
    # RoBERTa numbers positions from pad_token_id + 1, so that many position embeddings are never used.
    usable_positions = config.max_position_embeddings - config.pad_token_id - 1
    if data_args.max_seq_length is None:
        return min(tokenizer.model_max_length, usable_positions)
    if data_args.max_seq_length > usable_positions:
        raise UsageError(
            f"--max_seq_length {data_args.max_seq_length} does not fit the model's positions: max_position_embeddings "
            f"{config.max_position_embeddings} minus the padding offset {config.pad_token_id + 1} leaves "
            f"{usable_positions}; lower --max_seq_length"
        )
    return data_args.max_seq_length


def main():
    model_args, data_args, training_args = parse_arguments()
    if not (training_args.do_train or training_args.do_eval):
        # As in the Hugging Face Flax example: without either flag, train (given training data) and evaluate.
        training_args.do_train = data_args.train_file is not None or data_args.dataset_name is not None
        training_args.do_eval = True
    check_arguments(model_args, data_args, training_args)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if jax.process_index() == 0 else logging.ERROR,
        force=True,  # importing orbax installs absl's handler, which would hide these logs
    )
    logging.getLogger("absl").setLevel(logging.WARNING)
    datasets.utils.logging.set_verbosity_warning()
    transformers.utils.logging.set_verbosity_warning()
    logger.info("%d devices over %d processes: %s", jax.device_count(), jax.process_count(), jax.devices())

    # Model config and tokenizer
    config, tokenizer = load_config_and_tokenizer(model_args)
    check_model_config(config)
    check_tokenizer(tokenizer, config)
    max_seq_length = choose_max_seq_length(data_args, tokenizer, config)
    if training_args.fill_mask_text and tokenizer.mask_token not in training_args.fill_mask_text:
        raise UsageError(f"--fill_mask_text must contain the mask token {tokenizer.mask_token}")

    # Data
    raw_datasets = load_raw_datasets(model_args, data_args)
    examples = {}
    for split in ("train", "validation"):
        if split not in raw_datasets:
            continue
        dataset, column = raw_datasets[split], data_args.text_column_name
        workers, overwrite_cache = data_args.preprocessing_num_workers, data_args.overwrite_cache
        if data_args.line_by_line:
            examples[split] = tokenize_lines(dataset, tokenizer, column, workers, overwrite_cache, split)
        else:  # blocks of max_seq_length - 2 tokens, which BatchMaker frames as <s> block </s>
            examples[split] = tokenize_and_pack(dataset, tokenizer, column, max_seq_length - 2, workers, overwrite_cache, split)
    if data_args.max_train_samples is not None and "train" in examples:
        examples["train"] = first_examples(examples["train"], data_args.max_train_samples)
    if data_args.max_eval_samples is not None and "validation" in examples:
        examples["validation"] = first_examples(examples["validation"], data_args.max_eval_samples)
    for split, split_examples in examples.items():
        if len(split_examples) == 0:
            raise UsageError(
                f"the {split} data has no non-empty lines" if data_args.line_by_line else
                f"the {split} data has fewer tokens than one block of {max_seq_length}; add text or lower --max_seq_length"
            )
    if training_args.do_eval and "validation" not in examples:
        raise UsageError("--do_eval needs evaluation data: pass --validation_file or train data to split")
    if data_args.line_by_line:
        for split, split_examples in examples.items():
            lengths = np.diff(split_examples.offsets)
            logger.info("%s: %d of %d lines are longer than %d tokens and get truncated",
                        split, int(np.sum(lengths > max_seq_length - 2)), len(lengths), max_seq_length - 2)
    make_batch = BatchMaker.from_tokenizer(tokenizer, max_seq_length, data_args.mlm_probability, data_args.pad_to_max_length)

    # Model, mesh, optimizer, training state
    mesh = create_mesh(training_args.mesh_shape)
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    micro_batches_sharding = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))  # (micro-batch, row, ...)
    accumulation_steps = training_args.gradient_accumulation_steps
    train_batch_size = training_args.per_device_train_batch_size * jax.device_count() * accumulation_steps
    eval_batch_size = training_args.per_device_eval_batch_size * jax.device_count()
    model = FlaxRobertaForMaskedLM(
        config,
        dtype=jnp.dtype(model_args.dtype),
        param_dtype=jnp.dtype(model_args.param_dtype),
        remat_policy=model_args.remat_policy if model_args.gradient_checkpointing else None,
    )

    total_steps = 1
    if training_args.do_train:
        steps_per_epoch = len(examples["train"]) // train_batch_size
        if steps_per_epoch == 0:
            raise UsageError(
                f"the training data makes {len(examples['train'])} examples, fewer than one global batch of "
                f"{train_batch_size}; add data or lower --per_device_train_batch_size or --max_seq_length"
            )
        if training_args.max_steps > 0:
            total_steps = training_args.max_steps
        else:
            total_steps = max(1, int(training_args.num_train_epochs * steps_per_epoch))
    schedule = learning_rate_schedule(training_args, total_steps)
    optimizer = create_optimizer(training_args, schedule)

    dummy_input = jnp.zeros((1, max_seq_length), jnp.int32)
    abstract_state = abstract_train_state(model, optimizer, mesh, dummy_input)
    state_shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
    progress_record = {"step": 0, "train_loss_sum": 0.0, "train_correct_sum": 0.0, "train_weight_sum": 0.0}
    if training_args.resume_from_checkpoint:
        state, progress_record, checkpoint_path = restore_checkpoint(
            training_args.resume_from_checkpoint, training_args.output_dir, abstract_state
        )
        logger.info("Resumed from %s at step %d", checkpoint_path, progress_record["step"])
        if (progress_record["global_batch_size"], progress_record["max_seq_length"]) != (train_batch_size, max_seq_length):
            logger.warning(
                "The checkpoint was trained with global batches of %d x %d tokens, this run uses %d x %d: the data "
                "order and the masks differ from the interrupted run's", progress_record["global_batch_size"],
                progress_record["max_seq_length"], train_batch_size, max_seq_length,
            )
        if progress_record["step"] >= total_steps:
            raise UsageError(
                f"the checkpoint is at step {progress_record['step']}, the run ends at step {total_steps}; "
                "raise --max_steps or --num_train_epochs to train further"
            )
    else:
        loaded_params = None
        if model_args.model_name_or_path:
            loaded_params = jax.tree_util.tree_map(
                lambda value, leaf: value.astype(leaf.dtype),
                from_hf_state_dict(read_safetensors_checkpoint(model_args.model_name_or_path, model_args), config),
                abstract_state.params,
            )
            logger.info("Loaded weights from %s", model_args.model_name_or_path)
        state = create_train_state(model, optimizer, abstract_state, training_args.seed, dummy_input, loaded_params)
    num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state.params))
    logger.info(
        "RoBERTa with %.1fM parameters in %s, computing in %s, on a mesh of %s",
        num_params / 1e6, model_args.param_dtype, model_args.dtype, dict(mesh.shape),
    )

    train_step = jax.jit(
        make_train_step(model, optimizer, schedule, training_args.seed),
        in_shardings=(state_shardings, micro_batches_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(make_eval_step(model), in_shardings=(state_shardings.params, batch_sharding))

    is_main_process = jax.process_index() == 0
    os.makedirs(training_args.output_dir, exist_ok=True)
    writer = TensorBoardWriter(os.path.join(training_args.output_dir, "tensorboard")) if is_main_process else None
    if writer:
        writer.text("arguments", arguments_markdown(model_args, data_args, training_args))

    def run_evaluation(step: int) -> dict:
        results = evaluate(
            eval_step, state.params, examples["validation"], make_batch, eval_batch_size, training_args.seed,
            batch_sharding,
        )
        logger.info(
            "step %d: eval loss %.4f, perplexity %.2f, accuracy %.4f over %d masked tokens",
            step, results["loss"], results["perplexity"], results["accuracy"], results["masked_tokens"],
        )
        if writer:
            writer.scalars(
                {"eval/loss": results["loss"], "eval/perplexity": results["perplexity"], "eval/accuracy": results["accuracy"]},
                step,
            )
        return results

    # Training loop
    if training_args.do_train:
        eval_steps = training_args.eval_steps or training_args.logging_steps
        start_step = progress_record["step"]
        logger.info(
            "Training steps %d to %d (%.2f epochs of %d examples), global batch %d x %d tokens%s",
            start_step + 1, total_steps, total_steps / steps_per_epoch, len(examples["train"]), train_batch_size,
            max_seq_length, " at most (padded per batch)" if data_args.line_by_line else "",
        )

        def batches_from(step: int):
            # The data order and the masks are a function of the step, so a resumed run sees the batches the
            # interrupted one would have.
            epoch, first_batch = divmod(step, steps_per_epoch)
            while True:
                for batch, num_tokens in train_batches(
                    examples["train"], make_batch, train_batch_size, training_args.seed, epoch, first_batch
                ):
                    micro_batches = {
                        name: values.reshape(accumulation_steps, -1, *values.shape[1:]) for name, values in batch.items()
                    }
                    yield to_global_batch(micro_batches, micro_batches_sharding), num_tokens
                epoch, first_batch = epoch + 1, 0

        def save(step: int):
            progress_record.update(
                step=step, epoch=step // steps_per_epoch, batch_in_epoch=step % steps_per_epoch,
                global_batch_size=train_batch_size, max_seq_length=max_seq_length,
                arguments=saved_arguments(model_args, data_args, training_args),
            )
            save_checkpoint(checkpoints, state, progress_record)
            save_model(training_args.output_dir, state.params, config, tokenizer)
            logger.info("step %d: saved a training checkpoint and the model to %s", step, training_args.output_dir)

        # Leaving this block, for whatever reason, waits for a checkpoint still being written.
        with open_checkpoints(training_args.output_dir, training_args.save_total_limit) as checkpoints, StopRequest() as stop:
            batches = prefetch(batches_from(start_step))
            progress = tqdm(initial=start_step, total=total_steps, desc="Training", disable=not is_main_process)
            unread_metrics, log_window, window_start = [], [], time.perf_counter()
            train_start, train_tokens = time.perf_counter(), 0
            for step in range(start_step + 1, total_steps + 1):
                batch, num_tokens = next(batches)
                state, metrics = train_step(state, batch)
                unread_metrics.append({**metrics, "tokens": num_tokens})
                train_tokens += num_tokens
                progress.update(1)
                is_last = step == total_steps
                is_log_step = step % training_args.logging_steps == 0 or is_last
                stopping = stop.requested(check_other_processes=is_log_step)
                is_save_step = step % training_args.save_steps == 0 or is_last or stopping

                if is_log_step or is_save_step:
                    # Reading the metrics waits for the steps to finish; checking them here means no non-finite
                    # step goes unnoticed into a checkpoint.
                    fetched = jax.device_get(unread_metrics)
                    finite = finite_steps(fetched, step - len(fetched) + 1, training_args.skip_nonfinite_steps, checkpoints)
                    for name in ("loss_sum", "correct_sum", "weight_sum"):
                        progress_record[f"train_{name}"] += sum(float(m[name]) for m in finite)
                    log_window += finite
                    unread_metrics = []
                if (is_log_step or stopping) and log_window:
                    elapsed = time.perf_counter() - window_start
                    masked_tokens = max(sum(float(m["weight_sum"]) for m in log_window), 1.0)
                    logged = {
                        "train/loss": sum(float(m["loss_sum"]) for m in log_window) / masked_tokens,
                        "train/accuracy": sum(float(m["correct_sum"]) for m in log_window) / masked_tokens,
                        "train/learning_rate": float(log_window[-1]["learning_rate"]),
                        "train/grad_norm": float(log_window[-1]["grad_norm"]),
                        "train/tokens_per_second": sum(m["tokens"] for m in log_window) / elapsed,
                    }
                    progress.set_postfix(
                        loss=f"{logged['train/loss']:.4f}", accuracy=f"{logged['train/accuracy']:.3f}",
                        lr=f"{logged['train/learning_rate']:.2e}", tokens_per_s=f"{logged['train/tokens_per_second']:.0f}",
                    )
                    logger.info(
                        "step %d: loss %.4f, accuracy %.4f, learning rate %.3e, grad norm %.3f, %.0f tokens/s",
                        step, logged["train/loss"], logged["train/accuracy"], logged["train/learning_rate"],
                        logged["train/grad_norm"], logged["train/tokens_per_second"],
                    )
                    if writer:
                        writer.scalars(logged, step)
                    log_window, window_start = [], time.perf_counter()

                if training_args.do_eval and step % eval_steps == 0 and not is_last and not stopping:
                    run_evaluation(step)
                if is_save_step:
                    save(step)
                if stopping:
                    break
            progress.close()
        train_runtime = time.perf_counter() - train_start

        if stopping:
            if writer:
                writer.close()
            print(
                f"Stopped by {stop.signal_name} after step {step}; the training checkpoint is in "
                f"{os.path.join(training_args.output_dir, 'checkpoints', str(step))}. To continue, run the same "
                "command with --resume_from_checkpoint added."
            )
            return
        if is_main_process:
            masked_tokens = max(progress_record["train_weight_sum"], 1.0)
            write_json(
                os.path.join(training_args.output_dir, "train_results.json"),
                {
                    "train_loss": progress_record["train_loss_sum"] / masked_tokens,
                    "train_accuracy": progress_record["train_correct_sum"] / masked_tokens,
                    "train_steps": total_steps,
                    "epochs": total_steps / steps_per_epoch,
                    "train_runtime_seconds": train_runtime,
                    "train_tokens_per_second": train_tokens / train_runtime,
                },
            )
        logger.info("Saved the model to %s", training_args.output_dir)

    if training_args.do_eval:
        step = int(state.step)
        results = run_evaluation(step)
        if is_main_process:
            write_json(
                os.path.join(training_args.output_dir, "eval_results.json"),
                {"eval_loss": results["loss"], "eval_perplexity": results["perplexity"],
                 "eval_accuracy": results["accuracy"], "eval_masked_tokens": results["masked_tokens"], "step": step},
            )
            print(
                f"eval accuracy: {results['accuracy']:.4f}, perplexity: {results['perplexity']:.2f} "
                f"(loss {results['loss']:.4f}, {results['masked_tokens']} masked tokens)"
            )
    if writer:
        writer.close()

    if training_args.do_train and is_main_process and training_args.fill_mask_top_k > 0:
        text, masked_word = training_args.fill_mask_text, None
        if not text and "validation" in raw_datasets:
            validation = raw_datasets["validation"]
            text, masked_word = fill_mask_demo_text(
                validation.select(range(min(100, len(validation))))[data_args.text_column_name], tokenizer.mask_token
            )
        if text:
            # Read the export back, so the demo also shows that the saved files hold the trained model.
            exported = from_hf_state_dict(load_file(os.path.join(training_args.output_dir, "model.safetensors")), config)
            predictions = fill_mask(
                FlaxRobertaForMaskedLM(config), exported, tokenizer, text, training_args.fill_mask_top_k, max_seq_length
            )
            masked = f" (masked: {masked_word!r})" if masked_word else ""
            print(f"fill-mask with {training_args.output_dir}: {text!r}{masked}")
            for token, probability in predictions:
                print(f"  {probability:.3f} {token!r}")
    if is_main_process and training_args.do_train:
        print(f"TensorBoard: tensorboard --logdir {os.path.join(training_args.output_dir, 'tensorboard')}")


if __name__ == "__main__":
    try:
        main()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
