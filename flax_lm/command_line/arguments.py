"""The arguments both training scripts take, and the checks that refuse a mistake before any work starts.

Each script adds its own (the sequence length, its data framing, what it shows at evaluation) by subclassing
CommonDataArguments and CommonTrainingArguments.
"""

import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields

import jax
from transformers import HfArgumentParser

from flax_lm.command_line.settings import ModelSettingsFromFlags, ProcessGroupFromFlags, TrainingSettingsFromFlags
from flax_lm.command_line.trainer_flags import (
    refuse_unknown_arguments,
    with_alias_values,
    with_flags_renamed,
    with_keys_renamed,
)
from flax_lm.data.loading import DataRoute
from flax_lm.data.mixture import check_mixture
from flax_lm.data.packed import PACKED_TOKENS_PER_SHARD
from flax_lm.data.source import TextSource
from flax_lm.devices.mesh import create_mesh
from flax_lm.errors import UsageError, check_writable_directory
from flax_lm.models.huggingface import check_local_model_directory, shard_size_in_bytes
from flax_lm.models.tokenizer_files import check_chat_template
from flax_lm.run.record import allowed_resume_changes
from flax_lm.run.tracking import trackers_to_report
from flax_lm.training.compilation import use_compilation_cache


@dataclass
class ModelArguments(ModelSettingsFromFlags):
    """Which model, config and tokenizer to start from, and how the model computes."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint of this script's model to continue from: a local directory holding "
            "config.json and model.safetensors, or a hub name. Leave unset to train from scratch."
        },
    )
    model_type: str | None = field(
        default=None,
        metadata={
            "help": "The model type to train from scratch without --config_name, with its default configuration: "
            "gpt2 (the default of run_clm_flax.py), llama, mistral, qwen2, qwen3, gemma2, gemma3_text, olmo2, gptj, "
            "gpt_neox or opt; roberta for run_mlm_flax.py. With a config, its model_type chooses the model."
        },
    )
    model_file: str | None = field(
        default=None,
        metadata={
            "help": "A model module of the experiment's own, to compute the config's model type instead of flax_lm's: "
            "a copy of flax_lm/models/gpt2/model.py (or llama/, gemma/, olmo2/, roberta/ ...), edited. The run "
            "directory keeps it; give it again to resume, and to load the exports with generate_flax.py."
        },
    )
    skip_export_check: bool = field(
        default=False, metadata={"help": "Skip the export check: exports of a --model_file then name no architecture."}
    )
    config_name: str | None = field(default=None, metadata={"help": "Directory or hub name, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Directory or hub name, if not the model's."})
    chat_template_path: str | None = field(
        default=None,
        metadata={
            "help": "A chat template (a Jinja file, or a tokenizer directory whose chat_template.jinja it takes) to "
            "render the conversations with, in place of the tokenizer's; the export carries it."
        },
    )
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


@dataclass
class CommonDataArguments:
    """Where the texts come from and how they are read, tokenized and stored; each script adds its sequence length."""

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
    train_file: list[str] | None = field(
        default=None,
        metadata={
            "help": "Training text: .txt, .json/.jsonl, .csv or .parquet files or globs such as 'data/*.txt' "
            "('**' matches subdirectories), listed or each after its own --train_file, formats mixed as they come; "
            "the text formats also compressed (.gz, .bz2, .xz, .zst), e.g. corpus.jsonl.gz.",
            "action": "extend",
        },
    )
    validation_file: list[str] | None = field(
        default=None,
        metadata={"help": "Evaluation text, in the same forms as --train_file.", "action": "extend"},
    )
    data_mixture: str | None = field(
        default=None,
        metadata={
            "help": "A YAML or JSON file naming several sources of text, each with a weight, its train_file and "
            "optionally its validation_file (files and globs relative to the mixture file): training batches draw "
            "rows from the sources in proportion to their weights, and each source is evaluated on its own. Instead "
            "of --train_file, --validation_file and --dataset_name."
        },
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
        default=None, metadata={"help": "Keep only this many training examples (for quick runs and debugging)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation examples."})
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Tokenize and pack again even if a cached result exists."}
    )
    validation_split_percentage: int = field(
        default=5,
        metadata={
            "help": "Without a validation split, the first this percent of the training examples (after packing, "
            "so that a corpus of one document can be split too) are held out for evaluation, with --do_eval only "
            "(without, every example is trained on); 0: none."
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the texts (spawned); by default one a core, after a few seconds"},
    )
    preprocessing_piece_mb: float = field(
        default=1.0,
        metadata={"help": "Megabytes of text tokenized at a time; memory holds a few a worker (docs/scaling.md)"},
    )
    text_sample_by: str | None = field(
        default=None,
        metadata={
            "help": "What one text (document) of a .txt file is, each ended by the end-of-text token: 'document' (the "
            "whole file, as written; the default), 'paragraph' (text between blank lines) or 'line' (the default of "
            "run_mlm_flax.py --line_by_line, where each text is one example). Rows of other formats are always one "
            "text each.",
            "choices": ["document", "paragraph", "line"],
        },
    )
    keep_linebreaks: bool = field(
        default=True,
        metadata={"help": "With --text_sample_by line, keep the line break at the end of each line."},
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the data as a stream, never copied to disk first: for corpora larger than memory or disk. "
            "Alone, texts are tokenized and packed on the fly while training, which needs --max_steps; with "
            "--packed_data_dir, the stream is packed into its shards once and training reads those."
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
            "help": "A directory of packed token rows in memory-mappable shards. Used as it is when it holds the "
            "data packed with this tokenizer, sequence length and framing; otherwise the data arguments are tokenized "
            "and packed into it first (by process 0). Later runs and every process read only the rows they need, "
            "nothing is tokenized again. Refused when packed with another tokenizer, length, framing or data."
        },
    )
    packed_tokens_per_shard: int = field(
        default=PACKED_TOKENS_PER_SHARD,
        metadata={
            "help": "Tokens per shard file of a packed corpus, in --packed_data_dir or the token cache under "
            "--cache_dir (rounded down to whole blocks)."
        },
    )
    # How texts become the rows of a packed corpus, recorded in it so that one is never read as the other: "grouped"
    # (texts joined and cut into blocks), or "line_by_line" (a row per line, run_mlm_flax.py --line_by_line); examples
    # are framed as their format, told from the data's columns once they are read (flax_lm.data.finetune_examples).
    framing = "grouped"

    def example_settings(self):
        """How examples are read (flax_lm.data.source.ExampleSettings); None: only plain text is."""
        return None

    def text_source(self, model_args) -> TextSource:
        """Where the texts are and how they are read, as the data layer takes it."""
        names = ("train_file", "validation_file", "dataset_name", "dataset_config_name", "text_column_name")
        names += ("text_sample_by", "keep_linebreaks", "skip_missing_texts")
        values = {name: getattr(self, name) for name in names} | {"examples": self.example_settings()}
        return TextSource(**values, cache_dir=model_args.cache_dir, token=model_args.token)

    def data_route(self, model_args, training_args) -> DataRoute:
        """Which route the rows take and what the run keeps of them, as flax_lm.data.loading.load_data takes it."""
        names = ("data_mixture", "packed_data_dir", "streaming", "validation_split_percentage", "max_train_samples")
        names += ("max_eval_samples", "overwrite_cache", "packed_tokens_per_shard", "preprocessing_piece_mb")
        values = {name: getattr(self, name) for name in names}
        return DataRoute(self.text_source(model_args), training_args.do_train, training_args.do_eval, **values)


@dataclass
class CommonTrainingArguments(TrainingSettingsFromFlags):
    """The training arguments both scripts take; each script's TrainingArguments adds its own."""

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
    fp8: bool = field(default=False, metadata={"help": "The train step's dense products in FP8 (docs/scaling.md)."})
    mesh_shape: str | None = field(
        default=None,
        metadata={
            "help": "How the devices are arranged, e.g. data=2,fsdp=2,tensor=2: the batch is split over data, fsdp "
            "and expert; parameters, gradients and optimizer state over fsdp (like ZeRO-3); a mixture of experts' "
            "experts over expert (data=2,expert=4); attention heads, MLP columns and the vocabulary over tensor "
            "(Megatron-style tensor parallelism). Default: data=all devices."
        },
    )
    optim: str = field(
        default="adamw",
        metadata={
            "help": "The optimizer, one of the script's OPTIMIZERS: {names}. muon: Muon for the 2-D kernels of the "
            "blocks, AdamW for embeddings, output layer, norms and biases."
        },
    )
    learning_rate: float = field(
        default=5e-5, metadata={"help": "Peak learning rate (with --optim muon, that of the AdamW parameters)."}
    )
    muon_learning_rate: float = field(
        default=0.02,
        metadata={"help": "With --optim muon: the peak learning rate of the matrices Muon trains (same schedule)."},
    )
    muon_momentum: float = field(default=0.95, metadata={"help": "With --optim muon: Muon's momentum."})
    weight_decay: float = field(
        default=0.0,
        metadata={
            "help": "Decoupled weight decay (times the learning rate) of AdamW, Muon, Lion and Adafactor; biases "
            "and LayerNorm parameters are never decayed."
        },
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW's beta1, and Lion's."})
    adam_beta2: float = field(
        default=0.999, metadata={"help": "AdamW's beta2, and Lion's (which usually takes 0.99)."}
    )
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
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
            "help": "The learning rate after warm-up, one of the script's LEARNING_RATE_SCHEDULES: {names}. linear "
            "and cosine decay to --min_lr_rate of the peak; warmup_stable_decay holds the peak, then decays over the "
            "last --lr_decay_ratio of the steps."
        },
    )
    lr_decay_ratio: float = field(
        default=0.2,
        metadata={"help": "With warmup_stable_decay: the decay's share of all the run's steps, at its end."},
    )
    lr_decay_shape: str = field(
        default="linear",
        metadata={
            "help": "With warmup_stable_decay: the decay's shape, one of the script's DECAY_SHAPES: linear, cosine "
            "or 1-sqrt."
        },
    )
    min_lr_rate: float = field(
        default=0.0,
        metadata={
            "help": "Where a decay ends, as a fraction of the peak learning rate: 0.1 ends at a tenth of it "
            "(nanoGPT's min_lr); 0 decays to 0."
        },
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip gradients to this global norm; 0: no clipping."})
    logging_steps: int = field(default=500, metadata={"help": "Steps between log lines of the training loss."})
    steps_per_call: int | None = field(
        default=None,
        metadata={
            "help": "Training steps run in one compiled call, looping on the devices over their batches: between "
            "the steps of a small model, returning to Python costs as much as the step itself. A call ends at "
            "every step that logs, evaluates or saves, and a stop waits for the call to end; the losses do not "
            "depend on it. Default: 8 on a CPU, 1 on GPUs and TPUs, whose steps are queued ahead anyway."
        },
    )
    compilation_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where compiled steps are kept, so that the next run of the same model, shapes and flags starts "
            "without compiling them (JAX's persistent compilation cache, shared safely by processes and runs, at "
            "most 4 GB). Default: JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/flax_lm/compilation "
            "(~/.cache/flax_lm/compilation); none to compile afresh every run."
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "help": "Where to report the metrics, arguments and results: tensorboard, wandb, mlflow (each needs its "
            "package), all (TensorBoard and the others installed) or none; several as a comma list."
        },
    )
    save_steps: int = field(default=500, metadata={"help": "Steps between saves of a checkpoint and the model."})
    max_shard_size: str | None = field(
        default=None,
        metadata={
            "help": "Split the exported model.safetensors into shards of at most this size (5GB, 500MB, 2GiB, or "
            "bytes), with their index model.safetensors.index.json, as save_pretrained does; default: one file."
        },
    )
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
    allow_resume_changes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "With --resume_from_checkpoint: what this run may change of the run it continues that changes the "
            "training, which is otherwise refused (the names the refusal gives: flags such as learning_rate, or "
            "config, tokenizer, training_data, model_code, global_batch_size, mixture_weights; all for any), comma "
            "separated. Each change is recorded with the step it starts at, in the checkpoints and "
            "train_results.json.",
            "action": "extend",
        },
    )
    skip_nonfinite_steps: bool = field(
        default=False,
        metadata={"help": "Skip an update whose loss or gradient norm is not finite, instead of stopping."},
    )
    eval_steps: int | None = field(default=None, metadata={"help": "Evaluate this often; default: --logging_steps."})
    eval_strategy: str = field(
        default="steps",
        metadata={
            "help": "When to evaluate while training (with --do_eval): every --eval_steps (steps), at the end of "
            "each epoch (epoch), or only after training (no).",
            "choices": ["steps", "epoch", "no"],
        },
    )
    save_strategy: str = field(
        default="steps",
        metadata={
            "help": "When to save a checkpoint and export the model: every --save_steps (steps), at the end of each "
            "epoch (epoch), or only at the end of training (no; the export needs that one).",
            "choices": ["steps", "epoch", "no"],
        },
    )
    eval_on_start: bool = field(
        default=False, metadata={"help": "With --do_eval, evaluate the model before the first step (at step 0)."}
    )
    load_best_model_at_end: bool = field(
        default=False,
        metadata={"help": "Export and evaluate finally the saved step best by --metric_for_best_model, not the last."},
    )
    metric_for_best_model: str | None = field(
        default=None,
        metadata={"help": "The evaluation metric that picks the best model: loss (the default), eval_perplexity..."},
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={"help": "Whether a greater metric is better; default: not for a loss.", "nargs": "?", "const": True},
    )
    logging_first_step: bool = field(
        default=False, metadata={"help": "Log the first step as well as every --logging_steps."}
    )
    logging_dir: str | None = field(
        default=None, metadata={"help": "Where TensorBoard's event files go; default: OUTPUT_DIR/tensorboard."}
    )
    run_name: str | None = field(
        default=None,
        metadata={"help": "The run's name in W&B and MLflow; default: the name of --output_dir."},
    )
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
class DistributedArguments(ProcessGroupFromFlags):
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


