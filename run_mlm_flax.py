#!/usr/bin/env python3
"""Pretrain a RoBERTa masked language model with JAX/Flax.

Trains from scratch (a config and a tokenizer, for example from create_config.py --preset roberta-tiny and
train_tokenizer.py --model_type roberta) or continues from a Hugging Face RoBERTa checkpoint, on text from
local files (txt, json/jsonl, csv, parquet; globs allowed), a local dataset directory or a `datasets` hub name.

Two ways to make examples:
- grouped (the default): texts (a whole .txt file, unless --text_sample_by says otherwise; one row of other
  formats) are tokenized, joined with the separator </s> and cut into blocks, each
  framed as `<s> ... </s>`, of exactly --max_seq_length tokens. For corpora larger than memory or disk, the
  blocks can be packed once into memory-mapped shards (--packed_data_dir) or made on the fly from a stream
  (--streaming);
- --line_by_line: every non-empty line (or text) is one example, framed the same way and truncated to
  --max_seq_length; batches are padded and carry an attention mask.

Every batch is masked on the host with numpy, reproducibly from --seed: each token that is not a special
token or padding is chosen with probability --mlm_probability; of the chosen, 80% become <mask>, 10% a random
token and 10% stay as they are. The loss and the accuracy count the chosen tokens only. Each global batch is
split over every device of every process with `jax.jit` over a device mesh. On several hosts every host runs
the same command (see initialize_distributed for how the processes find each other), each makes and masks
only its own rows of every batch, and process 0 writes the outputs. Training checkpoints in
OUTPUT_DIR/checkpoints let an interrupted run continue exactly with --resume_from_checkpoint.

The model is a Flax RoBERTa whose parameters map one-to-one onto the PyTorch `RobertaForMaskedLM` of
`transformers`: the output directory is an ordinary Hugging Face model directory (config.json,
model.safetensors, tokenizer files) that `AutoModelForMaskedLM` and `pipeline("fill-mask")` load in PyTorch.

    ./run_mlm_flax.py --output_dir roberta-run --config_name my-model --tokenizer_name my-model \
        --train_file "data/*.txt" --do_train --do_eval --max_seq_length 128

A single .json file holding the arguments works too: `./run_mlm_flax.py args.json`.
"""

import collections
import contextlib
import copy
import fcntl
import functools
import glob
import hashlib
import html
import importlib.util
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any

import datasets
import datasets.distributed
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
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.UsageError
class UsageError(Exception):
    """A problem the user must fix (an argument, a file, a diverged run): reported as one line, no traceback."""


# Copied from run_clm_flax.ModelArguments with gpt2->roberta
@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint of this script's model (roberta) to continue from: a local directory holding "
            "config.json and model.safetensors, or a hub name. Leave unset to train from scratch."
        },
    )
    model_type: str = field(
        default="roberta", metadata={"help": "Must be roberta; without --config_name, its default config is trained."}
    )
    config_name: str | None = field(default=None, metadata={"help": "Directory or hub name, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Directory or hub name, if not the model's."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where downloaded models and datasets, and the tokenized data, are cached."}
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
    gradient_checkpointing: str | None = field(
        default=None,
        metadata={
            "help": "Recompute each layer's activations in the backward pass instead of storing them. Alone (or true) "
            "it keeps nothing (nothing_saveable, least memory); or name what it keeps: dots_saveable (matmul outputs: "
            "less recomputation) or dots_with_no_batch_dims_saveable (in between).",
            "nargs": "?",
            "const": "nothing_saveable",
        },
    )
    token: str | None = field(
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


# Shards of a packed corpus hold this many tokens (512 MiB as uint16); the last shard of a split may hold fewer.
# Copied from run_clm_flax.PACKED_TOKENS_PER_SHARD
PACKED_TOKENS_PER_SHARD = 2**28


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A `datasets` hub name, or a local directory: one written by Dataset.save_to_disk, or one "
            "holding data files."
        },
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "The configuration of the dataset given by --dataset_name."}
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "Training text: a .txt, .json/.jsonl, .csv or .parquet file, or a glob such as 'data/*.txt'."
        },
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "Evaluation text, in the same formats as --train_file."},
    )
    text_column_name: str = field(
        default="text", metadata={"help": "The column holding the text (txt files always give 'text')."}
    )
    skip_missing_texts: bool = field(
        default=False,
        metadata={
            "help": "Leave out rows whose text is missing or null (counted in the log) instead of stopping there."
        },
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "Keep only this many training examples (blocks, or lines with --line_by_line)."},
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation examples."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again even if a cached result exists."})
    validation_split_percentage: int = field(
        default=5,
        metadata={
            "help": "Without a validation split, the first this percent of the training blocks (lines with "
            "--line_by_line) are held out for evaluation, whichever the route."
        },
    )
    max_seq_length: int | None = field(
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
            "joining the texts and cutting them into full blocks. Each line is stored padded to --max_seq_length, "
            "so short lines take more disk than their tokens (as uint16 ids, 2 x --max_seq_length bytes a line)."
        },
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "With --line_by_line, pad every batch to --max_seq_length. Otherwise a batch is padded to the "
            "next power of two (at least 16) above its longest example, so jit compiles only a few shapes."
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={
            "help": "Processes that tokenize the texts, spawned (a forked copy of JAX's threads can deadlock); not "
            "for a stream tokenized while training."
        },
    )
    text_sample_by: str | None = field(
        default=None,
        metadata={
            "help": "What one text of a .txt file is: 'document' (the whole file, as written; the default), "
            "'paragraph' (text between blank lines) or 'line' (the default with --line_by_line). Grouped, texts are "
            "joined with </s>; with --line_by_line each text is one example. Rows of other formats are always one "
            "text each.",
            "choices": ["document", "paragraph", "line"],
        },
    )
    keep_linebreaks: bool = field(
        default=True,
        metadata={
            "help": "With --text_sample_by line, keep the line break at the end of each line (with --line_by_line "
            "it is always removed, since every line is an example of its own)."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the data as a stream, never copied to disk first: for corpora larger than memory or disk. "
            "Alone, texts are tokenized and grouped into blocks on the fly while training, which needs --max_steps; "
            "with --packed_data_dir, the stream is packed into its shards once and training reads those (the only "
            "way with --line_by_line)."
        },
    )
    shuffle_buffer_size: int = field(
        default=10000,
        metadata={
            "help": "With --streaming (and no --packed_data_dir): texts held in the buffer the stream is shuffled "
            "through, an approximate shuffle; 0 keeps the stream's order."
        },
    )
    packed_data_dir: str | None = field(
        default=None,
        metadata={
            "help": "A directory of token rows in memory-mappable shards: grouped blocks, or lines with "
            "--line_by_line. Used as it is when it holds the data packed with this tokenizer, --max_seq_length and "
            "--line_by_line; otherwise the data arguments are tokenized and packed into it first (by process 0). "
            "Later runs and every process read only the rows they need, nothing is tokenized again. Refused when "
            "packed with another tokenizer, length, framing or data."
        },
    )
    packed_tokens_per_shard: int = field(
        default=PACKED_TOKENS_PER_SHARD,
        metadata={
            "help": "Tokens per shard file of a packed corpus, in --packed_data_dir or the token cache under "
            "--cache_dir (rounded down to whole blocks)."
        },
    )

    @property
    def framing(self) -> str:
        """How texts become the rows of a packed corpus, recorded in it so that one is never read as the other."""
        return "line_by_line" if self.line_by_line else "grouped"


# Copied from run_clm_flax.CommonTrainingArguments
@dataclass
class CommonTrainingArguments:
    """The training arguments both scripts take; TrainingArguments adds this script's own."""

    output_dir: str = field(
        metadata={"help": "Where the model, its tokenizer, the results and the TensorBoard logs are written."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an output directory that already holds one: its checkpoints, TensorBoard logs "
            "and results are removed (the model files are overwritten by this run's)."
        },
    )
    do_train: bool = field(
        default=False,
        metadata={
            "help": "Train the model. With neither --do_train nor --do_eval: train (given training data) and "
            "evaluate, or with --packed_data_dir only pack the data."
        },
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
    mesh_shape: str | None = field(
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
        default=-1, metadata={"help": "Steps to train; when positive, overrides --num_train_epochs."}
    )
    warmup_steps: int = field(default=0, metadata={"help": "Steps of linear warm-up from 0 to the learning rate."})
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warm-up as a fraction of all steps; used when --warmup_steps is 0."}
    )
    lr_scheduler_type: str = field(
        default="linear",
        metadata={
            "help": "Decay after warm-up: linear or cosine (both to 0), or constant.",
            "choices": ["linear", "cosine", "constant"],
        },
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip gradients to this global norm; 0: no clipping."})
    logging_steps: int = field(default=500, metadata={"help": "Steps between log lines of the training loss."})
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "help": "Where to report the metrics, arguments and results: tensorboard, wandb, mlflow (each needs its "
            "package), all (TensorBoard and the others installed) or none; several as a comma list."
        },
    )
    save_steps: int = field(default=500, metadata={"help": "Steps between saves of a checkpoint and the model."})
    save_total_limit: int = field(
        default=3, metadata={"help": "Keep this many newest training checkpoints in OUTPUT_DIR/checkpoints."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Continue from a training checkpoint: a directory OUTPUT_DIR/checkpoints/STEP, or no value (or "
            "auto) for the newest readable one in --output_dir, starting afresh when there is none and exiting at "
            "once when the run is complete, so the same command can be repeated until the run is done.",
            "nargs": "?",
            "const": "auto",
        },
    )
    skip_nonfinite_steps: bool = field(
        default=False,
        metadata={"help": "Skip an update whose loss or gradient norm is not finite, instead of stopping."},
    )
    eval_steps: int | None = field(default=None, metadata={"help": "Evaluate this often; default: --logging_steps."})
    seed: int = field(
        default=42,
        metadata={"help": "Seed for initialisation, data order and the randomness of training (dropout, masking)."},
    )
    ignore_data_skip: bool = field(
        default=False,
        metadata={
            "help": "When resuming a --streaming run, start the stream afresh instead of re-reading (and "
            "re-tokenizing) the blocks already trained on: faster, but the data differs from the interrupted run's."
        },
    )


@dataclass
class TrainingArguments(CommonTrainingArguments):
    fill_mask_text: str = field(
        default="",
        metadata={
            "help": "Text with one <mask> (the tokenizer's mask token) for the fill-mask demo run on the saved model "
            "at the end of training. Default: the start of the first validation text, its middle word masked."
        },
    )
    fill_mask_top_k: int = field(default=5, metadata={"help": "Predictions shown by the fill-mask demo; 0 for none."})


# Copied from run_clm_flax.DistributedArguments
@dataclass
class DistributedArguments:
    """How the processes of a run started by hand find each other. Not needed for a single process, nor
    where the launcher tells JAX (Cloud TPU VMs, Slurm's srun, Open MPI's mpirun): see initialize_distributed."""

    coordinator_address: str | None = field(
        default=None,
        metadata={
            "help": "HOST:PORT of process 0, which every process of a multi-process run connects to (any free port). "
            "Give it with --num_processes and --process_id when starting one command per host by hand."
        },
    )
    num_processes: int | None = field(
        default=None, metadata={"help": "How many processes take part in the run, with --coordinator_address."}
    )
    process_id: int | None = field(
        default=None,
        metadata={
            "help": "This process's number, 0 to --num_processes - 1, with --coordinator_address. Process 0 logs "
            "and writes the model, the results and the TensorBoard logs."
        },
    )
    local_device_ids: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated ids of the local GPUs this process drives, e.g. 0,1,2,3 (multi-process runs "
            "only). Defaults to all of them, except under Slurm and Open MPI: one GPU per task."
        },
    )


# Flags of the Hugging Face examples that these scripts do not take, and what to do instead.
# Copied from run_clm_flax.UNSUPPORTED_FLAGS
UNSUPPORTED_FLAGS = {
    "push_to_hub": "upload --output_dir after training, e.g. with `hf upload`",
    "hub_model_id": "upload --output_dir after training, e.g. with `hf upload MODEL_ID OUTPUT_DIR`",
    "hub_token": "upload --output_dir after training with `hf upload`, which takes the token of `hf auth login`",
    "use_fast_tokenizer": "the tokenizer is always the fast (tokenizers-backed) one; leave the flag out",
    "remat_policy": "name the policy after --gradient_checkpointing, e.g. --gradient_checkpointing dots_saveable",
}


# Copied from run_clm_flax.parse_arguments
def parse_arguments() -> tuple[ModelArguments, DataTrainingArguments, TrainingArguments, DistributedArguments]:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, DistributedArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        try:
            with open(sys.argv[1]) as file:
                values = json.load(file)
            if not isinstance(values, dict):
                raise ValueError("it must hold one JSON object of argument names and values")
            known = {item.name for group in parser.dataclass_types for item in fields(group)}
            refuse_unknown_arguments([f"--{name}" for name in values if name not in known])
            return parser.parse_dict(values)
        except (OSError, TypeError, ValueError) as error:
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    *arguments, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    refuse_unknown_arguments(unknown)
    return tuple(arguments)


# Copied from run_clm_flax.refuse_unknown_arguments
def refuse_unknown_arguments(arguments: list[str]):
    for argument in arguments:
        name = argument.split("=")[0].lstrip("-").replace("-", "_")
        if name in UNSUPPORTED_FLAGS:
            raise UsageError(f"--{name} is not supported: {UNSUPPORTED_FLAGS[name]}")
    if arguments:
        raise UsageError(f"unknown argument {arguments[0]}; see --help for the arguments this script takes")


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments. Call it after initialize_distributed, which checks the distributed flags before the processes join:
    the check of --dtype asks JAX for the platform, and JAX must not start before the processes have joined."""
    if model_args.model_type != "roberta":
        raise UsageError(
            f"--model_type {model_args.model_type} is not supported; this script trains roberta (run_clm_flax.py "
            "trains gpt2)"
        )
    check_numeric_arguments(
        (data_args, training_args),
        max_seq_length=(lambda value: value is None or value >= 3, "must be at least 3: <s>, one token and </s>"),
        mlm_probability=(lambda value: 0 < value < 1, "must be between 0 and 1, such as 0.15"),
        fill_mask_top_k=(lambda value: value >= 0, "must be 0 (no demo) or more"),
    )
    if data_args.text_sample_by is None:
        data_args.text_sample_by = "line" if data_args.line_by_line else "document"
    if data_args.line_by_line and data_args.streaming and not data_args.packed_data_dir:
        raise UsageError(
            "--line_by_line cannot be combined with --streaming alone, which groups the texts into full blocks while "
            "training; add --packed_data_dir to pack the stream's lines once, or drop --line_by_line"
        )
    check_common_arguments(model_args, data_args, training_args)


# Copied from run_clm_flax.check_common_arguments
def check_common_arguments(model_args, data_args, training_args):
    """The checks of check_arguments that both training scripts make."""
    training_args.report_to = trackers_to_report(training_args.report_to)
    if not (training_args.do_train or training_args.do_eval or data_args.packed_data_dir):
        # As the Hugging Face Flax examples do: train (given training data) and evaluate.
        training_args.do_train = data_args.train_file is not None or data_args.dataset_name is not None
        training_args.do_eval = True
    has_data = data_args.dataset_name is not None or data_args.train_file is not None
    if not has_data and data_args.validation_file is None and not data_args.packed_data_dir:
        raise UsageError("no data: pass --train_file (and optionally --validation_file) or --dataset_name")
    if training_args.do_train and not has_data and not data_args.packed_data_dir:
        raise UsageError("--do_train needs --train_file or --dataset_name")
    if data_args.text_sample_by not in ("document", "paragraph", "line"):  # a JSON file of arguments skips argparse
        raise UsageError(f"--text_sample_by {data_args.text_sample_by} is not one of document, paragraph, line")
    if not data_args.keep_linebreaks and data_args.text_sample_by != "line":
        raise UsageError(
            f"--keep_linebreaks False applies to --text_sample_by line only; with --text_sample_by "
            f"{data_args.text_sample_by} the text is read as written, line breaks included"
        )
    if training_args.do_train and training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise UsageError("no training steps: set --num_train_epochs or --max_steps to a positive number")
    if training_args.resume_from_checkpoint and not training_args.do_train:
        raise UsageError("--resume_from_checkpoint continues training; add --do_train")
    streaming_training = data_args.streaming and not data_args.packed_data_dir
    if streaming_training and training_args.do_train and training_args.max_steps <= 0:
        raise UsageError(
            "--streaming needs --max_steps: the length of a stream is unknown, so --num_train_epochs cannot be "
            "turned into steps (or add --packed_data_dir to pack the stream once and train on the shards)"
        )
    if streaming_training and data_args.max_train_samples is not None:
        raise UsageError(
            "--max_train_samples does not apply to --streaming, where data repeats without end; limit the run with "
            "--max_steps"
        )
    if not (model_args.tokenizer_name or model_args.model_name_or_path):
        raise UsageError("training from scratch needs --tokenizer_name; make one with train_tokenizer.py")
    # A jax.checkpoint_policies name, or true or false as for the Hugging Face flag, a boolean.
    policy = model_args.gradient_checkpointing
    policy = {"true": "nothing_saveable", "false": None}.get(str(policy).lower(), policy)
    if policy not in (None, "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        raise UsageError(
            f"--gradient_checkpointing {policy} is not a policy: give none (or true) to keep nothing, or "
            "dots_saveable or dots_with_no_batch_dims_saveable"
        )
    model_args.gradient_checkpointing = policy
    if model_args.dtype == "float16" and jax.default_backend() == "cpu":
        raise UsageError(
            "--dtype float16 does not run on CPU, where XLA cannot multiply float16 matrices into float32 "
            "results; use --dtype bfloat16 or float32 here, and float16 on a GPU"
        )
    create_mesh(training_args.mesh_shape)  # refuses a --mesh_shape that does not fit the devices
    check_writable_directory(training_args.output_dir, "output_dir")


# Copied from run_clm_flax.check_numeric_arguments
def check_numeric_arguments(argument_groups, **script_ranges):
    """Refuse numbers outside the range where they mean anything. `script_ranges` adds a script's own arguments:
    name=(the test its value must pass, what the message asks for)."""
    at_least_1 = (lambda value: value >= 1, "must be at least 1")
    at_least_0 = (lambda value: value >= 0, "must be 0 or more")
    ranges = {
        "per_device_train_batch_size": at_least_1,
        "per_device_eval_batch_size": at_least_1,
        "gradient_accumulation_steps": at_least_1,
        "logging_steps": at_least_1,
        "save_steps": at_least_1,
        "save_total_limit": at_least_1,
        "eval_steps": (lambda value: value is None or value >= 1, "must be at least 1"),
        "learning_rate": (lambda value: value > 0, "must be positive, such as 3e-4"),
        "weight_decay": at_least_0,
        "adam_beta1": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.9"),
        "adam_beta2": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.999"),
        "adam_epsilon": (lambda value: value >= 0, "must be 0 or more, such as 1e-8"),
        "max_grad_norm": (lambda value: value >= 0, "must be 0 (no clipping) or more"),
        "num_train_epochs": at_least_0,
        "max_steps": (lambda value: value >= -1, "must be positive, or -1 to train for --num_train_epochs"),
        "warmup_steps": at_least_0,
        "warmup_ratio": (lambda value: 0 <= value < 1, "must be in [0, 1)"),
        "seed": at_least_0,
        "max_train_samples": (lambda value: value is None or value >= 1, "must be at least 1; leave it out for all"),
        "max_eval_samples": (lambda value: value is None or value >= 1, "must be at least 1; leave it out for all"),
        "preprocessing_num_workers": (lambda value: value is None or value >= 1, "must be at least 1"),
        "validation_split_percentage": (lambda value: 0 < value < 100, "must be between 1 and 99"),
        "shuffle_buffer_size": (lambda value: value >= 0, "must be 0 (the stream's order) or more"),
        "packed_tokens_per_shard": at_least_1,
        **script_ranges,
    }
    for name, (in_range, requirement) in ranges.items():
        value = next(getattr(group, name) for group in argument_groups if hasattr(group, name))
        if not in_range(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise UsageError(f"--{name} {value} {requirement}")


# Copied from run_clm_flax.check_distributed_arguments
def check_distributed_arguments(distributed_args):
    """The distributed flags, checked by initialize_distributed before the processes join."""
    explicit = [distributed_args.coordinator_address, distributed_args.num_processes, distributed_args.process_id]
    if any(value is not None for value in explicit) and any(value is None for value in explicit):
        raise UsageError(
            "--coordinator_address, --num_processes and --process_id go together: pass all three, or none where "
            "Slurm, Open MPI or Cloud TPU supplies them"
        )
    address, num_processes, process_id = explicit
    if address is not None and (num_processes < 1 or not 0 <= process_id < num_processes):
        raise UsageError(
            f"--process_id {process_id} is not in 0..{num_processes - 1}; number the processes 0 to "
            "--num_processes - 1"
        )
    if address is not None and ":" not in address:
        raise UsageError(f"--coordinator_address {address} has no port; give HOST:PORT")
    device_ids = distributed_args.local_device_ids
    if device_ids is not None and not all(part.strip().isdigit() for part in device_ids.split(",")):
        raise UsageError(f"--local_device_ids {device_ids} is not a comma-separated list of integers")


# Copied from run_clm_flax.check_writable_directory
def check_writable_directory(path: str, flag: str):
    """Refuse a directory that cannot be created or written into, before any work rather than at the first save."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--{flag} {path}: {existing} is a file; pass a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise UsageError(
            f"--{flag} {path} cannot be written ({error.strerror} in {existing}); pass a directory you can write to"
        ) from None