def parse_training_arguments(
    model_arguments, data_arguments, training_arguments, flag_tables: dict | None = None
) -> tuple:
    """The command line (or a single .json file of arguments) as the script's three argument dataclasses and
    DistributedArguments. Trainer's and TRL's names for our flags are taken as ours (FLAG_ALIASES). `flag_tables`:
    {flag: the script's table of what it names} ({"optim": OPTIMIZERS}), whose names the flag's --help lists, those
    of the script that runs (a copy's own entries included)."""
    parser = HfArgumentParser((model_arguments, data_arguments, training_arguments, DistributedArguments))
    for action in parser._actions:
        if action.help and "{names}" in action.help:
            table = (flag_tables or {}).get(action.dest)
            action.help = action.help.replace("{names}", ", ".join(table) if table else "see the table")
    known = {item.name for group in parser.dataclass_types for item in fields(group)}
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        try:
            with open(sys.argv[1]) as file:
                values = json.load(file)
            if not isinstance(values, dict):
                raise ValueError("it must hold one JSON object of argument names and values")
            values = with_keys_renamed(values, known)
            refuse_unknown_arguments([f"--{name}" for name in values if name not in known])
            # One file where the command line takes several ("train_file": "data.txt"), as the flag given once.
            for name in ("train_file", "validation_file"):
                if isinstance(values.get(name), str):
                    values[name] = [values[name]]
            return with_alias_values(parser.parse_dict(values))
        except (OSError, TypeError, ValueError) as error:
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    *arguments, unknown = parser.parse_args_into_dataclasses(
        args=with_flags_renamed(sys.argv[1:], known), return_remaining_strings=True
    )
    refuse_unknown_arguments(unknown)
    return with_alias_values(tuple(arguments))