# Copied from run_clm_flax.user_error_message
def user_error_message(error: Exception) -> str | None:
    """The line the command prints for an error the user can fix: a UsageError, or a library's error for a hub it
    cannot reach or a file it cannot read. None for any other error, a bug, which keeps its traceback."""
    first_line = str(error).strip().split("\n")[0]
    if isinstance(error, UsageError):
        return str(error)
    if isinstance(error, ConnectionError) and error.errno is None:  # datasets and huggingface_hub, not a socket
        return (
            f"{first_line}; without a network (or with HF_HUB_OFFLINE=1) only what is in the cache can be loaded: "
            "pass local files or directories, or run once online"
        )
    if isinstance(error, datasets.exceptions.DatasetNotFoundError):
        return f"{first_line}; check --dataset_name"
    if isinstance(error, SafetensorError):
        return f"a safetensors file cannot be read ({first_line}); save it again"
    return None


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
        raise UsageError(
            "the config makes RoBERTa a decoder (is_decoder or add_cross_attention); "
            "masked language modelling needs an encoder, so set both to false"
        )
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise UsageError(
            f"position_embedding_type {position_embedding_type!r} in the config is not supported; only 'absolute' is"
        )
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATIONS:
        raise UsageError(
            f"hidden_act {config.hidden_act!r} in the config is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(
            f"hidden_size {config.hidden_size} in the config is not a multiple of "
            f"num_attention_heads {config.num_attention_heads}"
        )
    if config.pad_token_id is None:
        raise UsageError("the config has no pad_token_id; RoBERTa needs one to number the positions")
    if not config.tie_word_embeddings:
        raise UsageError(
            "tie_word_embeddings is false in the config; this model always shares the "
            "output projection with the word embeddings"
        )


class RobertaModule(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them."""

    config: transformers.RobertaConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each layer in the backward pass

    def dense(self, features, kernel_axes, bias_axes, name):
        kernel_init = nn.initializers.normal(self.config.initializer_range)
        return nn.Dense(
            features,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            kernel_init=nn.with_logical_partitioning(kernel_init, kernel_axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes),
        )

    def layer_norm(self, name):
        return nn.LayerNorm(
            epsilon=self.config.layer_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        )

    def embed(self, num_embeddings, axes, padding_idx=None):
        def init(key, shape, dtype):
            # The padding row starts at zero, as in PyTorch's nn.Embedding(padding_idx=...).
            table = nn.initializers.normal(self.config.initializer_range)(key, shape, dtype)
            return table if padding_idx is None else table.at[padding_idx].set(0)

        return nn.Embed(
            num_embeddings,
            self.config.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.with_logical_partitioning(init, axes),
        )

    def child(self, module_class, name):
        return module_class(self.config, self.dtype, self.param_dtype, self.remat_policy, name=name)


class RobertaEmbeddings(RobertaModule):
    """Word + position + token type embeddings (every token of type 0), then LayerNorm and dropout."""

    def setup(self):
        config = self.config
        self.word_embeddings = self.embed(config.vocab_size, ("vocab", "embed"), config.pad_token_id)
        self.position_embeddings = self.embed(
            config.max_position_embeddings, ("positions", "embed"), config.pad_token_id
        )
        self.token_type_embeddings = self.embed(config.type_vocab_size, (None, "embed"))
        self.LayerNorm = self.layer_norm("LayerNorm")
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def __call__(self, input_ids, deterministic):
        # RoBERTa (after fairseq) numbers real tokens pad+1, pad+2, ... and gives padding the position
        # pad itself, so a sequence of length L needs max_position_embeddings >= L + pad + 1.
        pad = self.config.pad_token_id
        is_token = (input_ids != pad).astype(jnp.int32)
        position_ids = jnp.cumsum(is_token, axis=1) * is_token + pad
        token_type_ids = jnp.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )  # (batch, seq, hidden)
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)


# Copied from run_clm_flax.attention_implementation
def attention_implementation(dtype) -> str | None:
    """cuDNN's fused (flash) attention on NVIDIA GPUs in half precision, XLA's attention elsewhere.

    jax.nn.dot_product_attention does not choose cuDNN by itself, and cuDNN has no float32 kernel.
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


def attention_with_dropout(query, key, value, mask, dropout: nn.Dropout):
    """Attention written out, for training with dropout on the attention probabilities."""
    # query, key, value: (batch, seq, heads, head_dim); mask: (batch, 1, 1, seq) bool or None
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
            # jax.nn.dot_product_attention has no dropout on the attention probabilities, which RoBERTa trains with.
            dropout = nn.Dropout(config.attention_probs_dropout_prob, deterministic=False)
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
        return self.child(RobertaResidualOutput, "output")(
            attended, hidden_states, deterministic, kernel_axes=("heads", "embed")
        )


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
            layer = nn.remat(
                RobertaLayer, policy=getattr(jax.checkpoint_policies, self.remat_policy), static_argnums=(3,)
            )
        for i in range(self.config.num_hidden_layers):
            hidden_states = self.child(layer, f"layer_{i}")(hidden_states, mask, deterministic)
        return hidden_states


class RobertaModel(RobertaModule):
    """Embeddings and encoder, without a head: returns hidden states (batch, seq, hidden)."""

    def setup(self):
        self.embeddings = self.child(RobertaEmbeddings, "embeddings")
        self.encoder = self.child(RobertaEncoder, "encoder")

    def __call__(self, input_ids, attention_mask, deterministic):
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].astype(bool)  # (batch, 1, 1, seq): True = may attend
        x = self.embeddings(input_ids, deterministic)
        return self.encoder(x, mask, deterministic)


class RobertaLMHead(RobertaModule):
    """Dense + GELU + LayerNorm, then scores against the (shared) word embeddings plus a bias."""

    @nn.compact
    def __call__(self, hidden_states, word_embeddings):
        x = self.dense(self.config.hidden_size, ("embed", None), ("embed",), "dense")(hidden_states)
        x = self.layer_norm("layer_norm")(ACTIVATIONS["gelu"](x))
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
            (self.config.vocab_size,),
            self.param_dtype,
        )
        # Accumulate in float32 so that bfloat16 compute still gives float32 logits for the loss.
        logits = jnp.einsum("bsh,vh->bsv", x, word_embeddings.astype(self.dtype), preferred_element_type=jnp.float32)
        return logits + bias.astype(jnp.float32)  # (batch, seq, vocab)


class FlaxRobertaForMaskedLM(RobertaModule):
    """RoBERTa encoder with its masked-language-modelling head; returns float32 logits (batch, seq, vocab),
    or (batch, predictions, vocab) at `masked_positions` only."""

    def setup(self):
        check_model_config(self.config)
        self.roberta = self.child(RobertaModel, "roberta")
        self.lm_head = self.child(RobertaLMHead, "lm_head")

    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True, masked_positions=None):
        hidden_states = self.roberta(input_ids, attention_mask, deterministic)
        if masked_positions is not None:
            # masked_positions: (batch, predictions) int. Training predicts about 15% of the tokens, so running
            # the head (whose vocabulary projection is the largest matmul of a small model) only there saves
            # most of its work.
            rows = jnp.arange(hidden_states.shape[0])[:, None]
            hidden_states = hidden_states[rows, masked_positions]  # (batch, predictions, hidden)
        # The output projection is the word embedding table itself (tied weights, as in RoBERTa).
        word_embeddings = self.roberta.embeddings.word_embeddings.embedding  # (vocab, hidden)
        return self.lm_head(hidden_states, word_embeddings)


# Tensors a RobertaForMaskedLM checkpoint may hold that this model does not need: the decoder weight and
# bias are tied to the word embeddings and lm_head.bias (save_pretrained leaves them out), the pooler
# belongs to RobertaModel, and older checkpoints saved the constant position_ids/token_type_ids buffers.
IGNORED_HF_TENSORS = (
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
    "roberta.embeddings.position_ids",
    "roberta.embeddings.token_type_ids",
)


IGNORED_HF_PREFIXES = ("roberta.pooler.",)