def recorded_arguments(*argument_groups) -> dict:
    """All arguments as one dict, as the checkpoints and the trackers record them: the hub token is never written."""
    arguments = {name: value for group in argument_groups for name, value in asdict(group).items()}
    del arguments["token"]
    return arguments


def check_common_arguments(model_args, data_args, training_args, evaluates_without_data: bool = False):
    """The checks both training scripts make before any work, each refusal one line; fills in the defaults that
    depend on other arguments. Call it after initialize_distributed, which checks the distributed flags before the
    processes join: the check of --dtype asks JAX for the platform, and JAX must not start before then.
    `evaluates_without_data`: the script evaluates by other means too (run_clm_flax.py's --eval_tasks), so that an
    evaluation needs no data of its own."""
    training_args.report_to = trackers_to_report(training_args.report_to)
    if not (training_args.do_train or training_args.do_eval or data_args.packed_data_dir):
        # As the Hugging Face Flax examples do: train (given training data) and evaluate.
        training_args.do_train = any(
            getattr(data_args, name) is not None for name in ("train_file", "dataset_name", "data_mixture")
        )
        training_args.do_eval = True
    if data_args.data_mixture:
        others = ("train_file", "validation_file", "dataset_name", "streaming", "packed_data_dir")
        check_mixture(
            data_args.data_mixture, training_args.do_train, [name for name in others if getattr(data_args, name)]
        )
    has_data = any(getattr(data_args, name) is not None for name in ("train_file", "dataset_name", "data_mixture"))
    if not (data_args.data_route(model_args, training_args).names_data() or evaluates_without_data):
        raise UsageError("no data: pass --train_file (and optionally --validation_file) or --dataset_name")
    if training_args.do_train and not has_data and not data_args.packed_data_dir:
        raise UsageError("--do_train needs --train_file or --dataset_name")
    data_args.text_sample_by = data_args.text_sample_by or "document"
    if data_args.text_sample_by not in ("document", "paragraph", "line"):  # a JSON file of arguments skips argparse
        raise UsageError(f"--text_sample_by {data_args.text_sample_by} is not one of document, paragraph, line")
    if not data_args.keep_linebreaks and data_args.text_sample_by != "line":
        raise UsageError(
            f"--keep_linebreaks False applies to --text_sample_by line only; with --text_sample_by "
            f"{data_args.text_sample_by} the text is read as written, line breaks included"
        )
    for flag in ("eval_strategy", "save_strategy"):  # a JSON file of arguments skips argparse's choices
        if getattr(training_args, flag) not in ("steps", "epoch", "no"):
            raise UsageError(f"--{flag} {getattr(training_args, flag)} is not one of steps, epoch, no")
        if getattr(training_args, flag) == "epoch" and data_args.streaming and not data_args.packed_data_dir:
            raise UsageError(
                f"--{flag} epoch needs the length of an epoch, which a --streaming run does not know; pass --{flag} "
                f"steps with --{flag.split('_')[0]}_steps"
            )
    if training_args.max_shard_size is not None:
        try:
            shard_size_in_bytes(training_args.max_shard_size)
        except ValueError:
            raise UsageError(
                f"--max_shard_size {training_args.max_shard_size} is not a size; pass one such as 5GB, 500MB, 2GiB or "
                "a number of bytes"
            ) from None
    if training_args.do_train and training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise UsageError("no training steps: set --num_train_epochs or --max_steps to a positive number")
    names = {item.name for group in (model_args, data_args, training_args) for item in fields(group)}
    resumes, allowed = bool(training_args.resume_from_checkpoint), training_args.allow_resume_changes
    training_args.allow_resume_changes = allowed_resume_changes(allowed, resumes, names)
    check_chat_template(model_args.chat_template_path)
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
    for name in ("model_name_or_path", "config_name", "tokenizer_name"):
        if getattr(model_args, name):
            check_local_model_directory(f"--{name}", getattr(model_args, name))
    # A jax.checkpoint_policies name, or true or false as for the Hugging Face flag, a boolean.
    policy = model_args.gradient_checkpointing
    policy = {"true": "nothing_saveable", "false": None}.get(str(policy).lower(), policy)
    if policy not in (None, "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        raise UsageError(
            f"--gradient_checkpointing {policy} is not a policy: give none (or true) to keep nothing, or "
            "dots_saveable or dots_with_no_batch_dims_saveable"
        )
    model_args.gradient_checkpointing = policy
    if training_args.steps_per_call is None:
        training_args.steps_per_call = default_steps_per_call()
    if model_args.dtype == "float16" and jax.default_backend() == "cpu":
        raise UsageError(
            "--dtype float16 does not run on CPU, where XLA cannot multiply float16 matrices into float32 "
            "results; use --dtype bfloat16 or float32 here, and float16 on a GPU"
        )
    create_mesh(training_args.mesh_shape)  # refuses a --mesh_shape that does not fit the devices
    check_writable_directory(training_args.output_dir, "output_dir")
    if model_args.cache_dir is not None:  # where `datasets` writes what it reads and the token cache lives
        check_writable_directory(model_args.cache_dir, "cache_dir")
    if training_args.compilation_cache_dir not in (None, "none"):
        check_writable_directory(training_args.compilation_cache_dir, "compilation_cache_dir")
    use_compilation_cache(training_args.compilation_cache_dir)  # before the first compilation