def hf_name(path: tuple) -> str:
    """('roberta', 'encoder', 'layer_3', 'intermediate', 'dense', 'kernel') -> PyTorch's name for it:
    'roberta.encoder.layer.3.intermediate.dense.weight'."""
    *modules, leaf = path
    # "layer_3" is the Flax name of PyTorch's "layer.3"; "layer_norm" stays as it is.
    modules = [f"layer.{m[6:]}" if m.startswith("layer_") and m[6:].isdigit() else m for m in modules]
    return ".".join([*modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch RobertaForMaskedLM state dict (float32 numpy, HF names and layouts).

    Dense kernels are (in, out) in Flax and (out, in) in PyTorch, so they are transposed. The tied
    lm_head.decoder tensors are left out, as save_pretrained does.
    """
    state_dict = {}
    for path, value in traverse_util.flatten_dict(params).items():
        value = np.asarray(value, dtype=np.float32)
        state_dict[hf_name(path)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
    return state_dict


def from_hf_state_dict(state_dict, config):
    """The inverse of to_hf_state_dict for a model of `config`.

    Accepts checkpoints with or without the tied lm_head.decoder tensors and the pooler. Raises
    UsageError naming the first tensor that is missing, unexpected or of the wrong shape for `config`.
    """
    model = FlaxRobertaForMaskedLM(config)
    expected = traverse_util.flatten_dict(abstract_model_params(model, jnp.zeros((1, 1), jnp.int32)))
    flat_params = {}
    for path, abstract in expected.items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"checkpoint has no tensor {name}; is it a RobertaForMaskedLM checkpoint?")
        array = np.asarray(state_dict[name], dtype=np.float32)
        is_kernel = path[-1] == "kernel"
        needed_shape = abstract.shape[::-1] if is_kernel else abstract.shape  # in the PyTorch layout
        if array.shape != needed_shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {array.shape} but the config needs "
                f"{needed_shape}; pass the matching --config_name"
            )
        flat_params[path] = np.ascontiguousarray(array.T if is_kernel else array)
    used_names = {hf_name(path) for path in expected}
    for name in state_dict:
        if name not in used_names and name not in IGNORED_HF_TENSORS and not name.startswith(IGNORED_HF_PREFIXES):
            raise UsageError(
                f"checkpoint tensor {name} is not part of RobertaForMaskedLM with this config; "
                "pass the matching --config_name"
            )
    return traverse_util.unflatten_dict(flat_params)


# Copied from run_clm_flax.read_safetensors_checkpoint
def read_safetensors_checkpoint(name_or_path: str, model_args) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors (or its shards) from a local directory or the hub."""
    import huggingface_hub

    def fetch(filename):
        """The file's local path, or None where there is no such file."""
        if os.path.isdir(name_or_path):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
        try:
            return huggingface_hub.hf_hub_download(
                name_or_path, filename, cache_dir=model_args.cache_dir, token=model_args.token
            )
        except huggingface_hub.errors.EntryNotFoundError:
            return None
        except (huggingface_hub.errors.HfHubHTTPError, OSError, ValueError) as error:
            raise UsageError(f"cannot download {filename} of {name_or_path}: {error}") from None

    def read(path):
        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            reason = str(error).splitlines()[0]
            raise UsageError(f"{path} is not a readable safetensors file ({reason}); save it again") from None

    index_name = "model.safetensors.index.json"
    if (index_path := fetch(index_name)) is not None:
        try:
            with open(index_path) as index_file:
                shard_names = sorted(set(json.load(index_file)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{index_path} is not a safetensors index (JSON with a weight_map)") from None
        state_dict = {}
        for shard_name in shard_names:
            if (shard_path := fetch(shard_name)) is None:
                raise UsageError(f"{name_or_path} has no {shard_name}, a shard its {index_name} names")
            state_dict.update(read(shard_path))
        return state_dict
    if (path := fetch("model.safetensors")) is not None:
        return read(path)
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


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
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


# Copied from run_clm_flax.TrainState
class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


# What the train step sums over masked tokens, and the metrics shown from those sums.
TRAIN_METRIC_SUMS = ("loss_sum", "correct_sum", "weight_sum")


def train_metrics(sums: dict) -> dict:
    """The training metrics of a log line and of train_results.json, from the sums over the steps it covers."""
    masked_tokens = max(sums["weight_sum"], 1.0)
    return {"loss": sums["loss_sum"] / masked_tokens, "accuracy": sums["correct_sum"] / masked_tokens}


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


# Copied from run_clm_flax.apply_finite_update
def apply_finite_update(state: TrainState, grads, loss_sum, optimizer) -> tuple[TrainState, dict]:
    """`state` one step on, with the update of `grads` applied if it is finite; and the gradient norm and
    whether the update was finite, as metrics."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
    # A non-finite update is never applied: the step counter moves on, the weights stay as they were.
    params, opt_state = jax.tree_util.tree_map(
        lambda new, old: jnp.where(finite, new, old),
        (optax.apply_updates(state.params, updates), opt_state),
        (state.params, state.opt_state),
    )
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {"grad_norm": grad_norm, "finite": finite}


# Copied from run_clm_flax.accumulate_gradients
def accumulate_gradients(loss_and_sums, params, batch, step_rng):
    """Gradients of the loss summed over the micro-batches of `batch` (every array is (gradient_accumulation_steps,
    micro_batch, ...)), and the metric sums summed too: `loss_and_sums(params, micro_batch, dropout_rng)` gives one
    micro-batch's summed loss and its TRAIN_METRIC_SUMS."""
    gradients = jax.value_and_grad(loss_and_sums, has_aux=True)
    num_micro_batches = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if num_micro_batches == 1:
        (_, sums), grads = gradients(params, jax.tree_util.tree_map(lambda values: values[0], batch), step_rng)
        return grads, sums

    def accumulate(totals, index):
        micro_batch = jax.tree_util.tree_map(lambda values: values[index], batch)
        (_, sums), grads = gradients(params, micro_batch, jax.random.fold_in(step_rng, index))
        return jax.tree_util.tree_map(jnp.add, totals, (grads, sums)), None

    # Summed in float32 whatever the parameters' dtype: in bfloat16, small contributions would round away.
    zeros = (
        jax.tree_util.tree_map(lambda param: jnp.zeros_like(param, dtype=jnp.float32), params),
        dict.fromkeys(TRAIN_METRIC_SUMS, jnp.float32(0)),
    )
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, jnp.arange(num_micro_batches))
    return grads, sums


def make_train_step(model, optimizer, schedule, seed: int):
    dropout_key = jax.random.key(seed + 1)

    def loss_and_sums(params, micro_batch, dropout_rng):
        logits = model.apply(
            {"params": params},
            micro_batch["input_ids"],
            micro_batch["attention_mask"],
            deterministic=False,
            masked_positions=micro_batch["masked_positions"],
            rngs={"dropout": dropout_rng},
        )
        loss_sum, correct_sum, weight_sum = masked_lm_loss_sums(
            logits, micro_batch["masked_labels"], micro_batch["masked_weights"]
        )
        return loss_sum, {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    def train_step(state: TrainState, batch):
        # Dropout randomness depends only on the step, so a resumed run draws the same masks.
        step_rng = jax.random.fold_in(dropout_key, state.step)
        grads, sums = accumulate_gradients(loss_and_sums, state.params, batch, step_rng)
        # The mean over every masked token of the whole batch, however it was split into micro-batches (a batch
        # with none leaves the gradients at 0), in the parameters' dtype: the float32 count would otherwise turn
        # bfloat16 gradients, and with them the optimizer state, into float32.
        grads = jax.tree_util.tree_map(
            lambda grad, param: (grad / jnp.maximum(sums["weight_sum"], 1.0)).astype(param.dtype), grads, state.params
        )
        new_state, update_metrics = apply_finite_update(state, grads, sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


# Copied from run_clm_flax.train_step_compiler_options
def train_step_compiler_options() -> dict:
    """XLA options for compiling the train step. On CPU, XLA's default scheduler orders the work for
    concurrency and so keeps alive the activations that gradient checkpointing means to free (GPT-2 124M,
    2 x 1024 tokens, remat nothing_saveable: 7.5 GiB of temporaries either way); its memory-optimised
    scheduler frees them (2.7 GiB), at no measured cost in speed."""
    if jax.default_backend() == "cpu":
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return {}


def make_eval_step(model):
    def eval_step(params, batch):
        logits = model.apply(
            {"params": params}, batch["input_ids"], batch["attention_mask"], masked_positions=batch["masked_positions"]
        )
        loss_sum, correct_sum, weight_sum = masked_lm_loss_sums(
            logits, batch["masked_labels"], batch["masked_weights"]
        )
        return {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    return eval_step


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
# Filling masks: what the model predicts for a text with <mask> in it
# ----------------------------------------------------------------------------------------------------


def example_texts(examples, tokenizer, count: int) -> Iterator[str]:
    """The texts of the first `count` examples, decoded: each line, or each piece of a block between the
    </s> that end its texts."""
    for index in range(min(count, len(examples))):
        block = np.asarray(examples[index])
        for piece in np.split(block, np.flatnonzero(block == tokenizer.eos_token_id) + 1):
            yield tokenizer.decode(piece, skip_special_tokens=True)


def fill_mask_demo_text(texts, mask_token: str) -> tuple[str | None, str | None]:
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
# Data: load texts, tokenize into blocks or lines, batch and mask
# ----------------------------------------------------------------------------------------------------

# Grouped mode: the texts, each followed by </s>, joined and cut into blocks of max_seq_length - 2 tokens;
# BatchMaker frames every block as <s> block </s>. RoBERTa's pretraining data is made the same way: full
# sentences across document boundaries, with a separator between documents.


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


# Copied from run_clm_flax.load_text_datasets
def load_text_datasets(model_args, data_args, streaming: bool = False, evaluation_only: bool = False) -> dict:
    """The train and validation splits the data arguments name, as they are (no validation split is held out
    here): `datasets.Dataset`s, or with `streaming` `datasets.IterableDataset`s that read the files (or the hub) as
    they are iterated. Each row is one document. Each split's files are read with the builder of their own format.
    With `evaluation_only`, the validation split alone when there is one: the training files are not even read."""
    text_options = {"sample_by": data_args.text_sample_by, "keep_linebreaks": data_args.keep_linebreaks}
    try:
        if data_args.dataset_name is not None:
            name = data_args.dataset_name
            if os.path.isdir(name) and any(
                os.path.exists(os.path.join(name, marker)) for marker in ("dataset_dict.json", "state.json")
            ):
                raw = datasets.load_from_disk(name)
                if streaming:
                    raw = {"train": raw} if isinstance(raw, datasets.Dataset) else raw
                    raw = {split: dataset.to_iterable_dataset() for split, dataset in raw.items()}
            else:
                holds_text_files = os.path.isdir(name) and any(
                    DATA_FILE_BUILDERS.get(os.path.splitext(file)[1].lower()) == "text"
                    for _, _, files in os.walk(name)
                    for file in files
                )
                raw = datasets.load_dataset(
                    name,
                    data_args.dataset_config_name,
                    cache_dir=model_args.cache_dir,
                    token=model_args.token,
                    streaming=streaming,
                    **(text_options if holds_text_files else {}),
                )
        else:
            raw = {}
            for split, flag in (("train", "train_file"), ("validation", "validation_file")):
                pattern = getattr(data_args, flag)
                if pattern is None or (split == "train" and evaluation_only and data_args.validation_file):
                    continue
                builder, files = resolve_data_files(pattern, flag)
                raw[split] = datasets.load_dataset(
                    builder,
                    data_files={split: files},
                    split=split,
                    cache_dir=model_args.cache_dir,
                    streaming=streaming,
                    **(text_options if builder == "text" else {}),
                )
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise UsageError(f"cannot load the dataset: {error}") from None
    except ConnectionError as error:
        raise UsageError(
            f"cannot load --dataset_name {data_args.dataset_name}: {error}; it is not in the cache (--cache_dir), "
            "so load it once online, or pass local files with --train_file"
        ) from None
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, ValueError) as error:
        if str(error).startswith(("BuilderConfig", "Config name is missing")):  # raised before any file is read
            raise UsageError(
                f"cannot load --dataset_name {data_args.dataset_name} with --dataset_config_name "
                f"{data_args.dataset_config_name}: {' '.join(str(error).splitlines()[:2])}; pass one of those "
                "configurations with --dataset_config_name"
            ) from None
        cause = error.__cause__ or error
        raise UsageError(
            f"cannot read the data files ({type(cause).__name__}: {cause}); check their format and encoding"
        ) from None
    if isinstance(raw, (datasets.Dataset, datasets.IterableDataset)):
        raw = {"train": raw}
    used = ("validation",) if evaluation_only and "validation" in raw else ("train", "validation")
    raw = {split: dataset for split, dataset in raw.items() if split in used}
    for split, dataset in raw.items():
        columns = dataset.column_names  # None for a stream whose columns are only known once read
        if columns is not None and data_args.text_column_name not in columns:
            raise UsageError(
                f"the {split} data has no column '{data_args.text_column_name}' (it has: {', '.join(columns)}); "
                "pass --text_column_name"
            )
    warn_of_files_in_both_splits(data_args)
    return {split: rows_with_text(dataset, split, data_args) for split, dataset in raw.items()}


# Copied from run_clm_flax.warn_of_files_in_both_splits
def warn_of_files_in_both_splits(data_args):
    if data_args.train_file is None or data_args.validation_file is None:
        return
    train_files, validation_files = (
        {os.path.realpath(path) for path in (glob.glob(pattern) if glob.has_magic(pattern) else [pattern])}
        for pattern in (data_args.train_file, data_args.validation_file)
    )
    if shared := sorted(train_files & validation_files):
        logger.warning(
            "--train_file and --validation_file share %s: the evaluation measures how well the model remembers its "
            "training texts, not how it does on new text",
            ", ".join(shared),
        )


# Copied from run_clm_flax.text_source
def text_source(split: str, data_args) -> str:
    """Where the texts of a split come from, as the user named them, for messages about a row."""
    pattern = {"train": data_args.train_file, "validation": data_args.validation_file}.get(split)
    if pattern is None:
        return f"the {split} split of --dataset_name {data_args.dataset_name}"
    if glob.has_magic(pattern):
        return f"the files of {pattern} (counted through them in sorted order)"
    return pattern


# Copied from run_clm_flax.rows_with_text
def rows_with_text(dataset, split: str, data_args):
    """The dataset without rows whose text is missing or null: such a row is refused in one line naming its file
    and row, or with --skip_missing_texts left out and counted in the log. A column of other values than strings
    is refused. A stream is checked lazily, batch by batch as it is read."""
    column, skip = data_args.text_column_name, data_args.skip_missing_texts

    def not_text(type_name: str) -> UsageError:
        return UsageError(
            f"column '{column}' of {text_source(split, data_args)} holds {type_name} values, not text; "
            "pass the column of texts with --text_column_name"
        )

    def missing_text(row: int) -> UsageError:
        return UsageError(
            f"row {row + 1} of {text_source(split, data_args)} has no text (its '{column}' is missing or null); "
            "fix the data, or pass --skip_missing_texts to leave such rows out"
        )

    if isinstance(dataset, datasets.IterableDataset):

        def keep(batch, rows):
            if column not in batch:  # token_arrays names the missing column
                return [True] * len(rows)
            kept = []
            for text, row in zip(batch[column], rows):
                if text is not None and not isinstance(text, str):
                    raise not_text(type(text).__name__)
                if text is None and not skip:
                    raise missing_text(row)
                kept.append(text is not None)
            if not all(kept):
                logger.warning(
                    "%s: left out %d rows without text, the first at row %d of %s",
                    split,
                    kept.count(False),
                    rows[kept.index(False)] + 1,
                    text_source(split, data_args),
                )
            return kept

        return dataset.filter(keep, with_indices=True, batched=True, batch_size=TEXTS_PER_BATCH)
    column_type = dataset.features[column]
    if getattr(column_type, "dtype", None) not in ("string", "large_string", "string_view", "null"):
        raise not_text(getattr(column_type, "dtype", type(column_type).__name__))
    texts = dataset.data.column(column)
    if texts.null_count == 0:
        return dataset
    missing = texts.is_null().to_numpy(zero_copy_only=False)
    if not skip:
        raise missing_text(int(np.argmax(missing)))
    logger.warning(
        "%s: left out %d of %d rows without text, the first at row %d of %s",
        split,
        int(missing.sum()),
        len(dataset),
        int(np.argmax(missing)) + 1,
        text_source(split, data_args),
    )
    # Kept in memory (an index of the kept rows): written beside the dataset, it would land in a directory of
    # save_to_disk that is the user's.
    return dataset.filter(
        lambda texts: [text is not None for text in texts],
        input_columns=column,
        batched=True,
        keep_in_memory=True,
        desc=f"Leaving out {split} rows without text",
    )


# Copied from run_clm_flax.check_tokenizer_encodes
def check_tokenizer_encodes(tokenizer, text_datasets: dict, text_column: str):
    """Refuse a tokenizer that turns the first texts of the data into nothing, or into unknown tokens only: a model
    trained on that learns nothing of the texts while its loss looks like training."""
    for split, dataset in text_datasets.items():
        try:
            first_texts = next(dataset.iter(batch_size=100), {}).get(text_column, [])
        except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError):
            continue  # text_batches reports an unreadable stream
        # The start of each text is enough, and a .txt file read as one document may be gigabytes long.
        texts = [text[:10_000] for text in first_texts if text and not text.isspace()]
        if not texts:
            continue
        ids = [
            token
            for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            for token in encoding.ids
        ]
        if not ids or set(ids) == {tokenizer.unk_token_id}:
            outcome = "no tokens" if not ids else f"only the unknown token {tokenizer.unk_token}"
            raise UsageError(
                f"the tokenizer {tokenizer.name_or_path} cannot encode the {split} data: its first {len(texts)} "
                f"texts give {outcome}; pass a tokenizer trained on such text (train_tokenizer.py makes one)"
            )


# Copied from run_clm_flax.hold_out_blocks
def hold_out_blocks(blocks: dict, validation_split_percentage: int) -> dict:
    """{split: examples} with a validation split: without one, the first validation_split_percentage percent of the
    training examples (blocks: by blocks rather than texts, so that a corpus of one long document can be split too).
    The one rule of every data route (files, datasets, --packed_data_dir)."""
    if "train" not in blocks or "validation" in blocks:
        return blocks
    train = blocks["train"]
    if len(train) < 2:
        raise UsageError("the training data makes fewer than 2 examples; there is nothing to hold out for evaluation")
    validation_size = max(1, len(train) * validation_split_percentage // 100)
    return {"validation": train[:validation_size], "train": train[validation_size:]}


# Copied from run_clm_flax.TEXTS_PER_BATCH
TEXTS_PER_BATCH = 1000


# A long text (a .txt file read as one document) is encoded in pieces of about this many characters, this many
# pieces at a time: encoding holds ~300 bytes of memory per token until it returns, and one text uses one core.
# Copied from run_clm_flax.TEXT_PIECE_CHARACTERS
TEXT_PIECE_CHARACTERS = 2**18


# Copied from run_clm_flax.TEXT_PIECES_AT_ONCE
TEXT_PIECES_AT_ONCE = 16


# Where a line that ends in a visible character is followed by one that starts with one.
# Copied from run_clm_flax.LINE_START
LINE_START = re.compile(r"(?<=\S\n)(?=\S)")


# Copied from run_clm_flax.cuts_at_line_starts_keep_the_tokens
def cuts_at_line_starts_keep_the_tokens(backend) -> bool:
    """Whether encoding a text in pieces cut at LINE_START gives the tokens of the whole text: so for the
    byte-level pre-tokenizer of GPT-2 and RoBERTa (no piece it makes spans such a line break) with no
    normalizer and no prefix space; not assumed for any other tokenizer."""
    settings = json.loads(backend.to_str())
    pre_tokenizer = settings.get("pre_tokenizer") or {}
    return (
        settings.get("normalizer") is None
        and pre_tokenizer.get("type") == "ByteLevel"
        and pre_tokenizer.get("use_regex", True)
        and not pre_tokenizer.get("add_prefix_space", False)
    )


# Copied from run_clm_flax.encode_texts
def encode_texts(backend, texts: list[str], cut_long_texts: bool) -> list[list[int]]:
    """The token ids of each text, without special tokens; long texts in pieces when `cut_long_texts`."""
    if not cut_long_texts or all(len(text) <= TEXT_PIECE_CHARACTERS for text in texts):
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    token_lists = []
    for text in texts:
        starts = [0]
        while len(text) - starts[-1] > TEXT_PIECE_CHARACTERS:
            line_start = LINE_START.search(text, starts[-1] + TEXT_PIECE_CHARACTERS)
            if line_start is None:
                break
            starts.append(line_start.start())
        pieces = [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]
        ids = []
        for first in range(0, len(pieces), TEXT_PIECES_AT_ONCE):
            group = pieces[first : first + TEXT_PIECES_AT_ONCE]
            for encoding in backend.encode_batch(group, add_special_tokens=False):
                ids.extend(encoding.ids)
        token_lists.append(ids)
    return token_lists


# Copied from run_clm_flax.encode_documents
def encode_documents(backend, eos_id: int, cut_long_texts: bool, texts: list[str]) -> np.ndarray:
    """The tokens of the texts, each followed by eos_id, end to end: one flat int32 array."""
    token_lists = [ids + [eos_id] for ids in encode_texts(backend, texts, cut_long_texts)]
    return np.fromiter(itertools.chain.from_iterable(token_lists), np.int32, sum(map(len, token_lists)))


# Copied from run_clm_flax.text_batches
def text_batches(dataset, text_column: str, split: str) -> Iterator[list[str]]:
    """The texts of a dataset or a stream, TEXTS_PER_BATCH at a time, in order."""
    if isinstance(dataset, datasets.Dataset):
        dataset = dataset.select_columns(text_column)  # the other columns are not even read
    texts = dataset.iter(batch_size=TEXTS_PER_BATCH)
    while True:
        try:
            batch = next(texts)
        except StopIteration:
            return
        except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError) as error:
            cause = error.__cause__ or error
            raise UsageError(
                f"cannot read the {split} stream ({type(cause).__name__}: {cause}); check its format and encoding"
            ) from None
        if text_column not in batch:
            raise UsageError(
                f"the {split} data has no column '{text_column}' (it has: {', '.join(batch)}); pass --text_column_name"
            )
        yield batch[text_column]


# Copied from run_clm_flax.map_in_workers
def map_in_workers(function, items: Iterable, num_workers: int | None) -> Iterator:
    """function(item) for each item, in order: here, or with num_workers > 1 in that many worker processes, a few
    items per worker in flight. The workers are spawned, not forked: JAX's runtime is multithreaded, and a forked
    copy of it can deadlock."""
    if not num_workers or num_workers < 2:
        yield from map(function, items)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_workers, initializer=set_worker_function, initargs=(function,)) as pool:
        in_flight = collections.deque()
        for item in items:
            in_flight.append(pool.apply_async(call_worker_function, (item,)))
            if len(in_flight) > 2 * num_workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


# Copied from run_clm_flax.set_worker_function
def set_worker_function(function):
    """Runs once in each worker process: the function (the tokenizer with it) is sent once, not with every item."""
    global worker_function
    worker_function = function


# Copied from run_clm_flax.call_worker_function
def call_worker_function(item):
    return worker_function(item)


# Copied from run_clm_flax.token_arrays
def token_arrays(dataset, tokenizer, text_column, num_workers=None, split="train") -> Iterator[np.ndarray]:
    """The tokens of every text of `dataset` (a `datasets.Dataset` or a stream), each text (a document) followed by
    EOS, as flat int32 arrays of one batch of texts each, in the dataset's order, tokenized in `num_workers`
    processes. Only a few batches of tokens are in memory at a time."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UsageError("the tokenizer has no end-of-text token; set eos_token in its tokenizer_config.json")
    # The Rust tokenizer directly: the transformers wrapper would also build attention masks and warn
    # about texts longer than model_max_length, which is expected here since texts get packed.
    backend = tokenizer.backend_tokenizer
    encode = partial(encode_documents, backend, eos_id, cuts_at_line_starts_keep_the_tokens(backend))
    yield from map_in_workers(encode, text_batches(dataset, text_column, split), num_workers)


# Copied from run_clm_flax.pack_blocks
def pack_blocks(token_arrays: Iterable[np.ndarray], block_size: int) -> Iterator[np.ndarray]:
    """Join the token arrays end to end and cut them into blocks: arrays of shape (count, block_size), int32.

    The tail that does not fill a whole block is dropped (at most block_size - 1 tokens).
    """
    carry = np.zeros(0, np.int32)
    for tokens in token_arrays:
        if len(carry):
            tokens = np.concatenate([carry, tokens])
        usable = len(tokens) // block_size * block_size
        if usable:
            yield np.asarray(tokens[:usable], dtype=np.int32).reshape(-1, block_size)
        carry = np.array(tokens[usable:], dtype=np.int32)  # a copy, so the batch it came from can be freed


def tokenized_rows(dataset, split: str, tokenizer, block_size: int, data_args) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split: its texts, each followed by </s>, joined and cut into blocks;
    or with --line_by_line a row per line (encode_lines). The number of lines cut short is logged at the end."""
    column, num_workers = data_args.text_column_name, data_args.preprocessing_num_workers
    if not data_args.line_by_line:
        yield from pack_blocks(token_arrays(dataset, tokenizer, column, num_workers, split), block_size)
        return
    encode = partial(encode_lines, tokenizer.backend_tokenizer, block_size, tokenizer.pad_token_id)
    lines = truncated = 0
    for rows, rows_truncated in map_in_workers(encode, text_batches(dataset, column, split), num_workers):
        lines, truncated = lines + len(rows), truncated + rows_truncated
        yield rows
    logger.info("%s: %d of %d lines are longer than %d tokens and get truncated", split, truncated, lines, block_size)


def encode_lines(backend, width: int, pad_id: int, texts: list[str]) -> tuple[np.ndarray, int]:
    """A row of `width` tokens for every text that is not only whitespace, its line break at the end removed: its
    tokens cut to `width` and padded with pad_id, so that lines fit the fixed-width rows of a packed corpus; and the
    number of texts cut."""
    texts = [text.rstrip("\r\n") for text in texts if text and not text.isspace()]
    token_lists = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    rows = np.full((len(token_lists), width), pad_id, np.int32)
    for row, ids in zip(rows, token_lists):
        row[: len(ids)] = ids[:width]
    return rows, sum(len(ids) > width for ids in token_lists)


# Copied from run_clm_flax.pack_texts
def pack_texts(directory: str, texts: dict, tokenizer, block_size: int, description: dict, data_args) -> dict:
    """Tokenize every split of `texts` ({split: dataset or stream}) into rows (tokenized_rows) and write them as a
    packed corpus in `directory` (shards of --packed_tokens_per_shard tokens); returns its index. A few batches of
    texts and one shard are in memory at a time."""

    def rows_with_progress(split, dataset):
        with tqdm(desc=f"Packing {split} rows", unit=" rows", disable=None) as progress:
            for blocks in tokenized_rows(dataset, split, tokenizer, block_size, data_args):
                progress.update(len(blocks))
                yield blocks

    splits = {split: rows_with_progress(split, dataset) for split, dataset in texts.items()}
    return write_packed_corpus(
        directory, splits, description, packed_dtype(tokenizer), data_args.packed_tokens_per_shard
    )


# Copied from run_clm_flax.cached_blocks
def cached_blocks(dataset: datasets.Dataset, split: str, tokenizer, block_size: int, cache_dir: str, data_args):
    """The blocks of one split (PackedBlocks), from the packed corpus that caches them in `cache_dir` under a
    fingerprint of the texts, the tokenizer and the block size: packed there first when it is missing, damaged or
    --overwrite_cache is given. Written under a name of this process's own and renamed when complete, so that
    processes sharing the cache never read or write each other's unfinished files."""
    description = packed_description(
        tokenizer,
        block_size,
        data_args.framing,
        {"dataset_fingerprint": dataset._fingerprint, "text_column_name": data_args.text_column_name, "split": split},
    )
    directory = os.path.join(cache_dir, f"packed-{fingerprint([PACKED_FORMAT_VERSION, description])}")
    os.makedirs(cache_dir, exist_ok=True)
    remove_stale_temporary_files(cache_dir)
    index = None if data_args.overwrite_cache else read_packed_index(directory)
    if index is not None and (problem := packed_shards_problem(directory, index)):
        logger.warning("The packed cache %s is damaged (%s); packing it again", directory, problem)
        index = None
    if index is not None:
        logger.info("Loading packed %s blocks from cache %s", split, directory)
    else:
        temporary_directory = f"{directory}.{os.getpid()}.tmp"
        try:
            index = pack_texts(temporary_directory, {split: dataset}, tokenizer, block_size, description, data_args)
        except BaseException:
            shutil.rmtree(temporary_directory, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rename(temporary_directory, directory)
        except OSError:  # another process finished the same cache first
            shutil.rmtree(temporary_directory, ignore_errors=True)
    return open_packed_corpus(directory, index)[split]


# Copied from run_clm_flax.load_packed_corpus
def load_packed_corpus(model_args, data_args, tokenizer, block_size: int, length_argument: str) -> dict:
    """The blocks of --packed_data_dir, {split: PackedBlocks}: packed there first when it holds no finished
    corpus (or --overwrite_cache), by process 0 alone while the others wait, from the data arguments read as
    they are or, with --streaming, as a stream. A directory packed with another tokenizer, block size (set by
    `length_argument`, as the user gave it) or source is refused, never reused."""
    directory = data_args.packed_data_dir
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--packed_data_dir {directory} is a file; pass a directory")
    names = ("dataset_name", "dataset_config_name", "train_file", "validation_file", "text_column_name")
    source = {name: getattr(data_args, name) for name in (*names, "text_sample_by", "keep_linebreaks")}
    for name in ("train_file", "validation_file", "dataset_name"):  # the same files, from whichever directory
        if source[name] is not None and (name != "dataset_name" or os.path.isdir(source[name])):
            source[name] = os.path.abspath(source[name])
    description = packed_description(tokenizer, block_size, data_args.framing, source)
    has_source = any(getattr(data_args, name) for name in ("dataset_name", "train_file", "validation_file"))

    def check(index: dict):
        fix = f"use another --packed_data_dir, delete {directory}, or add --overwrite_cache to pack it again"
        if index["format_version"] != PACKED_FORMAT_VERSION:
            raise UsageError(
                f"--packed_data_dir {directory} holds a packed corpus of format version "
                f"{index['format_version']}; {fix}"
            )
        if index["block_size"] != block_size:
            raise UsageError(
                f"--packed_data_dir {directory} holds blocks of {index['block_size']} tokens, not the {block_size} "
                f"of {length_argument}; {fix}"
            )
        if index["tokenizer_fingerprint"] != description["tokenizer_fingerprint"]:
            raise UsageError(f"--packed_data_dir {directory} was packed with another tokenizer; {fix}")
        if (framing := index.get("framing", "grouped")) != data_args.framing:  # corpora before lines were grouped
            raise UsageError(
                f"--packed_data_dir {directory} holds {framing} rows, not {data_args.framing} ones; {fix}"
            )
        if problem := packed_shards_problem(directory, index):
            raise UsageError(f"--packed_data_dir {directory} is damaged: {problem}; {fix}")
        differences = [name for name in source if index["source"].get(name) != source[name]]
        if has_source and differences:
            recorded = ", ".join(f"--{name} {index['source'].get(name)}" for name in differences)
            raise UsageError(
                f"--packed_data_dir {directory} was packed from other data ({recorded}); pass the same data "
                f"arguments, or none to train on it as it is, or {fix}"
            )

    # Read even with --overwrite_cache: never overwrite a directory of other files.
    index = read_packed_index(directory)
    if data_args.overwrite_cache:
        index = None
    if index is not None:
        check(index)
    elif not has_source:
        raise UsageError(
            f"--packed_data_dir {directory} holds no finished packed corpus; pass --train_file or --dataset_name "
            "to pack one"
        )
    # Process 0 packs while the others wait. It reaches the barrier even when packing fails, so that the others
    # stop with an error rather than wait for it until the distributed runtime gives up.
    with main_process_first("packed corpus written"):
        if jax.process_index() == 0 and index is None:
            check_writable_directory(directory, "packed_data_dir")
            texts = load_text_datasets(model_args, data_args, streaming=data_args.streaming)
            check_tokenizer_encodes(tokenizer, texts, data_args.text_column_name)
            logger.info("Packing %s into %s", " and ".join(texts), directory)
            index = pack_texts(directory, texts, tokenizer, block_size, description, data_args)
    if jax.process_count() > 1:
        index = read_packed_index(directory)
        if index is None:
            raise UsageError(
                f"process {jax.process_index()} finds no packed corpus in --packed_data_dir {directory}: process 0 "
                "failed to pack it (see its error), or the directory is not on a filesystem every process shares"
            )
        check(index)
    return open_packed_corpus(directory, index)


# Copied from run_clm_flax.stream_share
def stream_share(dataset: datasets.IterableDataset) -> datasets.IterableDataset:
    """This process's share of a stream: whole files (shards) when their number is a multiple of the process
    count, otherwise every process_count-th text. The shares are disjoint and together cover the stream."""
    if jax.process_count() == 1:
        return dataset
    return datasets.distributed.split_dataset_by_node(
        dataset, rank=jax.process_index(), world_size=jax.process_count()
    )


# Copied from run_clm_flax.streaming_train_batches
def streaming_train_batches(
    dataset: datasets.IterableDataset,
    tokenizer,
    text_column: str,
    block_size: int,
    global_batch_size: int,
    seed: int,
    shuffle_buffer_size: int,
    first_batch: int = 0,
) -> Iterator[dict]:
    """This process's rows of each global batch, tokenized and packed on the fly from its share of the
    stream, without end: pass after pass over the share, each shuffled differently.

    The shuffle is approximate: texts pass through a buffer of `shuffle_buffer_size` (and the order of the
    files is shuffled). The batches depend only on the data, these arguments and the process count, so a
    resumed run starting at `first_batch` re-reads (and re-tokenizes) the batches before it and goes on
    with the very batches the interrupted run would have seen.
    """
    local_batch_size = len(range(global_batch_size)[process_slice(global_batch_size)])
    share = stream_share(dataset)
    if shuffle_buffer_size > 0:
        share = share.shuffle(seed=seed, buffer_size=shuffle_buffer_size)

    def every_pass():
        for epoch in itertools.count():
            if shuffle_buffer_size > 0:
                share.set_epoch(epoch)  # reshuffles the files and the buffer
            num_tokens = 0
            for tokens in token_arrays(share, tokenizer, text_column):
                num_tokens += len(tokens)
                yield tokens
            if num_tokens == 0:
                raise UsageError(
                    f"process {jax.process_index()}'s share of the training stream holds no text (a .txt file is one "
                    "text unless --text_sample_by says otherwise): give at least as many texts as processes"
                )

    rows = np.zeros((0, block_size), np.int32)
    batch_number = 0
    for blocks in pack_blocks(every_pass(), block_size):
        rows = np.concatenate([rows, blocks])
        while len(rows) >= local_batch_size:
            if batch_number >= first_batch:
                yield {"input_ids": rows[:local_batch_size]}
            rows, batch_number = rows[local_batch_size:], batch_number + 1


# Copied from run_clm_flax.first_blocks
def first_blocks(
    dataset: datasets.IterableDataset, tokenizer, text_column: str, block_size: int, count: int | None, split: str
) -> np.ndarray:
    """The first `count` blocks packed from a stream (all of them when `count` is None), read into memory."""
    blocks, total = [np.zeros((0, block_size), np.int32)], 0
    for block_array in pack_blocks(token_arrays(dataset, tokenizer, text_column, split=split), block_size):
        blocks.append(block_array)
        total += len(block_array)
        if count is not None and total >= count:
            break
    return np.concatenate(blocks)[:count]


# Masking and batches, on the host: numpy, this process's rows of a global batch at a time, reproducible from
# the seed.


def random_bits(seed: np.uint64, counters: np.ndarray) -> np.ndarray:
    """64 random bits for each counter: output number `counter` of SplitMix64 seeded with `seed` (Steele, Lea
    and Flood, 2014). An output depends on its number alone, so numpy computes any of them directly, all at once."""
    bits = seed + (counters + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)  # wraps around at 2**64, as it should
    bits = (bits ^ (bits >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    bits = (bits ^ (bits >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return bits ^ (bits >> np.uint64(31))


def uniform_from_bits(bits: np.ndarray) -> np.ndarray:
    """Numbers in [0, 1), from the top 53 of the random bits."""
    return (bits >> np.uint64(11)) * 2.0**-53


def mask_tokens(
    input_ids,
    special_tokens_mask,
    mask_token_id,
    vocab_size,
    mlm_probability,
    seed,
    row_numbers,
    max_chosen_per_row=None,
):
    """Choose positions to predict and corrupt them the BERT way.

    input_ids: (rows, seq) int; special_tokens_mask: (rows, seq) bool, True for special tokens and
    padding, which are never chosen; seed: an integer or a tuple of them; row_numbers: (rows,) the number of
    each row in its global batch. Each other position is chosen with probability mlm_probability, at most
    max_chosen_per_row of a row (of more, a uniformly random subset: those with the smallest draws); of the
    chosen, 80% become mask_token_id, 10% a random id in [0, vocab_size) and 10% stay as they are (so the model
    cannot learn that only masked positions matter).

    The random numbers of a position are drawn from counters of its own, given by its row number and place in
    the row, so a row is masked the same whatever rows are masked with it, on whichever process.
    Returns (masked input_ids, labels = the original ids, label_weights: float32, 1.0 where chosen).
    """
    length = input_ids.shape[1]
    seed = np.random.SeedSequence(seed).generate_state(1, np.uint64)[0]
    # Three counters per position: whether it is chosen, then, if it is, what becomes of it and which random id.
    positions = np.asarray(row_numbers, np.uint64)[:, None] * np.uint64(length) + np.arange(length, dtype=np.uint64)
    counters = positions * np.uint64(3)
    choice_draws = uniform_from_bits(random_bits(seed, counters))
    chosen = (choice_draws < mlm_probability) & ~special_tokens_mask
    if max_chosen_per_row is not None and (crowded := chosen.sum(axis=1) > max_chosen_per_row).any():
        draws = np.where(chosen[crowded], choice_draws[crowded], np.inf)
        last_kept = max_chosen_per_row - 1
        chosen[crowded] &= draws <= np.partition(draws, last_kept, axis=1)[:, last_kept : last_kept + 1]
    chosen_counters = counters[chosen]
    action = uniform_from_bits(random_bits(seed, chosen_counters + np.uint64(1)))  # < 0.8: mask, < 0.9: random id
    random_ids = (random_bits(seed, chosen_counters + np.uint64(2)) % np.uint64(vocab_size)).astype(input_ids.dtype)
    masked = input_ids.copy()
    masked[chosen] = np.where(action < 0.8, mask_token_id, np.where(action < 0.9, random_ids, input_ids[chosen]))
    return masked, input_ids.copy(), chosen.astype(np.float32)


@dataclass(frozen=True)
class BatchMaker:
    """Turns examples into masked model inputs: every example framed as <s> tokens </s>, padded, masked.

    Examples are rows of max_seq_length - 2 tokens (a 2-D array-like): blocks of grouped texts, or with line_by_line
    lines padded with pad_token_id, each ending at its last other token. Padding takes the place after </s>; the
    attention mask is 1 for tokens and 0 for padding. Each process makes only its own rows of a global batch and
    masks them with random numbers drawn for the row's number in the global batch (see mask_tokens), so the global
    batch is the same row for row whatever the number of processes.
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
    line_by_line: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer, max_seq_length: int, data_args):
        return cls(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            mask_token_id=tokenizer.mask_token_id,
            special_token_ids=tuple(sorted(set(tokenizer.all_special_ids))),
            random_token_count=len(tokenizer),
            mlm_probability=data_args.mlm_probability,
            max_seq_length=max_seq_length,
            pad_to_max_length=data_args.pad_to_max_length,
            line_by_line=data_args.line_by_line,
        )

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest row has `longest` tokens is padded to. jit compiles the step once
        per length, so padded batches take only a few: powers of two from 16, capped at max_seq_length."""
        if self.pad_to_max_length:
            return self.max_seq_length
        return min(self.max_seq_length, max(16, 1 << (longest - 1).bit_length()))

    def example_lengths(self, examples, indices: np.ndarray) -> np.ndarray:
        """The tokens between <s> and </s> of each of examples[indices]: a block's width, or a line's length (the
        position after its last token that is not padding), which reads the rows."""
        if not self.line_by_line:
            return np.full(len(indices), examples.shape[1])
        not_padding = np.asarray(examples[indices]) != self.pad_token_id
        return (not_padding * np.arange(1, examples.shape[1] + 1)).max(axis=1, initial=0)

    def token_ids(
        self, examples, indices: np.ndarray, num_rows: int, rows: slice = slice(None)
    ) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), int32 (rows, length), unmasked: the rows `rows` of a batch of `num_rows`
        rows, examples[indices] and then empty examples (<s> </s>), which fill up a partial batch and have nothing
        to predict. The length, the same on every process, is that of the longest example of the whole batch,
        padded: so of lines every row of the batch is read, of blocks only the rows `rows`."""
        row_lengths = np.zeros(num_rows, np.int64)  # tokens between <s> and </s>
        row_lengths[: len(indices)] = self.example_lengths(examples, indices)
        length = self.padded_length(int(row_lengths.max()) + 2)
        own_indices, row_lengths = indices[rows], row_lengths[rows]  # the examples come first, so they lead here too

        input_ids = np.full((len(row_lengths), length), self.pad_token_id, np.int32)
        input_ids[:, 0] = self.bos_token_id
        if len(own_indices):  # a line's row is padded already; a block fills the row
            input_ids[: len(own_indices), 1:-1] = np.asarray(examples[own_indices])[:, : length - 2]
        input_ids[np.arange(len(row_lengths)), row_lengths + 1] = self.eos_token_id
        attention_mask = (np.arange(length)[None, :] < row_lengths[:, None] + 2).astype(np.int32)
        return input_ids, attention_mask

    def predictions_per_row(self, length: int) -> int:
        """Room for the positions to predict in a row of `length` tokens: the mean number chosen plus five
        standard deviations, rounded up to a multiple of 8. About one row in a million has more chosen; a
        random subset of them is kept, so every batch of a length has the same shape."""
        mean = length * self.mlm_probability
        bound = mean + 5 * math.sqrt(mean * (1 - self.mlm_probability))
        return min(length, 8 * math.ceil(bound / 8))

    def masked(self, input_ids: np.ndarray, attention_mask: np.ndarray, seed: tuple, row_numbers: np.ndarray) -> dict:
        """The masked batch: input_ids (masked) and attention_mask, (rows, length); and for the positions
        to predict, masked_positions, masked_labels (the original ids) and masked_weights (1.0, or 0.0 for
        the unused room), (rows, predictions). row_numbers: each row's number in the global batch, which with
        the seed fixes its masks."""
        special_tokens_mask = np.isin(input_ids, self.special_token_ids) | (attention_mask == 0)
        predictions = self.predictions_per_row(input_ids.shape[1])
        masked_ids, labels, label_weights = mask_tokens(
            input_ids,
            special_tokens_mask,
            self.mask_token_id,
            self.random_token_count,
            self.mlm_probability,
            seed,
            row_numbers,
            predictions,
        )
        # The chosen positions of each row first, in order; then unchosen ones, with weight 0, as filler.
        positions = np.argsort(label_weights == 0, axis=1, kind="stable")[:, :predictions]
        return {
            "input_ids": masked_ids,
            "attention_mask": attention_mask,
            "masked_positions": positions.astype(np.int32),
            "masked_labels": np.take_along_axis(labels, positions, axis=1),
            "masked_weights": np.take_along_axis(label_weights, positions, axis=1),
        }

    def __call__(self, examples, indices: np.ndarray, num_rows: int, seed: tuple, rows: slice = slice(None)) -> dict:
        """The rows `rows` of the masked batch of `num_rows` rows made from examples[indices]."""
        input_ids, attention_mask = self.token_ids(examples, indices, num_rows, rows)
        return self.masked(input_ids, attention_mask, seed, np.arange(num_rows)[rows])


# Separate random streams for the masks of training and of evaluation batches.
TRAIN_MASKING, EVAL_MASKING = 0, 1


def train_batches(
    examples, make_batch: BatchMaker, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[tuple[dict, int]]:
    """This process's rows of each masked global batch of one epoch, from batch `first_batch` on, with the
    global batch's number of tokens (padding left out). Order and masks are fixed by seed, epoch and batch, so a
    resumed run goes on with the very batches the interrupted one would have seen; the examples left over after the
    last full batch differ from epoch to epoch."""
    order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    rows = process_slice(global_batch_size)
    for step in range(first_batch, len(examples) // global_batch_size):
        # Sorted (for reading memory-mapped examples in order) before the split, so that the global batch,
        # row for row, does not depend on the number of processes.
        indices = np.sort(order[step * global_batch_size : (step + 1) * global_batch_size])
        batch = make_batch(examples, indices, global_batch_size, (seed, TRAIN_MASKING, epoch, step), rows)
        yield batch, int(np.sum(make_batch.example_lengths(examples, indices) + 2))


def eval_batches(examples, make_batch: BatchMaker, global_batch_size: int, seed: int) -> Iterator[dict]:
    """This process's rows of batches holding every example once, in order, masked the same way at every
    evaluation (the masks are seeded by the batch's index), so evaluations are comparable. The last batch is
    filled up with empty rows, none dropped."""
    rows = process_slice(global_batch_size)
    for batch_index, start in enumerate(range(0, len(examples), global_batch_size)):
        indices = np.arange(start, min(start + global_batch_size, len(examples)))
        yield make_batch(examples, indices, global_batch_size, (seed, EVAL_MASKING, batch_index), rows)


def masked_stream_batches(
    block_batches: Iterable[dict], make_batch: BatchMaker, global_batch_size: int, seed: int, first_step: int
) -> Iterator[tuple[dict, int]]:
    """This process's rows of the global batches of blocks from a stream (streaming_train_batches, from step
    `first_step` on), framed and masked, with the global batch's number of tokens. Step s's masks are drawn from
    (seed, s), so a resumed run masks its batches as the interrupted one would have."""
    row_numbers = np.arange(global_batch_size)[process_slice(global_batch_size)]
    for step, batch in zip(itertools.count(first_step), block_batches):
        blocks = batch["input_ids"]
        input_ids, attention_mask = make_batch.token_ids(blocks, np.arange(len(blocks)), len(blocks))
        masked = make_batch.masked(input_ids, attention_mask, (seed, TRAIN_MASKING, step), row_numbers)
        yield masked, global_batch_size * make_batch.max_seq_length


# Copied from run_clm_flax.load_streams
def load_streams(model_args, data_args, training_args, tokenizer, block_size: int) -> tuple[dict, Any]:
    """For --streaming without --packed_data_dir: the training stream, tokenized and packed while training, and
    {"validation": the first blocks of the validation stream}, read once so that every evaluation (on every
    process) sees the same blocks."""
    streams = load_text_datasets(model_args, data_args, streaming=True)
    check_tokenizer_encodes(tokenizer, streams, data_args.text_column_name)
    train_stream = streams.get("train") if training_args.do_train else None  # load_data refuses a missing one
    if not training_args.do_eval:
        return {}, train_stream
    if "validation" not in streams:
        raise UsageError(
            "--streaming --do_eval needs --validation_file or a dataset with a validation split: a stream has no "
            "length to hold a percentage out from"
        )
    column, count = data_args.text_column_name, data_args.max_eval_samples
    validation = first_blocks(streams["validation"], tokenizer, column, block_size, count, "validation")
    logger.info("validation: the first %d blocks of the stream", len(validation))
    return {"validation": validation}, train_stream


# Copied from run_clm_flax.load_data
def load_data(
    model_args, data_args, training_args, tokenizer, block_size: int, length_argument: str
) -> tuple[dict, Any]:
    """Rows of block_size tokens (`length_argument` sets it, as the user gave it), {split: array-like}: blocks, or
    lines with run_mlm_flax.py --line_by_line; with --streaming the training blocks come from a stream. Every process
    holds all rows (memory-mapped) and reads only its rows of each batch."""
    train_stream = None
    if data_args.packed_data_dir:
        examples = load_packed_corpus(model_args, data_args, tokenizer, block_size, length_argument)
        if not (training_args.do_train or training_args.do_eval):
            return examples, None
    elif data_args.streaming:
        examples, train_stream = load_streams(model_args, data_args, training_args, tokenizer, block_size)
    else:
        # Process 0 packs what the cache lacks; then the others find it there (or, on a cache of their own, pack it).
        with main_process_first("data prepared"):
            evaluation_only = training_args.do_eval and not training_args.do_train
            texts = load_text_datasets(model_args, data_args, evaluation_only=evaluation_only)
            check_tokenizer_encodes(tokenizer, texts, data_args.text_column_name)
            cache_dir = model_args.cache_dir or datasets.config.HF_DATASETS_CACHE  # never a user's data directory
            examples = {
                split: cached_blocks(dataset, split, tokenizer, block_size, cache_dir, data_args)
                for split, dataset in texts.items()
            }
    examples = hold_out_blocks(examples, data_args.validation_split_percentage)
    if data_args.max_train_samples is not None and "train" in examples:
        examples["train"] = examples["train"][: data_args.max_train_samples]
    if data_args.max_eval_samples is not None and "validation" in examples:
        examples["validation"] = examples["validation"][: data_args.max_eval_samples]
    for split, rows in examples.items():
        if len(rows) == 0:
            raise UsageError(
                f"the {split} data has no non-empty lines"
                if data_args.framing == "line_by_line"
                else f"the {split} data has fewer tokens than one block of {block_size} ({length_argument}); add "
                "text or lower it"
            )
    if training_args.do_train and "train" not in examples and train_stream is None:
        raise UsageError("--do_train needs training data, and the data has no train split")
    if training_args.do_eval and "validation" not in examples:
        raise UsageError("--do_eval needs evaluation data: pass --validation_file or train data to split")
    return examples, train_stream


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def main():
    model_args, data_args, training_args, distributed_args = parse_arguments()
    initialize_distributed(distributed_args)
    check_arguments(model_args, data_args, training_args)
    # Every process checks --output_dir before process 0 writes into it. On CPU, this first exchange also sets up
    # the processes' collectives, which they must reach within 30 s of each other: right after joining, they do.
    wait_for_all_processes("arguments checked")
    setup_logging(is_main_process=jax.process_index() == 0)
    on_process_zero(lambda: check_output_dir(training_args), f"use --output_dir {training_args.output_dir}")

    config, tokenizer = load_config_and_tokenizer(model_args)
    check_model_and_tokenizer(config, tokenizer, training_args)
    max_seq_length = choose_max_seq_length(data_args, tokenizer, config)
    examples, train_stream = load_data(
        model_args, data_args, training_args, tokenizer, max_seq_length - 2, f"--max_seq_length {max_seq_length}"
    )
    if not (training_args.do_train or training_args.do_eval):
        print_once(f"packed data: {data_args.packed_data_dir}")
        return
    make_batch = BatchMaker.from_tokenizer(tokenizer, max_seq_length, data_args)

    model = FlaxRobertaForMaskedLM(
        config,
        dtype=jnp.dtype(model_args.dtype),
        param_dtype=jnp.dtype(model_args.param_dtype),
        remat_policy=model_args.gradient_checkpointing,
    )
    setup = set_up_training(model, make_eval_step(model), training_args, examples.get("train"), max_seq_length)
    state, progress = initial_state(model_args, training_args, setup)
    # Process 0 holds the lock on the output directory until this process ends, for all processes.
    output_dir_lock = on_process_zero(  # noqa: F841
        lambda: prepare_output_dir(training_args, progress.step), f"lock --output_dir {training_args.output_dir}"
    )
    # All arguments, recorded in the checkpoints and the trackers; the hub token is never written.
    arguments = {**asdict(model_args), **asdict(data_args), **asdict(training_args)}
    del arguments["token"]
    trackers = open_trackers(
        training_args, progress.step > 0, arguments, config.to_diff_dict(), Evaluation.metric_tags
    )
    evaluation = Evaluation(setup, examples.get("validation"), make_batch, tokenizer, training_args, trackers)

    train_now = training_args.do_train and progress.step < setup.total_steps
    if train_now:
        batches = train_batches_from(
            progress.step, setup, examples.get("train"), train_stream, make_batch, tokenizer, data_args, training_args
        )
        save = partial(save_run, setup, config, tokenizer, arguments)
        log = TrainingLog(trackers, training_args.skip_nonfinite_steps, progress.step, setup.total_steps)
        state, stopped_by = train(state, progress, batches, setup.train_step, save, evaluation, log, training_args)
        if stopped_by:
            report_stop(stopped_by, progress.step, training_args.output_dir, trackers)
            return
        write_train_results(training_args.output_dir, train_metrics(progress.metric_sums), setup, log)
    elif training_args.do_train:
        export_complete_run(training_args.output_dir, state.params, config, tokenizer)
    if training_args.do_eval:
        evaluation.final(state.params, int(state.step), reuse_saved=training_args.do_train and not train_now)
    if jax.process_index() == 0:
        trackers.results(write_all_results(training_args.output_dir), int(state.step))
    trackers.close()
    if train_now:
        evaluation.fill_mask_with_export(config)
    if training_args.do_train and "tensorboard" in training_args.report_to:
        print_once(f"TensorBoard: tensorboard --logdir {os.path.join(training_args.output_dir, 'tensorboard')}")


# Copied from run_clm_flax.load_config_and_tokenizer
def load_config_and_tokenizer(model_args):
    def load(loader, name, flag):
        try:
            return loader.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load {flag} {name}: {str(error).splitlines()[0]}") from None

    if model_args.config_name or model_args.model_name_or_path:
        config_flag = "--config_name" if model_args.config_name else "--model_name_or_path"
        config = load(AutoConfig, model_args.config_name or model_args.model_name_or_path, config_flag)
    else:
        logger.warning("No --config_name: training a %s with the default configuration", model_args.model_type)
        config = transformers.CONFIG_MAPPING[model_args.model_type]()

    tokenizer_flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
    tokenizer = load(AutoTokenizer, tokenizer_source, tokenizer_flag)
    if not tokenizer.is_fast:
        raise UsageError(f"{tokenizer_flag} {tokenizer_source} is not a fast (tokenizers-backed) tokenizer")
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


def check_model_and_tokenizer(config, tokenizer, training_args):
    """The model must be a RoBERTa, and the tokenizer must have the special tokens masked language modelling and
    RoBERTa's position numbering need."""
    check_model_config(config)
    if training_args.fill_mask_text and tokenizer.mask_token not in training_args.fill_mask_text:
        raise UsageError(f"--fill_mask_text must contain the mask token {tokenizer.mask_token}")
    if len(tokenizer) > config.vocab_size:  # masking draws random replacements from every id of the tokenizer
        raise UsageError(
            f"the tokenizer has {len(tokenizer)} tokens but the config's vocab_size is {config.vocab_size}; "
            "raise vocab_size in the config (create_config.py --tokenizer_dir)"
        )
    if tokenizer.mask_token_id is None:
        raise UsageError(
            "the tokenizer has no mask token, which masked language modelling needs; "
            "train it with train_tokenizer.py --model_type roberta"
        )
    for role in ("bos", "eos", "pad"):
        if getattr(tokenizer, f"{role}_token_id") is None:
            raise UsageError(
                f"the tokenizer has no {role}_token, which RoBERTa needs; "
                "train it with train_tokenizer.py --model_type roberta"
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


# Copied from run_clm_flax.TrainingSetup
@dataclass
class TrainingSetup:
    """What training and evaluation need, built once from the arguments and the model."""

    model: nn.Module
    sequence_length: int
    train_batch_size: int  # global: over all devices and micro-batches
    eval_batch_size: int
    train_samples: int | None  # None for a stream, whose length is unknown
    steps_per_epoch: int | None
    total_steps: int
    batch_sharding: NamedSharding
    micro_batches_sharding: NamedSharding
    optimizer: optax.GradientTransformation
    abstract_state: TrainState
    train_step: Any
    eval_step: Any


# Copied from run_clm_flax.set_up_training
def set_up_training(model, eval_step, training_args, train_examples, sequence_length: int) -> TrainingSetup:
    logger.info(
        "%d devices over %d processes (%d here): %s",
        jax.device_count(),
        jax.process_count(),
        jax.local_device_count(),
        jax.devices(),
    )
    mesh = create_mesh(training_args.mesh_shape)
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    micro_batches_sharding = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))  # (micro-batch, row, ...)
    accumulation_steps = training_args.gradient_accumulation_steps
    train_batch_size = training_args.per_device_train_batch_size * jax.device_count() * accumulation_steps
    steps_per_epoch, total_steps = count_steps(training_args, train_examples, train_batch_size)
    schedule = learning_rate_schedule(training_args, total_steps)
    optimizer = create_optimizer(training_args, schedule)
    abstract_state = abstract_train_state(model, optimizer, mesh, jnp.zeros((1, sequence_length), jnp.int32))
    state_shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
    logger.info(
        "%s with %.1fM parameters in %s, computing in %s, on a mesh of %s",
        type(model).__name__,
        sum(leaf.size for leaf in jax.tree_util.tree_leaves(abstract_state.params)) / 1e6,
        jnp.dtype(model.param_dtype),
        jnp.dtype(model.dtype),
        dict(mesh.shape),
    )
    return TrainingSetup(
        model=model,
        sequence_length=sequence_length,
        train_batch_size=train_batch_size,
        eval_batch_size=training_args.per_device_eval_batch_size * jax.device_count(),
        train_samples=None if train_examples is None else len(train_examples),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        batch_sharding=batch_sharding,
        micro_batches_sharding=micro_batches_sharding,
        optimizer=optimizer,
        abstract_state=abstract_state,
        train_step=jax.jit(
            make_train_step(model, optimizer, schedule, training_args.seed),
            in_shardings=(state_shardings, micro_batches_sharding),
            out_shardings=(state_shardings, None),
            donate_argnums=(0,),
            compiler_options=train_step_compiler_options(),
        ),
        eval_step=jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding)),
    )


# Copied from run_clm_flax.count_steps with block_size->max_seq_length
def count_steps(training_args, train_examples, train_batch_size: int) -> tuple[int | None, int]:
    """Steps per epoch (None without training data of known length) and the run's last step."""
    if not training_args.do_train:
        return None, 1
    if train_examples is None:  # a stream
        return None, training_args.max_steps
    steps_per_epoch = len(train_examples) // train_batch_size
    if steps_per_epoch == 0:
        raise UsageError(
            f"the training data makes {len(train_examples)} sequences, fewer than one global batch of "
            f"{train_batch_size}; add data or lower --per_device_train_batch_size or --max_seq_length"
        )
    if training_args.max_steps > 0:
        return steps_per_epoch, training_args.max_steps
    return steps_per_epoch, max(1, int(training_args.num_train_epochs * steps_per_epoch))


# Copied from run_clm_flax.initial_state with block_size->max_seq_length
def initial_state(model_args, training_args, setup: TrainingSetup) -> tuple[TrainState, "TrainingProgress"]:
    """The state to start from: with --resume_from_checkpoint the newest (or the named) training checkpoint, if
    there is one; otherwise new weights, or those of the Hugging Face checkpoint --model_name_or_path."""
    if training_args.resume_from_checkpoint:
        record_keys = ["step", *(f"train_{name}" for name in TRAIN_METRIC_SUMS), "global_batch_size", "max_seq_length"]
        restored = restore_checkpoint(
            training_args.resume_from_checkpoint, training_args.output_dir, setup.abstract_state, record_keys
        )
        if restored:
            state, record, path = restored
            logger.info("Resumed from %s at step %d", path, record["step"])
            check_resumed_run(record, setup, training_args)
            return state, TrainingProgress.from_record(record)
        logger.info("No training checkpoint to resume from in %s: starting a new run", training_args.output_dir)
    dummy_input = jnp.zeros((1, setup.sequence_length), jnp.int32)
    loaded_params = pretrained_params(model_args, setup)
    state = create_train_state(
        setup.model, setup.optimizer, setup.abstract_state, training_args.seed, dummy_input, loaded_params
    )
    return state, TrainingProgress()


def pretrained_params(model_args, setup: TrainingSetup):
    """The weights of the Hugging Face checkpoint --model_name_or_path in this model's layout; None without one."""
    if not model_args.model_name_or_path:
        return None
    checkpoint = read_safetensors_checkpoint(model_args.model_name_or_path, model_args)
    params = from_hf_state_dict(checkpoint, setup.model.config)
    logger.info("Loaded weights from %s", model_args.model_name_or_path)
    return params


# Copied from run_clm_flax.check_resumed_run with block_size->max_seq_length
def check_resumed_run(record: dict, setup: TrainingSetup, training_args):
    if training_args.overwrite_output_dir:
        logger.warning("--overwrite_output_dir is ignored: --resume_from_checkpoint continues the run in it")
    if (record["global_batch_size"], record["max_seq_length"]) != (setup.train_batch_size, setup.sequence_length):
        logger.warning(
            "The checkpoint was trained with global batches of %d x %d tokens, this run uses %d x %d: the data "
            "order differs from the interrupted run's",
            record["global_batch_size"],
            record["max_seq_length"],
            setup.train_batch_size,
            setup.sequence_length,
        )
    if not training_args.do_train:
        return
    if record["step"] > setup.total_steps:
        raise UsageError(
            f"the checkpoint is at step {record['step']}, after this run's last step {setup.total_steps}; "
            "raise --max_steps or --num_train_epochs to train further"
        )
    if record["step"] == setup.total_steps:
        logger.info("The run is complete (step %d of %d): nothing left to train", record["step"], setup.total_steps)


# Copied from run_clm_flax.prepare_output_dir
def prepare_output_dir(training_args, resumed_step: int):
    """Lock the output directory for this run (the lock is returned: it lasts as long as the object), and clear or
    set aside what an earlier run left that this one would mix with its own."""
    lock = lock_output_dir(training_args.output_dir)
    refuse_earlier_run(training_args)  # again: another run may have ended in it since the check
    if training_args.do_train:
        if training_args.overwrite_output_dir and not resumed_step:
            clear_previous_run(training_args.output_dir)
        set_aside_checkpoints_after(training_args.output_dir, resumed_step)
    os.makedirs(training_args.output_dir, exist_ok=True)
    return lock


class Evaluation:
    """Evaluation on the validation examples, masked the same way each time; and, at the end of training, what the
    exported model predicts for a masked text."""

    metric_tags = ["eval/loss", "eval/perplexity", "eval/accuracy"]  # what TensorBoard's HParams tab compares runs by

    def __init__(self, setup: TrainingSetup, examples, make_batch, tokenizer, training_args, trackers):
        self.setup, self.examples, self.make_batch = setup, examples, make_batch
        self.tokenizer, self.trackers = tokenizer, trackers
        self.output_dir, self.seed = training_args.output_dir, training_args.seed
        self.fill_mask_text, self.fill_mask_top_k = training_args.fill_mask_text, training_args.fill_mask_top_k

    def __call__(self, params, step: int) -> dict:
        setup = self.setup
        results = evaluate(
            setup.eval_step,
            params,
            self.examples,
            self.make_batch,
            setup.eval_batch_size,
            self.seed,
            setup.batch_sharding,
        )
        logger.info(
            "step %d: eval loss %.4f, perplexity %.2f, accuracy %.4f over %d masked tokens",
            step,
            results["loss"],
            results["perplexity"],
            results["accuracy"],
            results["masked_tokens"],
        )
        self.trackers.scalars({f"eval/{name}": results[name] for name in ("loss", "perplexity", "accuracy")}, step)
        return results

    def final(self, params, step: int, reuse_saved: bool):
        """The evaluation of the final weights, into eval_results.json; with `reuse_saved`, one already there for
        this step is kept."""
        if reuse_saved and evaluated_step(self.output_dir) == step:
            logger.info("The complete run's evaluation is in %s", os.path.join(self.output_dir, "eval_results.json"))
            return
        results = self(params, step)
        if jax.process_index() == 0:
            names = ("loss", "perplexity", "accuracy", "masked_tokens")
            saved = {f"eval_{name}": results[name] for name in names}
            saved.update(eval_samples=len(self.examples), step=step)
            write_json(os.path.join(self.output_dir, "eval_results.json"), saved)
            print(
                f"eval accuracy: {results['accuracy']:.4f}, perplexity: {results['perplexity']:.2f} "
                f"(loss {results['loss']:.4f}, {results['masked_tokens']} masked tokens)"
            )

    def fill_mask_with_export(self, config):
        """What the exported model, read back, predicts for --fill_mask_text (or a validation text with a word
        masked): this also shows that the saved files hold the trained model."""
        if jax.process_index() != 0 or self.fill_mask_top_k <= 0:
            return
        text, masked_word = self.fill_mask_text, None
        if not text and self.examples is not None:
            texts = example_texts(self.examples, self.tokenizer, 100)
            text, masked_word = fill_mask_demo_text(texts, self.tokenizer.mask_token)
        if not text:
            return
        exported = from_hf_state_dict(load_file(os.path.join(self.output_dir, "model.safetensors")), config)
        model = FlaxRobertaForMaskedLM(config)
        max_seq_length = self.setup.sequence_length
        predictions = fill_mask(model, exported, self.tokenizer, text, self.fill_mask_top_k, max_seq_length)
        masked = f" (masked: {masked_word!r})" if masked_word else ""
        print(f"fill-mask with {self.output_dir}: {text!r}{masked}")
        for token, probability in predictions:
            print(f"  {probability:.3f} {token!r}")


def train_batches_from(
    first_step, setup: TrainingSetup, train_examples, train_stream, make_batch, tokenizer, data_args, training_args
):
    """(global batch, token count) pairs for the steps after `first_step`, read ahead on a thread. The data order and
    the masks are a function of the step, so a resumed run sees the batches the interrupted one would have."""
    batch_size, max_seq_length = setup.train_batch_size, setup.sequence_length
    if train_stream is None:
        data = f"({setup.total_steps / setup.steps_per_epoch:.2f} epochs of {len(train_examples)} examples)"
        batches_of_epoch = partial(train_batches, train_examples, make_batch, batch_size, training_args.seed)
        local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    else:
        data = "on blocks grouped from a stream"  # (--line_by_line is refused with --streaming)
        first_batch, seed = stream_position(first_step, batch_size, training_args)
        block_batches = streaming_train_batches(
            train_stream,
            tokenizer,
            data_args.text_column_name,
            max_seq_length - 2,
            batch_size,
            seed,
            data_args.shuffle_buffer_size,
            first_batch,
        )
        local_batches = masked_stream_batches(block_batches, make_batch, batch_size, training_args.seed, first_step)
    logger.info(
        "Training steps %d to %d %s, global batch %d x %d tokens%s",
        first_step + 1,
        setup.total_steps,
        data,
        batch_size,
        max_seq_length,
        " at most (padded per batch)" if data_args.line_by_line else "",
    )
    accumulation_steps = training_args.gradient_accumulation_steps
    return prefetch(
        (
            to_global_batch(
                {name: values.reshape(accumulation_steps, -1, *values.shape[1:]) for name, values in batch.items()},
                setup.micro_batches_sharding,
            ),
            tokens,
        )
        for batch, tokens in local_batches
    )


# Copied from run_clm_flax.epochs_of_batches
def epochs_of_batches(batches_of_epoch, first_step: int, steps_per_epoch: int):
    """The batches from the step after `first_step` on, epoch after epoch; `batches_of_epoch(epoch, first_batch)`."""
    epoch, first_batch = divmod(first_step, steps_per_epoch)
    while True:
        yield from batches_of_epoch(epoch, first_batch)
        epoch, first_batch = epoch + 1, 0


# Copied from run_clm_flax.stream_position
def stream_position(first_step: int, global_batch_size: int, training_args) -> tuple[int, int]:
    """Where a stream resumes: the batch to start at and the shuffling seed."""
    if first_step and training_args.ignore_data_skip:
        logger.warning(
            "--ignore_data_skip: the stream starts afresh, shuffled anew; the data differs from the interrupted run's"
        )
        return 0, training_args.seed + first_step
    if first_step:
        logger.warning(
            "Re-reading and re-tokenizing the %d blocks each process trained on before step %d, to continue with the "
            "batches the interrupted run would have seen (--ignore_data_skip starts the stream afresh instead)",
            first_step * global_batch_size // jax.process_count(),
            first_step,
        )
    return first_step, training_args.seed


# Copied from run_clm_flax.TrainingProgress
@dataclass
class TrainingProgress:
    """How far training has come: the step, and the sums of TRAIN_METRIC_SUMS over every finite step so far. Every
    training checkpoint records it (as "step" and "train_NAME"), so a resumed run carries on from it."""

    step: int = 0
    metric_sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TRAIN_METRIC_SUMS, 0.0))

    def add(self, step_metrics: list[dict]):
        for metrics in step_metrics:
            for name in TRAIN_METRIC_SUMS:
                self.metric_sums[name] += float(metrics[name])

    def record(self, **details) -> dict:
        return {"step": self.step, **{f"train_{name}": value for name, value in self.metric_sums.items()}, **details}

    @classmethod
    def from_record(cls, record: dict) -> "TrainingProgress":
        return cls(record["step"], {name: record[f"train_{name}"] for name in TRAIN_METRIC_SUMS})


# Copied from run_clm_flax.TrainingLog
class TrainingLog:
    """What the loop reports. It holds the metrics of the steps not yet read from the devices and of those since
    the last log line, stops on a non-finite step (or skips it, with --skip_nonfinite_steps), and writes the log
    line, the progress bar and TensorBoard. As a `with` block it times the training and, leaving it, ends the
    progress bar's line before any error is printed."""

    def __init__(self, trackers, skip_nonfinite_steps: bool, first_step: int, total_steps: int):
        self.trackers, self.skip_nonfinite_steps = trackers, skip_nonfinite_steps
        self.first_step, self.total_steps = first_step, total_steps
        self.unread, self.window, self.tokens = [], [], 0

    def __enter__(self):
        self.progress_bar = tqdm(
            initial=self.first_step, total=self.total_steps, desc="Training", disable=jax.process_index() > 0
        )
        self.start = self.window_start = time.perf_counter()
        return self

    def __exit__(self, *exception):
        self.progress_bar.close()
        self.runtime = time.perf_counter() - self.start

    def step_done(self, metrics: dict, tokens: int):
        self.unread.append({**metrics, "tokens": tokens})
        self.tokens += tokens
        self.progress_bar.update(1)

    def read(self, step: int, progress: TrainingProgress, checkpoints):
        """Wait for the steps not yet read and add the finite ones to `progress`: checked here, before each save, no
        non-finite step goes unnoticed into a checkpoint. Such a step's update was never applied; it stops the run,
        or is logged and skipped with --skip_nonfinite_steps."""
        fetched = jax.device_get(self.unread)
        first_step = step - len(fetched) + 1
        bad_steps = [first_step + index for index, metrics in enumerate(fetched) if not metrics["finite"]]
        if bad_steps and not self.skip_nonfinite_steps:
            raise self.nonfinite_error(bad_steps[0], checkpoints)
        for bad_step in bad_steps:
            logger.warning("step %d: the loss or gradient norm is not finite; the update was skipped", bad_step)
        finite = [metrics for metrics in fetched if metrics["finite"]]
        progress.add(finite)
        self.window += finite
        self.unread = []

    @staticmethod
    def nonfinite_error(step: int, checkpoints) -> UsageError:
        newest = checkpoints.latest_step()
        if newest is None:
            advice = "no training checkpoint was saved yet. Lower --learning_rate and start again"
        else:
            last_good = os.path.join(str(checkpoints.directory), str(newest))
            advice = (
                f"the last good checkpoint is {last_good}. Lower --learning_rate and continue with "
                "--resume_from_checkpoint"
            )
        return UsageError(
            f"the loss or gradient norm is not finite at step {step}; its update was not applied and nothing "
            f"was saved after it; {advice}, or pass --skip_nonfinite_steps to skip such steps"
        )

    def write(self, step: int):
        """The log line of the steps read since the last one."""
        if not self.window:
            return
        window_sums = {name: sum(float(metrics[name]) for metrics in self.window) for name in TRAIN_METRIC_SUMS}
        summary = train_metrics(window_sums)
        learning_rate, grad_norm = float(self.window[-1]["learning_rate"]), float(self.window[-1]["grad_norm"])
        elapsed = time.perf_counter() - self.window_start
        tokens_per_second = sum(metrics["tokens"] for metrics in self.window) / elapsed
        self.progress_bar.set_postfix(
            **{name: f"{value:.4f}" for name, value in summary.items()},
            lr=f"{learning_rate:.2e}",
            tokens_per_s=f"{tokens_per_second:.0f}",
        )
        logger.info(
            "step %d: %s, learning rate %.3e, grad norm %.3f, %.0f tokens/s",
            step,
            ", ".join(f"{name} {value:.4f}" for name, value in summary.items()),
            learning_rate,
            grad_norm,
            tokens_per_second,
        )
        logged = {"learning_rate": learning_rate, "grad_norm": grad_norm, "tokens_per_second": tokens_per_second}
        self.trackers.scalars({f"train/{name}": value for name, value in {**summary, **logged}.items()}, step)
        self.window, self.window_start = [], time.perf_counter()


# Copied from run_clm_flax.train
def train(state, progress: TrainingProgress, batches, train_step, save, evaluate, log: TrainingLog, training_args):
    """Train from the step after `progress.step` to the last, logging every --logging_steps, evaluating every
    --eval_steps (with --do_eval) and saving every --save_steps and at the end, or at the step where a stop was
    requested. Returns the state and the signal that stopped training, None if it ran to the end."""
    eval_steps = training_args.eval_steps or training_args.logging_steps
    # Leaving this block, for whatever reason, waits for a checkpoint still being written.
    with (
        open_checkpoints(training_args.output_dir, training_args.save_total_limit) as checkpoints,
        StopRequest() as stop,
        log,
    ):
        checkpoint_being_written = None
        for step in range(progress.step + 1, log.total_steps + 1):
            batch, tokens = next(batches)
            state, metrics = train_step(state, batch)
            log.step_done(metrics, tokens)
            checkpoint_being_written = committed_checkpoint(checkpoints, checkpoint_being_written)
            is_last = step == log.total_steps
            is_log_step = step % training_args.logging_steps == 0 or is_last
            stopping = stop.requested(check_other_processes=is_log_step)
            is_save_step = step % training_args.save_steps == 0 or is_last or stopping
            if is_log_step or is_save_step:
                log.read(step, progress, checkpoints)
            if is_log_step or stopping:
                log.write(step)
            if training_args.do_eval and step % eval_steps == 0 and not is_last and not stopping:
                evaluate(state.params, step)
            if is_save_step:
                # The save would wait for the checkpoint still being written: announce it first.
                committed_checkpoint(checkpoints, checkpoint_being_written, wait=True)
                progress.step = step
                checkpoint_being_written = save(checkpoints, state, progress)
            if stopping:
                break
        committed_checkpoint(checkpoints, checkpoint_being_written, wait=True)
    return state, stop.signal_name if stopping else None


# Copied from run_clm_flax.save_run with block_size->max_seq_length
def save_run(setup: TrainingSetup, config, tokenizer, arguments: dict, checkpoints, state, progress) -> int:
    """Save a training checkpoint (written in the background) and export the model. Returns the step saved."""
    record = progress.record(
        global_batch_size=setup.train_batch_size, max_seq_length=setup.sequence_length, arguments=arguments
    )
    if setup.steps_per_epoch:
        record["epoch"], record["batch_in_epoch"] = divmod(progress.step, setup.steps_per_epoch)
    save_checkpoint(checkpoints, state, record)
    output_dir = os.path.dirname(str(checkpoints.directory))
    save_model(output_dir, state.params, config, tokenizer)
    logger.info(
        "step %d: saved the model to %s; writing the training checkpoint in the background", progress.step, output_dir
    )
    return progress.step


# Copied from run_clm_flax.report_stop
def report_stop(signal_name: str, step: int, output_dir: str, trackers):
    trackers.close()
    print_once(
        f"Stopped by {signal_name} after step {step}; the training checkpoint is in "
        f"{os.path.join(output_dir, 'checkpoints', str(step))}. To continue, run the same command with "
        "--resume_from_checkpoint added."
    )


# Copied from run_clm_flax.write_train_results
def write_train_results(output_dir: str, summary: dict, setup: TrainingSetup, log: TrainingLog):
    if jax.process_index() == 0:
        results = {f"train_{name}": value for name, value in summary.items()}
        results.update(
            train_samples=setup.train_samples,
            train_steps=setup.total_steps,
            epochs=setup.total_steps / setup.steps_per_epoch if setup.steps_per_epoch else None,
            train_runtime_seconds=log.runtime,
            train_tokens_per_second=log.tokens / log.runtime,
        )
        write_json(os.path.join(output_dir, "train_results.json"), results)
    logger.info("Saved the model to %s", output_dir)


# Copied from run_clm_flax.export_complete_run
def export_complete_run(output_dir: str, params, config, tokenizer):
    """Export the model of a run that is complete, where it is missing: the run was stopped after its last
    checkpoint was committed but before the export."""
    if not os.path.isfile(os.path.join(output_dir, "model.safetensors")):
        save_model(output_dir, params, config, tokenizer)
        logger.info("Exported the model of the complete run to %s", output_dir)


# Copied from run_clm_flax.print_once
def print_once(text: str):
    if jax.process_index() == 0:
        print(text)


# ----------------------------------------------------------------------------------------------------
# Appendix: processes, one or several joined by JAX's distributed runtime
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.on_cloud_tpu_vm
def on_cloud_tpu_vm() -> bool:
    """As JAX found when it was imported. The flag lives in a private module of JAX; should it move, TPU users pass
    the three flags instead."""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


# Copied from run_clm_flax.multi_process_launcher
def multi_process_launcher() -> str | None:
    """The launcher that started this process as one of several tasks, or None. jax.distributed.initialize()
    reads the run's settings from the launcher's environment, but cannot be told to do nothing for a process on
    its own: without a launcher it fails, and for a single task it starts a coordinator all the same."""
    # Only srun's tasks have SLURM_STEP_NODELIST: a batch script run with --ntasks 4 is still one process.
    if "SLURM_STEP_NODELIST" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "Slurm"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if on_cloud_tpu_vm():
        return "Cloud TPU"
    return None


# Copied from run_clm_flax.initialize_distributed
def initialize_distributed(distributed_args):
    """Join the other processes of a multi-process run, before anything touches the devices: with the three flags,
    or with what JAX finds itself under Slurm's srun, Open MPI's mpirun or on the hosts of a Cloud TPU slice."""
    check_distributed_arguments(distributed_args)
    explicit = distributed_args.coordinator_address is not None
    launcher = None if explicit else multi_process_launcher()
    if distributed_args.num_processes == 1 or not (explicit or launcher):
        if distributed_args.local_device_ids is not None:
            raise UsageError(
                "--local_device_ids applies to multi-process runs; to choose the GPUs of a single process, set "
                "CUDA_VISIBLE_DEVICES"
            )
        return
    device_ids = distributed_args.local_device_ids
    try:
        jax.distributed.initialize(
            coordinator_address=distributed_args.coordinator_address,
            num_processes=distributed_args.num_processes,
            process_id=distributed_args.process_id,
            local_device_ids=None if device_ids is None else [int(part) for part in device_ids.split(",")],
        )
    except ValueError as error:
        if explicit:
            raise
        # The launcher's environment lacks something JAX reads, e.g. the address of Open MPI 5's launcher.
        raise UsageError(
            f"{launcher} started this process as one of several, but JAX cannot tell how to join the others "
            f"({error}); pass --coordinator_address, --num_processes and --process_id"
        ) from None


# One log format for the four scripts; a process of a multi-process run names itself after the time.
# Copied from run_clm_flax.LOG_FORMAT
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# Copied from run_clm_flax.setup_logging
def setup_logging(is_main_process: bool):
    """Only process 0 logs below ERROR."""
    process_label = f" process {jax.process_index()}" if jax.process_count() > 1 else ""
    logging.basicConfig(
        format=LOG_FORMAT.replace("%(asctime)s", f"%(asctime)s{process_label}"),
        level=logging.INFO if is_main_process else logging.ERROR,
        force=True,  # importing orbax installs absl's handler, which would hide these logs
    )
    logging.getLogger("absl").setLevel(logging.WARNING)
    datasets.utils.logging.set_verbosity_warning()
    transformers.utils.logging.set_verbosity_warning()
    if not is_main_process:
        datasets.disable_progress_bars()


# Copied from run_clm_flax.wait_for_all_processes
def wait_for_all_processes(name: str):
    """Return once every process has called this with the same `name` (at once for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# Copied from run_clm_flax.main_process_first
@contextlib.contextmanager
def main_process_first(name: str):
    """Process 0 runs the block first, then the others: they then read the caches it filled (on a file
    system the hosts share) instead of all writing the same files at once."""
    if jax.process_index() > 0:
        wait_for_all_processes(name)
    try:
        yield
    finally:  # also when process 0 fails: the others then try, and report the same error
        if jax.process_index() == 0:
            wait_for_all_processes(name)


# Copied from run_clm_flax.MESH_AXES
MESH_AXES = ("data", "fsdp")


# Copied from run_clm_flax.BATCH_AXES
BATCH_AXES = MESH_AXES


# Copied from run_clm_flax.LOGICAL_AXIS_RULES
LOGICAL_AXIS_RULES = (
    ("vocab", None),
    ("positions", None),
    ("embed", "fsdp"),
    ("heads", None),
    ("mlp", None),
)


# Copied from run_clm_flax.create_mesh
def create_mesh(mesh_shape: str | None = None) -> jax.sharding.Mesh:
    """All devices of all processes on MESH_AXES, sized by `mesh_shape` ("data=2,fsdp=4"); by default all on "data"."""
    given = {}
    if mesh_shape:
        try:
            given = {name.strip(): int(size) for name, size in (part.split("=") for part in mesh_shape.split(","))}
        except ValueError:
            raise UsageError(f"--mesh_shape {mesh_shape}: write it as data=N,fsdp=M") from None
        if not set(given) <= set(MESH_AXES) or min(given.values()) < 1:
            raise UsageError(f"--mesh_shape {mesh_shape}: the axes are {' and '.join(MESH_AXES)}, each at least 1")
    sizes = {"data": max(1, jax.device_count() // given.get("fsdp", 1)), "fsdp": 1, **given}
    if sizes["data"] * sizes["fsdp"] != jax.device_count():
        raise UsageError(
            f"--mesh_shape {mesh_shape} has {sizes['data'] * sizes['fsdp']} devices but there are "
            f"{jax.device_count()}; make the sizes multiply to the device count"
        )
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    )


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
    replicated = NamedSharding(mesh, PartitionSpec())
    # Optimizer state that mirrors a parameter (Adam's moments) is sharded like it; the rest (step counts,
    # Adafactor's factored statistics, whose shapes differ) is replicated.
    opt_state_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda leaf, param, sharding: sharding if leaf.shape == param.shape else replicated,
        abstract_opt_state,
        abstract_params,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_state_shardings)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt_state)
    return jax.tree_util.tree_map(lambda shape, sharding: shape.update(sharding=sharding), shapes, shardings)


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


# Copied from run_clm_flax.to_global_batch
def to_global_batch(local_batch: dict, batch_sharding) -> dict:
    """This process's rows -> one array split over every device of every process."""
    return {name: jax.make_array_from_process_local_data(batch_sharding, rows) for name, rows in local_batch.items()}


# Copied from run_clm_flax.prefetch
def prefetch(iterator: Iterator) -> Iterator:
    """Run `iterator` in a background thread, two items ahead, so the host prepares the next batches while the
    devices compute."""
    items = queue.Queue(maxsize=2)
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


# ----------------------------------------------------------------------------------------------------
# Appendix: the output directory, training checkpoints, stopping, logging
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.OUTPUT_DIR_LOCK
OUTPUT_DIR_LOCK = ".lock"


# Copied from run_clm_flax.take_lock
def take_lock(lock_file, output_dir: str, mode: int) -> bool:
    """flock without waiting; refuses in one line where another run holds it. False where the file system has no
    locks."""
    try:
        fcntl.flock(lock_file, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "another process"
        raise UsageError(
            f"--output_dir {output_dir} is in use by another run ({holder}); wait for it to end or pass another "
            "--output_dir"
        ) from None
    except OSError as error:
        logger.warning(
            "cannot lock --output_dir %s (%s): make sure no other run writes into it", output_dir, error.strerror
        )
        return False
    return True


# Copied from run_clm_flax.lock_output_dir
def lock_output_dir(output_dir: str):
    """Hold OUTPUT_DIR/.lock, so that one run at a time writes into it, until the returned file is closed or the
    process ends: however it ends, the kernel releases the lock, so a killed run never leaves the directory locked."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        lock_file = open(os.path.join(output_dir, OUTPUT_DIR_LOCK), "a+")
    except OSError as error:
        raise UsageError(
            f"cannot write into --output_dir {output_dir} ({error.strerror}); pass a writable directory"
        ) from None
    try:
        if take_lock(lock_file, output_dir, fcntl.LOCK_EX):
            lock_file.seek(0)
            lock_file.truncate()
            lock_file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            lock_file.flush()
    except UsageError:
        lock_file.close()
        raise
    return lock_file


# Copied from run_clm_flax.refuse_earlier_run
def refuse_earlier_run(training_args):
    """Training into an earlier run's files needs --resume_from_checkpoint or --overwrite_output_dir. The lock and
    unfinished checkpoints, which the next run deletes anyway, are not such files (a run killed before its first
    checkpoint leaves nothing else of worth)."""
    output_dir = training_args.output_dir
    if not training_args.do_train or training_args.overwrite_output_dir or training_args.resume_from_checkpoint:
        return
    checkpoints = os.path.join(output_dir, "checkpoints")
    entries = set(os.listdir(output_dir)) if os.path.isdir(output_dir) else set()
    if os.path.isdir(checkpoints) and all(
        ocp.step.is_tmp_checkpoint(os.path.join(checkpoints, name)) for name in os.listdir(checkpoints)
    ):
        entries.discard("checkpoints")
    if entries - {OUTPUT_DIR_LOCK}:
        raise UsageError(
            f"--output_dir {output_dir} already holds files; pass --resume_from_checkpoint to continue its run, or "
            "--overwrite_output_dir to start a new run in it"
        )


# Copied from run_clm_flax.check_output_dir
def check_output_dir(training_args):
    """Before any work, and writing nothing: refuse an output directory that another run holds (probed with a shared
    lock), or one with an earlier run's files that these flags do not allow training into."""
    lock_path = os.path.join(training_args.output_dir, OUTPUT_DIR_LOCK)
    if os.path.isfile(lock_path):
        with open(lock_path) as probe:
            take_lock(probe, training_args.output_dir, fcntl.LOCK_SH)
    refuse_earlier_run(training_args)


# Copied from run_clm_flax.on_process_zero
def on_process_zero(action, what: str):
    """Run `action` on process 0 alone; its UsageError stops every process (the others with a line naming
    `what` and pointing to process 0). Returns what `action` returns (None on the other processes)."""
    result, failure = None, None
    if jax.process_index() == 0:
        try:
            result = action()
        except UsageError as error:
            failure = error
    if jax.process_count() > 1 and not np.all(multihost_utils.process_allgather(np.asarray(failure is None))):
        raise failure or UsageError(f"process 0 could not {what} (see its error)")
    if failure:
        raise failure
    return result


# Where a run keeps the ids of its W&B and MLflow runs, to report into them again when it is resumed.
# Copied from run_clm_flax.TRACKER_RUNS_FILE
TRACKER_RUNS_FILE = "tracker_runs.json"


# Copied from run_clm_flax.PREVIOUS_RUN_RESULTS
PREVIOUS_RUN_RESULTS = [
    "checkpoints",
    "discarded-checkpoints",
    "tensorboard",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    TRACKER_RUNS_FILE,
]


# Copied from run_clm_flax.clear_previous_run
def clear_previous_run(output_dir: str):
    """For --overwrite_output_dir: remove what an earlier run left that would mix with this run's (checkpoints,
    TensorBoard logs, results). The model files stay, to be overwritten: they may be this run's config or tokenizer."""
    removed = []
    for name in PREVIOUS_RUN_RESULTS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
            removed.append(f"{name}/")
        elif os.path.exists(path):
            os.remove(path)
            removed.append(name)
    if removed:
        logger.warning("--overwrite_output_dir: removed the previous run's %s from %s", ", ".join(removed), output_dir)


# Copied from run_clm_flax.set_aside_checkpoints_after
def set_aside_checkpoints_after(output_dir: str, step: int):
    """Move the training checkpoints after `step` (unreadable ones, or those of a later point the run resumes
    before) to OUTPUT_DIR/discarded-checkpoints, so that this run's saves at those steps are not refused."""
    directory = os.path.join(output_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    later = sorted(int(name) for name in names if name.isdigit() and int(name) > step)
    if not later:
        return
    discarded = os.path.join(output_dir, "discarded-checkpoints")
    os.makedirs(discarded, exist_ok=True)
    for later_step in later:
        target = os.path.join(discarded, str(later_step))
        copies = itertools.count(2)
        while os.path.exists(target):
            target = os.path.join(discarded, f"{later_step}-{next(copies)}")
        os.rename(os.path.join(directory, str(later_step)), target)
    logger.warning("moved the training checkpoints of steps %s to %s", ", ".join(map(str, later)), discarded)


# Copied from run_clm_flax.open_checkpoints
def open_checkpoints(output_dir: str, save_total_limit: int) -> ocp.CheckpointManager:
    """OUTPUT_DIR/checkpoints/STEP. Orbax writes each checkpoint into a temporary directory and renames it once
    complete; an unfinished one is deleted when the directory is next opened. Every process writes its own shards
    into the same directory, so on several hosts OUTPUT_DIR must be on a file system they share (NFS, a bucket)."""
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(output_dir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=save_total_limit, cleanup_tmp_directories=True),
    )


# Copied from run_clm_flax.save_checkpoint
def save_checkpoint(checkpoints: ocp.CheckpointManager, state: TrainState, progress_record: dict):
    """Returns once the arrays are copied off the devices; the files are written while training goes on."""
    step = progress_record["step"]
    started = checkpoints.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress_record))
    )
    if not started:  # Orbax skips a step at or before its newest checkpoint
        raise UsageError(
            f"cannot save training checkpoint {step}: {checkpoints.directory} already holds checkpoint "
            f"{checkpoints.latest_step()}; pass --overwrite_output_dir to start afresh"
        )


# Copied from run_clm_flax.committed_checkpoint
def committed_checkpoint(checkpoints: ocp.CheckpointManager, step: int | None, wait: bool = False) -> int | None:
    """Log when the checkpoint of `step` is complete on disk (a kill after the message loses nothing before it).
    Returns the step still being written, None once none is. Orbax has no hook for this: its
    post_finalization_callback runs before the checkpoint is renamed into place."""
    if wait:
        checkpoints.wait_until_finished()
    if step is None or checkpoints.is_saving_in_progress():
        return step
    path = os.path.join(str(checkpoints.directory), str(step))
    if os.path.isdir(path):
        logger.info("step %d: training checkpoint committed to %s", step, path)
    else:
        logger.warning("step %d: the training checkpoint could not be written to %s", step, path)
    return None


# Copied from run_clm_flax.restore_checkpoint
def restore_checkpoint(
    location: str, output_dir: str, abstract_state: TrainState, progress_keys: list[str]
) -> tuple[TrainState, dict, str] | None:
    """The training state (placed with the shardings of `abstract_state`), the progress record (which must hold
    `progress_keys`) and the path of the checkpoint at `location`: "auto" (the newest complete and readable one in
    output_dir; None if there is none, for a fresh start), a checkpoints directory, or one STEP in it. An unreadable
    checkpoint is skipped with a warning for the next older one, except the one STEP asked for; a checkpoint of
    another model is refused."""
    newest = location == "auto"
    location_path = os.path.normpath(os.path.join(output_dir, "checkpoints") if newest else location)
    if os.path.basename(location_path).isdigit():
        directory, step = os.path.dirname(location_path), int(os.path.basename(location_path))
    else:
        directory, step = location_path, None
    if not os.path.isdir(directory):
        if newest:
            return None
        raise UsageError(f"--resume_from_checkpoint: there are no training checkpoints in {directory}")
    manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(create=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "progress": ocp.JsonCheckpointHandler()},
    )
    with manager:
        # Orbax lists only committed checkpoints (not the temporary directories of unfinished ones).
        steps = sorted(manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise UsageError(
                    f"--resume_from_checkpoint: there is no complete training checkpoint at {location_path}"
                )
            steps = [step]
        for candidate in steps:
            path = os.path.join(directory, str(candidate))
            try:
                progress_args = ocp.args.Composite(progress=ocp.args.JsonRestore())
                progress = manager.restore(candidate, args=progress_args).progress
                if not isinstance(progress, dict) or any(key not in progress for key in progress_keys):
                    raise ValueError("its progress record lacks one of " + ", ".join(progress_keys))
                if progress["step"] != candidate:
                    raise ValueError(f"its progress record is of step {progress['step']}")
                check_checkpoint_fits(path, manager.item_metadata(candidate)["state"], abstract_state)
                # The shapes fit: what fails from here on is the files, not the model.
                args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
                restored, reason = (manager.restore(candidate, args=args).state, progress, path), None
            except UsageError:
                raise
            except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds for damaged files
                restored, reason = None, str(error).splitlines()[0][:300] if str(error) else type(error).__name__
            # Every process takes the same checkpoint, even where only some could not read theirs.
            if jax.process_count() > 1:
                if not np.all(multihost_utils.process_allgather(np.asarray(restored is not None))):
                    restored, reason = None, reason or "another process could not read it"
            if restored:
                return restored
            if not newest:
                raise UsageError(
                    f"the training checkpoint {path} is unreadable ({reason}); resume from an earlier one, or pass "
                    "--resume_from_checkpoint alone for the newest readable one"
                )
            logger.warning("skipping the training checkpoint %s: it is unreadable (%s)", path, reason)
    if newest:
        return None
    raise UsageError(f"--resume_from_checkpoint: there is no readable training checkpoint in {directory}")


# Copied from run_clm_flax.check_checkpoint_fits
def check_checkpoint_fits(path: str, stored_metadata, abstract_state: TrainState):
    """Refuse a checkpoint of another model or optimizer in one line (a mismatch found by the restore itself
    surfaces as a flood of errors from Orbax's background reads)."""

    def shapes(tree) -> dict[str, tuple]:  # the paths of a state and of its checkpoint's metadata are written alike
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape) for path, leaf in leaves}

    stored, needed = shapes(stored_metadata), shapes(abstract_state)
    differing = sorted(name for name in stored.keys() | needed.keys() if stored.get(name) != needed.get(name))
    if differing:
        name = min(differing, key=lambda name: not name.startswith("params/"))  # a parameter first: another config
        is_parameter = name.startswith("params/")
        what, fix = ("parameter", "config") if is_parameter else ("optimizer state array", "optimizer settings")
        raise UsageError(
            f"the checkpoint {path} does not fit this model ({what} {name} has shape {stored.get(name)} there, "
            f"{needed.get(name)} here); resume with the {fix} it was trained with"
        )