def default_steps_per_call() -> int:
    """Several steps per compiled call on a CPU, where the host waits for each step; one on GPUs and TPUs, where the
    host queues the next steps while the devices compute."""
    return 8 if jax.default_backend() == "cpu" else 1


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
        "steps_per_call": (lambda value: value is None or value >= 1, "must be at least 1"),
        "learning_rate": (lambda value: value > 0, "must be positive, such as 3e-4"),
        "weight_decay": at_least_0,
        "adam_beta1": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.9"),
        "adam_beta2": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.999"),
        "adam_epsilon": (lambda value: value >= 0, "must be 0 or more, such as 1e-8"),
        "muon_learning_rate": (lambda value: value > 0, "must be positive, such as 0.02"),
        "muon_momentum": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.95"),
        "lr_decay_ratio": (lambda value: 0 <= value <= 1, "must be in [0, 1], such as 0.2"),
        "max_grad_norm": (lambda value: value >= 0, "must be 0 (no clipping) or more"),
        "num_train_epochs": at_least_0,
        "max_steps": (lambda value: value == -1 or value >= 1, "must be positive, or -1 for --num_train_epochs"),
        "warmup_steps": at_least_0,
        "warmup_ratio": (lambda value: 0 <= value < 1, "must be in [0, 1)"),
        "min_lr_rate": (lambda value: 0 <= value < 1, "must be in [0, 1), such as 0.1"),
        "seed": at_least_0,
        "max_train_samples": (lambda value: value is None or value >= 1, "must be at least 1; leave it out for all"),
        "max_eval_samples": (lambda value: value is None or value >= 1, "must be at least 1; leave it out for all"),
        "preprocessing_num_workers": (lambda value: value is None or value >= 1, "must be at least 1"),
        "preprocessing_piece_mb": (lambda value: value > 0, "must be positive"),
        "validation_split_percentage": (lambda value: 0 <= value < 100, "must be between 0 (none) and 99"),
        "shuffle_buffer_size": (lambda value: value >= 0, "must be 0 (the stream's order) or more"),
        "packed_tokens_per_shard": at_least_1,
        **script_ranges,
    }
    for name, (in_range, requirement) in ranges.items():
        value = next(getattr(group, name) for group in argument_groups if hasattr(group, name))
        if not in_range(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise UsageError(f"--{name} {value} {requirement}")
    # No flag means anything at NaN or Infinity, a script's own flags without a range above included.
    for group in argument_groups:
        for argument in fields(group):
            value = getattr(group, argument.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{argument.name} {value} is not a finite number")