# Copied from run_clm_flax.StopRequest
class StopRequest:
    """In its `with` block, Ctrl-C (SIGINT) or a preemption notice (SIGTERM) asks the loop to save a checkpoint and
    stop after the current step. A second Ctrl-C stops at once."""

    def __enter__(self):
        self.signal_name = None
        self._previous_handlers = {
            signal_number: signal.signal(signal_number, self._request)
            for signal_number in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def __exit__(self, *exception):
        for signal_number, handler in self._previous_handlers.items():
            signal.signal(signal_number, handler)

    def _request(self, signal_number, frame):
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signal_number).name
        logger.warning(
            "%s: saving a checkpoint after this step, then stopping (Ctrl-C again stops at once)", self.signal_name
        )

    def requested(self, check_other_processes: bool) -> bool:
        """Whether to stop now. With several processes all must stop at the same step, so they agree on it
        only where `check_other_processes` (the same steps on every process) and otherwise carry on."""
        if jax.process_count() == 1:
            return self.signal_name is not None
        if not check_other_processes:
            return False
        if not np.any(multihost_utils.process_allgather(np.asarray(self.signal_name is not None))):
            return False
        self.signal_name = self.signal_name or "a signal to another process"
        return True


# Copied from run_clm_flax.TensorBoardWriter
class TensorBoardWriter:
    """OUTPUT_DIR/tensorboard, written with the tensorboard package alone (no TensorFlow). It opens with the
    arguments, the model config and an HParams summary: the hyperparameters, and the scalars (`metric_tags`) whose
    last values TensorBoard's HParams tab compares runs by."""

    def __init__(self, output_dir: str, arguments: dict, model_config: dict, metric_tags: list[str]):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2, self._text_pb = event_pb2, summary_pb2, text_pb
        self._writer = EventFileWriter(os.path.join(output_dir, "tensorboard"))
        self.text("arguments", markdown_table(arguments, "argument"))
        config_json = json.dumps(model_config, indent=2, sort_keys=True)
        self.text("model_config", "\n".join("    " + line for line in config_json.split("\n")))
        hparams = hyperparameters(arguments, model_config)

        def data_type(value):
            if isinstance(value, bool):
                return api_pb2.DATA_TYPE_BOOL
            return api_pb2.DATA_TYPE_STRING if isinstance(value, str) else api_pb2.DATA_TYPE_FLOAT64

        # Declared with types but no ranges of values: a range would hide the runs outside it.
        experiment = api_pb2.Experiment(
            hparam_infos=[api_pb2.HParamInfo(name=name, type=data_type(value)) for name, value in hparams.items()],
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_tags],
        )
        summary_metadata = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(experiment=experiment))
        declaration = self._summary_pb2.Summary.Value(
            tag=metadata.EXPERIMENT_TAG, metadata=summary_metadata, tensor=metadata.NULL_TENSOR
        )
        self._write(self._summary_pb2.Summary(value=[declaration]), 0)
        # Named after the output directory: runs with the same hyperparameters would otherwise share a row.
        self._write(summary_v2.hparams_pb(hparams, trial_id=os.path.abspath(output_dir)), 0)

    def _write(self, summary, step: int):
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalars(self, values: dict, step: int):
        summary_values = [
            self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()
        ]
        self._write(self._summary_pb2.Summary(value=summary_values), step)

    def text(self, tag: str, markdown: str, step: int = 0):
        self._write(self._text_pb(tag, markdown), step)

    def results(self, results: dict, step: int):
        self.text("results", markdown_table(results, "result"), step)

    def close(self):
        self._writer.close()


# Copied from run_clm_flax.WandbTracker
class WandbTracker:
    """A Weights & Biases run. W&B's own environment variables choose the project, mode and local directory
    (WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR, ...)."""

    def __init__(self, name: str, run_id: str | None, arguments: dict, model_config: dict):
        import wandb

        self._wandb = wandb
        try:
            self.run = wandb.init(
                name=name,
                id=run_id,
                resume="allow" if run_id else None,
                config={**arguments, "model_config": model_config},
                allow_val_change=True,  # a resumed run may change --max_steps, for one
            )
        except wandb.errors.Error as error:  # not logged in, for one
            raise UsageError(f"--report_to wandb cannot start a run: {error}") from None
        self.run_id = self.run.id
        # Plotted against the training step as a value, not W&B's own step counter: that one must only grow,
        # and a resumed run logs again the steps the interrupted run logged after its last checkpoint.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def scalars(self, values: dict, step: int):
        self.run.log({**values, "train/global_step": step})

    def text(self, tag: str, markdown: str, step: int = 0):
        self.run.log({tag: self._wandb.Html(f"<pre>{html.escape(markdown)}</pre>"), "train/global_step": step})

    def results(self, results: dict, step: int):
        self.run.summary.update(results)

    def close(self):
        self.run.finish()


# Copied from run_clm_flax.MlflowTracker
class MlflowTracker:
    """An MLflow run. MLflow's own environment variables choose where it goes (MLFLOW_TRACKING_URI,
    MLFLOW_EXPERIMENT_NAME, ...)."""

    def __init__(self, name: str, run_id: str | None, arguments: dict, model_config: dict):
        import mlflow

        self._mlflow = mlflow
        try:
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name)
        except mlflow.exceptions.MlflowException as error:
            raise UsageError(f"--report_to mlflow cannot start a run: {error}") from None
        self.run_id = run.info.run_id
        parameters = {**arguments, **{f"model_config/{key}": value for key, value in model_config.items()}}
        # MLflow keeps a parameter's first value: a resumed run adds only the parameters new to it.
        logged = run.data.params
        changed = sorted(name for name, value in parameters.items() if logged.get(name, str(value)) != str(value))
        if changed:
            logger.warning("MLflow keeps the values the run started with for %s", ", ".join(changed))
        mlflow.log_params({name: value for name, value in parameters.items() if name not in logged})

    def scalars(self, values: dict, step: int):
        self._mlflow.log_metrics(values, step=step)

    def text(self, tag: str, markdown: str, step: int = 0):
        self._mlflow.log_text(markdown, f"{tag}/step-{step}.md")

    def results(self, results: dict, step: int):
        numbers = {name: value for name, value in results.items() if type(value) in (int, float)}
        self._mlflow.log_metrics(numbers, step=step)

    def close(self):
        self._mlflow.end_run()


# The trackers of --report_to, each imported from the package of its name (TensorBoard's is a requirement).
# Copied from run_clm_flax.TRACKERS
TRACKERS = ["tensorboard", "wandb", "mlflow"]


# Copied from run_clm_flax.trackers_to_report
def trackers_to_report(report_to: str | list[str]) -> list[str]:
    """--report_to as a list of trackers, as the Hugging Face Trainer reads it: names (a comma list or several
    values), `all` for TensorBoard and every tracker installed, or `none`."""
    values = [report_to] if isinstance(report_to, str) else report_to
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in [*TRACKERS, "all", "none"]]
    if unknown:
        raise UsageError(
            f"--report_to {unknown[0]} is not a tracker; choose from {', '.join(TRACKERS)}, all or none "
            "(several as a comma list)"
        )
    if "none" in names:
        return []
    if "all" in names:
        return [name for name in TRACKERS if importlib.util.find_spec(name)]
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--report_to {missing[0]} needs the {missing[0]} package: pip install {missing[0]}")
    return list(dict.fromkeys(names))


# Copied from run_clm_flax.Trackers
class Trackers:
    """The trackers of --report_to, given the same scalars, texts and results."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def scalars(self, values: dict, step: int):
        for tracker in self.trackers:
            tracker.scalars(values, step)

    def text(self, tag: str, markdown: str, step: int = 0):
        for tracker in self.trackers:
            tracker.text(tag, markdown, step)

    def results(self, results: dict, step: int):
        for tracker in self.trackers:
            tracker.results(results, step)

    def close(self):
        for tracker in self.trackers:
            tracker.close()


# Copied from run_clm_flax.open_trackers
def open_trackers(training_args, resumed: bool, arguments: dict, model_config: dict, metric_tags: list) -> Trackers:
    """The trackers of --report_to, on process 0 only. W&B and MLflow runs are named after the output directory; a
    resumed run reports into the runs it started (their ids are in TRACKER_RUNS_FILE)."""
    if jax.process_index() != 0:
        return Trackers([])
    output_dir = training_args.output_dir
    ids_path = os.path.join(output_dir, TRACKER_RUNS_FILE)
    run_ids = {}
    if resumed and os.path.isfile(ids_path):
        with open(ids_path) as file:
            run_ids = json.load(file)
    trackers = []
    for tracker in training_args.report_to:
        if tracker == "tensorboard":
            trackers.append(TensorBoardWriter(output_dir, arguments, model_config, metric_tags))
            continue
        tracker_class = {"wandb": WandbTracker, "mlflow": MlflowTracker}[tracker]
        name = os.path.basename(os.path.abspath(output_dir))
        trackers.append(tracker_class(name, run_ids.get(tracker), arguments, model_config))
        if trackers[-1].run_id != run_ids.get(tracker):
            run_ids[tracker] = trackers[-1].run_id
            write_json(ids_path, run_ids)
    return Trackers(trackers)


# Arguments about where a run reads and writes, how often it reports and saves, and how it runs, rather than what
# it learns: left out of TensorBoard's HParams table, which then shows what differs between experiments.
# Copied from run_clm_flax.NOT_HYPERPARAMETERS
NOT_HYPERPARAMETERS = set(
    "output_dir overwrite_output_dir do_train do_eval cache_dir overwrite_cache preprocessing_num_workers "
    "packed_data_dir packed_tokens_per_shard allow_pickle_weights mesh_shape per_device_eval_batch_size "
    "logging_steps eval_steps save_steps save_total_limit resume_from_checkpoint report_to sample_prompt "
    "sample_tokens fill_mask_text fill_mask_top_k".split()
)


# Copied from run_clm_flax.hyperparameters
def hyperparameters(arguments: dict, model_config: dict) -> dict:
    """What defines an experiment, for TensorBoard's HParams tab: the arguments that do and the model config,
    those that are bools, numbers or strings."""
    values = {name: value for name, value in arguments.items() if name not in NOT_HYPERPARAMETERS}
    values.update((f"model_config/{name}", value) for name, value in model_config.items())
    return {name: value for name, value in values.items() if type(value) in (bool, int, float, str)}


# Copied from run_clm_flax.markdown_table
def markdown_table(values: dict, name_header: str) -> str:
    """A markdown table of name | value, for TensorBoard's text tab."""
    rows = [f"| {name_header} | value |", "| --- | --- |"]
    rows += [f"| {name} | {value} |" for name, value in sorted(values.items())]
    return "\n".join(rows)


# all_results.json names a result as the Hugging Face examples do where it means the same.
# Copied from run_clm_flax.HUGGING_FACE_RESULT_NAMES
HUGGING_FACE_RESULT_NAMES = {
    "train_runtime_seconds": "train_runtime",
    "epochs": "epoch",
    "eval_perplexity": "perplexity",
}


# Copied from run_clm_flax.write_all_results
def write_all_results(output_dir: str) -> dict:
    """Merge OUTPUT_DIR/train_results.json and eval_results.json (those there are) into all_results.json, as the
    Hugging Face examples do; returns the merged results."""

    def read(name: str) -> dict:
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            return {}
        with open(path) as file:
            return json.load(file)

    results = {}
    for name in ("train_results.json", "eval_results.json"):
        results.update((HUGGING_FACE_RESULT_NAMES.get(key, key), value) for key, value in read(name).items())
    if read("all_results.json") != results:  # a repeat of a complete run leaves the file as it was
        write_json(os.path.join(output_dir, "all_results.json"), results)
    return results


# Copied from run_clm_flax.write_json
def write_json(path: str, values: dict):
    """Write via a temporary file, so an interrupted write never leaves a truncated file behind."""
    temporary_path = f"{path}.tmp"
    with open(temporary_path, "w") as file:
        json.dump(values, file, indent=2)
        file.write("\n")
    os.replace(temporary_path, path)


# Copied from run_clm_flax.evaluated_step
def evaluated_step(output_dir: str) -> int | None:
    """The step of the evaluation in OUTPUT_DIR/eval_results.json; None if there is none."""
    try:
        with open(os.path.join(output_dir, "eval_results.json")) as file:
            return json.load(file).get("step")
    except (OSError, ValueError, AttributeError):
        return None


# Copied from run_clm_flax.write_model_weights
def write_model_weights(output_dir: str, state_dict: dict[str, np.ndarray]):
    """model.safetensors in `output_dir`, replaced in one step so that no reader sees it half written."""
    os.makedirs(output_dir, exist_ok=True)
    weights_path = os.path.join(output_dir, "model.safetensors")
    save_file(state_dict, f"{weights_path}.tmp", metadata={"format": "pt"})
    # safetensors writes 0600; the other files follow the umask. It can only be read by setting it: to the strictest
    # value, so that a file another thread creates meanwhile is never more open than the user asked for.
    umask = os.umask(0o077)
    os.umask(umask)
    os.chmod(f"{weights_path}.tmp", 0o666 & ~umask)
    os.replace(f"{weights_path}.tmp", weights_path)


def save_model(output_dir: str, params, config, tokenizer):
    """A Hugging Face model directory: config, safetensors weights, tokenizer.

    Every process takes part in gathering the parameters; process 0 writes.
    """
    host_params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return
    write_model_weights(output_dir, to_hf_state_dict(host_params))
    config.architectures = ["RobertaForMaskedLM"]  # what AutoModelForMaskedLM and pipeline("fill-mask") build
    config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


# ----------------------------------------------------------------------------------------------------
# Appendix: packed-corpus storage
# ----------------------------------------------------------------------------------------------------


# A packed corpus is a directory of token rows (blocks of grouped texts, or lines padded with the pad token): for
# each split, .npy shards of shape (rows, block_size) named SPLIT-00000.npy, SPLIT-00001.npy, ..., and an
# index.json describing them, written last: a directory without index.json is an unfinished one, never read.
# Ids are stored as uint16 when the vocabulary fits (half the disk of int32) and always read as int32.
# Copied from run_clm_flax.PACKED_INDEX_FILE
PACKED_INDEX_FILE = "index.json"


# Copied from run_clm_flax.PACKED_FORMAT_VERSION
PACKED_FORMAT_VERSION = 2  # 2: a .txt file is one document unless --text_sample_by says otherwise


# Copied from run_clm_flax.packed_dtype
def packed_dtype(tokenizer) -> np.dtype:
    """uint16 when every id of the tokenizer fits in it, int32 otherwise."""
    largest_id = max(len(tokenizer), tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)) - 1
    return np.dtype(np.uint16) if largest_id <= np.iinfo(np.uint16).max else np.dtype(np.int32)


# Copied from run_clm_flax.fingerprint
def fingerprint(value) -> str:
    """A short hash of a JSON value: the names of cached corpora, and the tokenizer a packed corpus records."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


# Copied from run_clm_flax.packed_description
def packed_description(tokenizer, block_size: int, framing: str, source: dict) -> dict:
    """What a packed corpus holds, recorded in its index: the block size, how texts became rows (grouped, or
    line_by_line), the data it was packed from and a fingerprint of everything in the tokenizer that changes the ids
    (vocabulary, merges, normalisation, special tokens)."""
    settings = json.loads(tokenizer.backend_tokenizer.to_str())
    for transient in ("truncation", "padding"):  # set by calls to the transformers wrapper, not part of the ids
        settings.pop(transient, None)
    tokenizer_settings = {
        "tokenizer": settings,
        "eos_token_id": tokenizer.eos_token_id,
        "encode_special_tokens": tokenizer.backend_tokenizer.encode_special_tokens,
    }
    return {
        "block_size": block_size,
        "framing": framing,
        "tokenizer_fingerprint": fingerprint(tokenizer_settings),
        "source": source,
    }


# Copied from run_clm_flax.write_packed_split
def write_packed_split(blocks: Iterable[np.ndarray], directory: str, split: str, dtype, blocks_per_shard: int) -> dict:
    """Write the block arrays of one split as shards of `blocks_per_shard` blocks (the last one may be
    shorter) and return the split's entry of the index.

    Memory stays bounded whatever the corpus size: each shard is filled through a memory map of its file
    and written under a temporary name, then renamed. No shard is written for an empty split.
    """
    dtype = np.dtype(dtype)
    largest = np.iinfo(dtype).max
    shards, shard, filled, num_blocks = [], None, 0, 0

    def finish_shard():
        name = f"{split}-{len(shards):05d}.npy"
        if filled == len(shard):
            shard.flush()
            written_path = shard.filename
        else:  # the last shard, shorter: copied into a file of its own size
            written_path = os.path.join(directory, f"{name}.{os.getpid()}.end.tmp.npy")
            np.save(written_path, shard[:filled], allow_pickle=False)
            os.remove(shard.filename)
        os.replace(written_path, os.path.join(directory, name))
        shards.append({"file": name, "num_blocks": filled})

    for block_array in blocks:
        if len(block_array) and (block_array.min() < 0 or block_array.max() > largest):
            raise ValueError(f"token ids outside the range of {dtype.name}; the packed corpus needs a wider dtype")
        start = 0
        while start < len(block_array):
            if shard is None:
                name = f"{split}-{len(shards):05d}.npy"
                shard = np.lib.format.open_memmap(
                    os.path.join(directory, f"{name}.{os.getpid()}.tmp.npy"),
                    mode="w+",
                    dtype=dtype,
                    shape=(blocks_per_shard, block_array.shape[1]),
                )
                filled = 0
            count = min(blocks_per_shard - filled, len(block_array) - start)
            shard[filled : filled + count] = block_array[start : start + count]
            filled, start, num_blocks = filled + count, start + count, num_blocks + count
            if filled == blocks_per_shard:
                finish_shard()
                shard = None
    if shard is not None:
        finish_shard()
        del shard
    return {"num_blocks": num_blocks, "shards": shards}


# Copied from run_clm_flax.write_packed_corpus
def write_packed_corpus(directory: str, splits: dict, description: dict, dtype, tokens_per_shard: int) -> dict:
    """Pack each split's row arrays ({split: iterable of (count, block_size) arrays}) into `directory`, then write
    the index (with `description`, from packed_description) and return it.

    The index is removed first and written last, so an interrupted write leaves a directory that is
    recognised as unfinished; shards left by an earlier unfinished write are replaced.
    """
    os.makedirs(directory, exist_ok=True)
    index_path = os.path.join(directory, PACKED_INDEX_FILE)
    if os.path.exists(index_path):
        os.remove(index_path)
    split_names = "|".join(map(re.escape, splits))
    leftover = re.compile(rf"^({split_names})-\d{{5}}\.npy(\.\d+(\.end)?\.tmp\.npy)?$")
    for name in os.listdir(directory):
        if leftover.match(name):
            os.remove(os.path.join(directory, name))
    blocks_per_shard = max(1, tokens_per_shard // description["block_size"])
    index = {
        "format_version": PACKED_FORMAT_VERSION,
        **description,
        "dtype": np.dtype(dtype).name,
        "blocks_per_shard": blocks_per_shard,
        "splits": {
            split: write_packed_split(blocks, directory, split, dtype, blocks_per_shard)
            for split, blocks in splits.items()
        },
    }
    temporary_path = f"{index_path}.{os.getpid()}.tmp"
    with open(temporary_path, "w") as file:
        json.dump(index, file, indent=2)
    os.replace(temporary_path, index_path)
    return index


# Copied from run_clm_flax.read_packed_index
def read_packed_index(directory: str) -> dict | None:
    """The index of the packed corpus in `directory`, or None when there is no finished one."""
    path = os.path.join(directory, PACKED_INDEX_FILE)
    try:
        with open(path) as file:
            index = json.load(file)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        index = None
    if not (isinstance(index, dict) and "format_version" in index and "splits" in index):
        raise UsageError(f"{path} is not the index of a packed corpus; use another directory for the packed data")
    return index


# Copied from run_clm_flax.packed_shards_problem
def packed_shards_problem(directory: str, index: dict) -> str | None:
    """What is wrong with the shard files of a packed corpus whose index is intact (a shard missing, cut short, or of
    another shape than the index says), or None. Found here, before training, rather than when a shard is first
    memory-mapped, maybe hours into the run."""
    for entry in index["splits"].values():
        for shard in entry["shards"]:
            try:  # mapping the file checks its header, and that it holds every element the header promises
                shape = np.load(os.path.join(directory, shard["file"]), mmap_mode="r").shape
            except (OSError, ValueError, EOFError) as error:
                return f"{shard['file']} is cut short or unreadable ({error})"
            expected = (shard["num_blocks"], index["block_size"])
            if shape != expected:
                return f"{shard['file']} holds an array of shape {shape}, not the {expected} the index lists"
    return None


# Copied from run_clm_flax.PackedBlocks
class PackedBlocks:
    """The blocks of one split of a packed corpus, indexed like a (num_blocks, block_size) int32 array:
    `len`, an integer, a slice (a view, nothing read), or an array of indices (those blocks, read).

    Shards are memory-mapped when first needed (the most recent few kept open), so a process reads
    only the blocks it asks for, whatever the size of the corpus.
    """

    dtype = np.dtype(np.int32)
    ndim = 2
    open_shards = 64

    def __init__(self, directory: str, split_entry: dict, block_size: int, start: int = 0, stop: int | None = None):
        self.directory, self.split_entry, self.block_size = directory, split_entry, block_size
        sizes = [shard["num_blocks"] for shard in split_entry["shards"]]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        total = int(self.shard_starts[-1])
        self.start, self.stop = start, total if stop is None else stop
        self.shard = functools.lru_cache(maxsize=self.open_shards)(self.open_shard)

    def open_shard(self, shard_number: int) -> np.ndarray:
        return np.load(os.path.join(self.directory, self.split_entry["shards"][shard_number]["file"]), mmap_mode="r")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.block_size)

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(len(self))
            view = copy.copy(self)
            view.start, view.stop = self.start + start, self.start + max(start, stop)
            return view
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        positions = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if positions.dtype == bool or not np.issubdtype(positions.dtype, np.integer):
            raise IndexError("PackedBlocks takes an integer, a slice or an array of integer indices")
        positions = np.where(positions < 0, positions + len(self), positions)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} blocks")
        return self.read(positions + self.start)

    def read(self, positions: np.ndarray) -> np.ndarray:
        """The blocks at these positions of the whole split, in the order given."""
        blocks = np.empty((*positions.shape, self.block_size), dtype=np.int32)
        shard_numbers = np.searchsorted(self.shard_starts, positions, side="right") - 1
        for shard_number in np.unique(shard_numbers):
            chosen = shard_numbers == shard_number
            blocks[chosen] = self.shard(int(shard_number))[positions[chosen] - self.shard_starts[shard_number]]
        return blocks

    def __array__(self, dtype=None, copy=None):
        blocks = self.read(np.arange(self.start, self.stop))
        return blocks if dtype is None else blocks.astype(dtype, copy=False)


# Copied from run_clm_flax.open_packed_corpus
def open_packed_corpus(directory: str, index: dict) -> dict[str, PackedBlocks]:
    blocks = {split: PackedBlocks(directory, entry, index["block_size"]) for split, entry in index["splits"].items()}
    for split, split_blocks in blocks.items():
        logger.info(
            "%s: %d packed blocks of %d tokens in %s", split, len(split_blocks), index["block_size"], directory
        )
    return blocks


# What an interrupted run leaves in the cache directory: unfinished packed corpora.
# Copied from run_clm_flax.STALE_TEMPORARY_NAME
STALE_TEMPORARY_NAME = re.compile(r"packed-.*\.\d+\.tmp")


# Copied from run_clm_flax.STALE_AFTER_SECONDS
STALE_AFTER_SECONDS = 600


# Copied from run_clm_flax.remove_stale_temporary_files
def remove_stale_temporary_files(cache_dir: str):
    """Remove the temporary files that runs killed mid-tokenization left behind (about the size of the tokens each).
    Only files untouched for STALE_AFTER_SECONDS go: a live run, this one or another sharing the cache, writes to
    its own every few seconds."""
    for entry in os.scandir(cache_dir):
        if STALE_TEMPORARY_NAME.fullmatch(entry.name) and time.time() - entry.stat().st_mtime > STALE_AFTER_SECONDS:
            logger.info("Removing %s, left in the cache by an interrupted run", entry.path)
            if entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


if __name__ == "__main__":
    try:
        main()
    except Exception as error:
        message = user_error_message(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
