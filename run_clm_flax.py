#!/usr/bin/env python3
"""Pretrain a causal language model (GPT-2, Llama) with JAX/Flax.

Trains from scratch (a config and a tokenizer, for example from create_config.py and train_tokenizer.py) or continues
from a Hugging Face checkpoint, on text from local files (txt, json/jsonl, csv, parquet; globs allowed), a local
dataset directory or a `datasets` hub name. The config's model_type chooses the model (flax_lm/models/__init__.py lists
them), or --model_file gives one of the experiment's own. Documents (a whole .txt file as written, unless
--text_sample_by says otherwise; one row of other formats) are tokenized, each framed as the tokenizer frames a text (a
Llama tokenizer's BOS first) and ended by the end-of-text token, joined and packed into blocks of `--block_size`
tokens. Prompt/completion pairs and conversations (the dataset formats of Hugging Face TRL, told apart by their
columns: see flax_lm/data/finetune_examples.py) are fine-tuned on instead, one example per row or packed, with the loss
on the completions or the assistant's turns; conversations are rendered with the tokenizer's chat template. Evaluation
reports loss, perplexity and bits per byte (over the tokens the loss covers). Each global batch is split over every
device of every process with `jax.jit` over a device mesh. On several hosts every host runs the same command (see
initialize_distributed for how the processes find each other) and process 0 writes the outputs.

The output directory is an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer files, generation_config.json) that `transformers.AutoModelForCausalLM` loads in PyTorch; with --lora_rank
(low-rank adapters on the frozen --model_name_or_path) a PEFT adapter (docs/adapting.md).

    ./run_clm_flax.py --output_dir gpt2-run --config_name my-model --tokenizer_name my-model \
        --train_file "data/*.txt" --do_train --do_eval --block_size 512

A single .json file holding the arguments works too: `./run_clm_flax.py args.json`.

This file holds what an experiment changes, in reading order: its arguments, how texts become blocks, the loss, the
optimizer and schedule, the train and eval steps, evaluation with samples, and the loop in main(). The models
(flax_lm/models) and the machinery every run shares (checkpoints, trackers, data storage, processes) are imported
from the flax_lm package: copy this file anywhere, edit it, and run it where flax_lm is installed.
"""

import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_lm.command_line.arguments import (
    CommonDataArguments,
    CommonTrainingArguments,
    ModelArguments,
    check_common_arguments,
    check_numeric_arguments,
)
from flax_lm.command_line.harness_flags import HarnessArguments, check_harness_flags
from flax_lm.command_line.lora_flags import LoraArguments, adapted, check_lora_flags
from flax_lm.command_line.model_loading import model_loading
from flax_lm.command_line.phases import packs_only, start_training
from flax_lm.command_line.start import start_run
from flax_lm.command_line.trainer_flags import apply_strategies, check_best_model_flags
from flax_lm.data.chat import conversation_prompt_ids, stop_token_ids
from flax_lm.data.finetune_examples import Example, ExampleArguments, RowCounts, encoded_examples, is_chat
from flax_lm.data.loading import (
    TextsToRows,
    call_batch_shapes,
    call_batches,
    epoch_batch_indices,
    epochs_of_batches,
    load_data,
    stream_position,
    streaming_train_batches,
)
from flax_lm.data.mixture import Mixture
from flax_lm.data.source import ExampleSettings, TextSource
from flax_lm.data.texts import ids_around_documents, load_text_datasets, token_arrays, token_byte_counts
from flax_lm.devices.mesh import create_mesh, process_slice
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.evaluation.scoring import Scorer
from flax_lm.evaluation.validation import evaluate_on_start, saved_results, summed_over_batches, validation_results
from flax_lm.generation.sampling import Sampling, decode_rows, make_sampler
from flax_lm.models import check_model_type
from flax_lm.models.huggingface import load_config_and_tokenizer
from flax_lm.models.model_code import ModelCode, load_model_code
from flax_lm.models.shared.moe import router_metric_names, router_metric_sums, with_capacity
from flax_lm.run.checkpoints import StopRequest, log_when_committed, open_checkpoints, wait_until_committed
from flax_lm.run.output_dir import write_json
from flax_lm.run.record import TrainingProgress
from flax_lm.run.tracking import TrainingLog, logs_at_step
from flax_lm.training import optimizers
from flax_lm.training.compilation import compile_in_background
from flax_lm.training.lifecycle import (
    ScriptTraining,
    TrainingSetup,
    set_up_training,
)
from flax_lm.training.lora import is_adapter
from flax_lm.training.train_state import TrainState, apply_mean_update, step_gradients

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: this script's own, beside those of flax_lm.command_line.arguments that both scripts take
# ----------------------------------------------------------------------------------------------------


@dataclass
class DataTrainingArguments(ExampleArguments, CommonDataArguments):
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training sequence. Defaults to the smaller of the tokenizer's model_max_length and "
            "the model's positions (max_position_embeddings; GPT-2's n_positions), capped at 1024."
        },
    )
    document_attention: bool = field(
        default=False,
        metadata={
            "help": "In a block of documents packed end to end, a token attends only to its own document and "
            "positions restart at each end-of-text token, which starts the document after it."
        },
    )


# The flags of lm-evaluation-harness tasks (--eval_tasks and lm-eval's settings) are in HarnessArguments, those of
# low-rank adapters (--lora_rank ...) in LoraArguments.
@dataclass
class TrainingArguments(LoraArguments, HarnessArguments, CommonTrainingArguments):
    sample_prompt: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A prompt that the model continues at every evaluation (in TensorBoard's text tab) and at the "
            "end of training; give it several times for several prompts. Default: one text from nothing.",
            "action": "extend",
        },
    )
    sample_tokens: int = field(default=40, metadata={"help": "Tokens sampled after each prompt; 0 for no samples."})
    # How the samples are decoded: generate_flax.py's settings of the same names
    sample_temperature: float = field(
        default=1.0, metadata={"help": "Temperature of the samples' draws; 0 takes the most likely token (greedy)."}
    )
    sample_top_k: int = field(default=40, metadata={"help": "Samples draw from the k most likely tokens; 0: all."})
    sample_top_p: float = field(
        default=1.0, metadata={"help": "Samples draw from the most likely tokens whose probabilities add up to this."}
    )
    sample_repetition_penalty: float = field(
        default=1.0, metadata={"help": "Above 1, makes the tokens already in a sample less likely (transformers')."}
    )
    sample_no_repeat_ngram_size: int = field(
        default=0, metadata={"help": "Samples never write an n-gram of this many tokens twice; 0 for no such rule."}
    )
    sample_min_new_tokens: int = field(
        default=0, metadata={"help": "Samples write at least this many tokens before the end-of-text token."}
    )
    sample_num_beams: int = field(
        default=1,
        metadata={"help": "Samples by beam search of this many beams (with --sample_temperature 0); 1 for none."},
    )
    z_loss: float = field(
        default=0.0,
        metadata={
            "help": "Coefficient of the z-loss added to the training loss: coefficient * log(Z)^2 averaged over the "
            "predicted tokens, Z the softmax's normalizer (PaLM used 1e-4); it keeps the output logits from drifting "
            "large. Logged apart as train/z_loss; train/loss stays the cross-entropy. 0: none.",
        },
    )
    router_z_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "A mixture of experts: coefficient of ST-MoE's router z-loss added to the training loss, the mean "
            "of logsumexp(router logits)^2 (ST-MoE used 1e-3). Logged as train/router_z_loss; train/loss and the eval "
            "loss stay the language model's cross-entropy. 0: none.",
        },
    )
    moe_capacity_factor: float = field(
        default=0.0,
        metadata={
            "help": "A mixture of experts trains with each expert taking at most this factor times an even share of "
            "the (token, expert) pairs, the rest dropped (logged per layer); evaluation and exports stay dropless. "
            "0: dropless, every token reaches its experts.",
        },
    )


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments (after initialize_distributed: see check_common_arguments)."""
    check_model_type(model_args.model_type, generates_text=True)
    check_numeric_arguments(
        (data_args, training_args),
        block_size=(lambda value: value is None or value >= 2, "must be at least 2"),
        sample_tokens=(lambda value: value >= 0, "must be 0 (no samples) or more"),
        eval_tasks_limit=(lambda value: value is None or value >= 1, "must be at least 1"),
        z_loss=(lambda value: value >= 0, "must be 0 (none) or more"),
        router_z_loss_coef=(lambda value: value >= 0, "must be 0 (none) or more"),
        moe_capacity_factor=(lambda value: value >= 0, "must be 0 (dropless) or more"),
    )
    if training_args.sample_tokens and (problem := sample_sampling(training_args).problem("--sample_")):
        raise UsageError(problem.replace("--sample_max_new_tokens", "--sample_tokens"))
    check_common_arguments(model_args, data_args, training_args, evaluates_without_data=bool(training_args.eval_tasks))
    check_best_model_flags(training_args, EVAL_METRICS)  # after the defaults of --do_train and --do_eval
    check_harness_flags(training_args)
    check_lora_flags(model_args, training_args)


# ---------------------------------------------------------------------------------------------------- Data: texts
# become blocks of tokens (flax_lm.data.loading reads the texts from files or a stream, and keeps the blocks)
# ----------------------------------------------------------------------------------------------------


def read_texts(source: TextSource, streaming: bool = False, evaluation_only: bool = False) -> dict:
    """The texts of each split, {"train": ..., "validation": ...}: `datasets` datasets (or streams) of one document a
    row, in --text_column_name. Every data route reads them here (the token cache, --packed_data_dir, --streaming,
    each source of --data_mixture). To train on another source, return its texts instead; the SQLite database that
    --dataset_name names, say (docs/pretraining-clm.md: "Another source of texts"):
        connection = sqlite3.connect(source.dataset_name)
        texts = {"train": datasets.Dataset.from_sql("SELECT text FROM documents", connection)}
        return {split: dataset.to_iterable_dataset() for split, dataset in texts.items()} if streaming else texts
    """
    return load_text_datasets(source, streaming, evaluation_only)


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


def tokenized_rows(
    dataset, split: str, tokenizer, block_size: int, source: TextSource, num_workers: int | None = None
) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split: its texts, each framed by ids_around_documents (GPT-2's
    tokenizers: text EOS; Llama's: BOS text EOS), joined and cut into blocks; tokenized in `num_workers` processes
    (--preprocessing_num_workers). The token cache is keyed by this function's code (and that of what it calls here),
    so an edit re-tokenizes."""
    column = source.text_column_name
    tokens = token_arrays(dataset, tokenizer, column, num_workers, split, ids_around_documents(tokenizer))
    return pack_blocks(tokens, block_size)


def loss_weights(example: Example, settings: ExampleSettings) -> np.ndarray:
    """The loss weight of each token of an example, float32: 1 for the tokens the loss covers, the completion's (the
    end-of-text token after it included) with --completion_only_loss and the assistant's (its end of turn included)
    with --assistant_only_loss, 0 for the others. The first token weighs 0: nothing in its example comes before it."""
    weights = np.ones(len(example.ids), np.float32)
    if settings.completion_only_loss and example.completion is not None:
        weights *= example.completion
    if settings.assistant_only_loss and example.assistant is not None:
        weights *= example.assistant
    weights[0] = 0.0
    return weights


# With --packing, an example goes into the first of this many rows being filled that has room for it.
OPEN_ROWS = 8


def example_rows(
    dataset,
    split: str,
    tokenizer,
    block_size: int,
    source: TextSource,
    example_format: str,
    num_workers: int | None = None,
    document_attention: bool = False,
) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split of examples in `example_format` (flax_lm.data.finetune_examples:
    prompt/completion pairs or conversations), arrays (count, 2, block_size) of token ids and their loss weights
    (loss_weights): one example per row, padded with weight 0, or with --packing as many whole examples as fit, each
    its own document (document attention: its first token starts it). An example longer than a row is left out and
    counted, never cut. The token cache is keyed by this function's code (and that of what it calls here), so an edit
    re-tokenizes."""
    settings = source.examples
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    before_documents, _ = ids_around_documents(tokenizer)
    separator_id = (before_documents or [tokenizer.eos_token_id])[0]  # as causal_lm_model's
    counts = RowCounts()
    open_rows, finished = [], []  # rows being filled, and filled: [length, [(ids, weights), ...]]

    def stacked(rows) -> np.ndarray:
        stack = np.zeros((len(rows), 2, block_size), np.int32)
        stack[:, 0] = pad_id
        for number, (_, parts) in enumerate(rows):
            ids, weights = np.concatenate([part[0] for part in parts]), np.concatenate([part[1] for part in parts])
            stack[number, 0, : len(ids)], stack[number, 1, : len(ids)] = ids, weights
        counts.rows += len(rows)
        return stack

    for example in encoded_examples(dataset, split, tokenizer, example_format, source, num_workers):
        if len(example.ids) > block_size:
            counts.too_long.append((len(example.ids), example.row))
            continue
        # Document attention starts a document at each separator: an example's own may only be where its starts
        # (a Llama's BOS, first) or ends (GPT-2's end-of-text token, last).
        inside = example.ids[1:] if before_documents else example.ids[1:-1]
        starts_apart = example.ids[0] == separator_id or not before_documents
        if (settings.packing or document_attention) and (separator_id in inside or not starts_apart):
            raise UsageError(
                f"the {split} example of row {example.row} does not hold the token "
                f"{tokenizer.convert_ids_to_tokens(separator_id)} where alone it would start a document (first, "
                "for a tokenizer that begins texts with it; nowhere inside), as --packing needs; drop --packing"
            )
        weights = loss_weights(example, settings)
        counts.add(example.ids, weights)
        fitting = [row for row in open_rows if row[0] + len(example.ids) <= block_size] if settings.packing else []
        row = fitting[0] if fitting else [0, []]
        if not fitting:
            open_rows.append(row)
        row[0] += len(example.ids)
        row[1].append((example.ids, weights))
        if not settings.packing or len(open_rows) > OPEN_ROWS:
            finished.append(open_rows.pop(0))
        if len(finished) >= 1024:
            yield stacked(finished)
            finished = []
    if finished or open_rows:
        yield stacked(finished + open_rows)
    counts.log(split, block_size, settings.packing)


def batch_of(rows: np.ndarray) -> dict:
    """Rows as the steps take them: {"input_ids"} of text blocks, or of examples also their "weights" (float32)."""
    if rows.ndim == 2:
        return {"input_ids": np.asarray(rows, dtype=np.int32)}
    return {"input_ids": np.asarray(rows[:, 0], dtype=np.int32), "weights": rows[:, 1].astype(np.float32)}


def train_batches(
    blocks: np.ndarray, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[dict]:
    """This process's rows of each global batch of one epoch, from batch `first_batch` on, in an order
    fixed by seed and epoch (so a resumed run continues with the very batches it would have seen).

    The blocks left over after the last full batch differ from epoch to epoch, so all data is seen.
    """
    rows = process_slice(global_batch_size)
    for _, indices in epoch_batch_indices(len(blocks), global_batch_size, seed, epoch, first_batch):
        yield batch_of(blocks[indices[rows]])


def eval_batches(blocks: np.ndarray, global_batch_size: int) -> Iterator[dict]:
    """Every block once, in order, with its tokens' loss weights (1, or those of examples); the last batch is padded
    with zero-weight rows so none is dropped."""
    rows = process_slice(global_batch_size)
    for start in range(0, len(blocks), global_batch_size):
        batch = batch_of(np.asarray(blocks[start : start + global_batch_size]))
        input_ids = batch["input_ids"]
        weights = batch.get("weights", np.ones(input_ids.shape, dtype=np.float32))
        padding = global_batch_size - len(input_ids)
        if padding:
            input_ids = np.pad(input_ids, ((0, padding), (0, 0)))
            weights = np.pad(weights, ((0, padding), (0, 0)))
        yield {"input_ids": input_ids[rows], "weights": weights[rows]}


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
# ----------------------------------------------------------------------------------------------------


def next_token_targets(input_ids, weights):
    """The token each position predicts and its weight: position t predicts token t + 1; the last position has
    nothing to predict, so its weight is 0. The labels and weights are shifted rather than the logits sliced: slicing
    would copy the (batch, length, vocabulary) logits, and its gradient pad them back, in every step."""
    next_tokens = jnp.roll(input_ids, -1, axis=1)
    target_weights = jnp.concatenate([weights[:, 1:], jnp.zeros_like(weights[:, :1])], axis=1)
    return next_tokens, target_weights


def causal_lm_objective(logits, input_ids, weights, z_loss: float = 0.0):
    """The training objective, what the train step differentiates: the summed next-token cross-entropy ("loss_sum",
    logged as train/loss) and the number of predicted tokens it is averaged over, both float32; with a `z_loss`
    coefficient also the summed z-loss, coefficient * log(Z)^2 of each predicted token (PaLM, Chowdhery et al. 2022),
    added to what is differentiated and logged apart. Edit this to train on another loss (label smoothing, say):
    evaluation reports the exact cross-entropy of causal_lm_loss_sums whatever is trained on here.

    Sums rather than means, so that averages over several batches (and over padded rows, weight 0)
    are exact: divide once, on the host.
    """
    next_tokens, target_weights = next_token_targets(input_ids, weights)
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, next_tokens)
    sums = {"loss_sum": jnp.sum(losses * target_weights), "token_count": jnp.sum(target_weights)}
    if z_loss:
        log_normalizers = jax.nn.logsumexp(logits, axis=-1)
        sums["z_loss_sum"] = z_loss * jnp.sum(jnp.square(log_normalizers) * target_weights)
    return sums


def causal_lm_loss_sums(logits, input_ids, weights):
    """What the evaluation's metrics are computed from (loss, perplexity, bits per byte): the exact summed next-token
    cross-entropy and the number of predicted tokens, both float32. Not the training objective (causal_lm_objective),
    so that an edit of what is trained on leaves the reported metrics comparable with every other run's."""
    next_tokens, target_weights = next_token_targets(input_ids, weights)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), next_tokens)
    return {"loss_sum": jnp.sum(losses * target_weights), "token_count": jnp.sum(target_weights)}


# What the train step sums over tokens (with --z_loss also z_loss_sum), and the metrics shown from those sums.
TRAIN_METRIC_SUMS = ("loss_sum", "token_count")


def train_metrics(sums: dict) -> dict:
    """The training metrics of a log line and of train_results.json, from the sums over the steps it covers."""
    token_count = max(sums["token_count"], 1.0)
    # train/loss: the cross-entropy alone, whatever the step adds to it (each addition a metric of its own).
    metrics = {"loss": sums["loss_sum"] / token_count}
    for name in ("z_loss", "router_aux_loss", "router_z_loss"):
        if f"{name}_sum" in sums:
            metrics[name] = sums[f"{name}_sum"] / token_count
    # A mixture of experts' routers, which the trackers show (moe/...): moe.router_metric_sums says what each is.
    return metrics | {name: value / token_count for name, value in sums.items() if name.startswith("moe/")}


def learning_rate_schedule(settings: optimizers.OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    schedule_after_warmup = LEARNING_RATE_SCHEDULES[settings.lr_scheduler_type]
    return optimizers.after_linear_warmup(schedule_after_warmup, settings, total_steps)


# What --lr_scheduler_type names: the learning rate after the warm-up, from (settings, warmup_steps, total_steps);
# its step 0 is the first step after the warm-up. Add an entry here and the flag takes it. The decays end at
# --min_lr_rate of the peak, in a shape of flax_lm.training.optimizers.DECAY_SHAPES (warmup_stable_decay:
# --lr_decay_shape).
LEARNING_RATE_SCHEDULES = {
    "linear": optimizers.decay_to_the_end("linear"),
    "cosine": optimizers.decay_to_the_end("cosine"),
    "constant": lambda settings, *_: optax.constant_schedule(settings.learning_rate),
    "warmup_stable_decay": optimizers.warmup_stable_decay,
}


def decay_mask(params):
    """True for the weights AdamW decays: matrices and embeddings, not biases or LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


def is_trained(path, param) -> bool:
    """Whether training updates this parameter (all do; to train only attention: `return "attn" in [entry.key for
    entry in path]`). A frozen one is not differentiated, has no optimizer state, no share in the gradient norm."""
    return True


def is_hidden_matrix(path, param) -> bool:
    """Whether --optim muon trains this parameter with Muon: a 2-D kernel of the blocks (the attention and MLP
    projections) or a mixture of experts' stack of them (experts, in, out), each expert's matrix its own. The
    embeddings, the output layer and head (lm_head), norms and biases are AdamW's. Decided by name and shape, so a
    matrix added to a block goes to Muon as well; a new head named other than lm_head must be named here to stay
    with AdamW."""
    names = [entry.key for entry in path]
    is_kernel = (names[-1] == "kernel" and param.ndim == 2) or (names[-2:-1] == ["experts"] and param.ndim == 3)
    return is_kernel and "lm_head" not in names


# What --optim names: the optimizer from (settings, schedule). Add an entry here and the flag takes it.
OPTIMIZERS = {
    "adamw": lambda settings, schedule: optimizers.adamw(settings, schedule, decay_mask),
    "muon": lambda settings, schedule: optimizers.muon_with_adamw(
        settings, schedule, optimizers.adamw(settings, schedule, decay_mask), is_hidden_matrix
    ),
    "lion": lambda settings, schedule: optimizers.lion(settings, schedule, decay_mask),
    "adafactor": lambda settings, schedule: optimizers.adafactor(settings, schedule, decay_mask),
}


# The tables the flags name, whose names --help lists.
FLAG_TABLES = {"optim": OPTIMIZERS, "lr_scheduler_type": LEARNING_RATE_SCHEDULES}


def create_optimizer(
    settings: optimizers.OptimizerSettings, schedule: optax.Schedule, trains=None
) -> optax.GradientTransformation:
    """The optimizer of --optim, for the parameters is_trained picks (or `trains`, in its place: LoRA's adapters)."""
    optimizer = OPTIMIZERS[settings.optim](settings, schedule)
    if settings.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), optimizer)
    return optimizers.trained_only(optimizer, trains or is_trained)


def make_train_step(
    model, optimizer, schedule, seed: int, z_loss=0.0, router_z_loss=0.0, capacity_factor=None, trains=None
):
    # `trains`: what trains in place of is_trained (LoRA's adapters: flax_lm.training.lora.is_adapter).
    dropout_key = jax.random.key(seed + 1)
    model = with_capacity(model, capacity_factor)  # a mixture of experts' experts with a capacity, where one is set
    # A mixture of experts whose config asks for it (output_router_logits) adds router_aux_loss_coef times the
    # load-balancing loss of its routers, as transformers does, and with --router_z_loss_coef the router z-loss.
    aux_coefficient = getattr(model.config, "output_router_logits", False) and model.config.router_aux_loss_coef

    def loss_and_sums(params, micro_batch, dropout_rng):
        input_ids = micro_batch["input_ids"]
        apply = partial(model.apply, {"params": params}, input_ids, deterministic=False, rngs={"dropout": dropout_rng})
        logits, state = apply(mutable=["intermediates"])  # what a mixture of experts' routers sowed too
        weights = micro_batch.get("weights", jnp.ones(input_ids.shape, jnp.float32))  # examples carry their own
        sums = causal_lm_objective(logits, input_ids, weights, z_loss)
        # The routers' losses (of an MoE) and what the trackers watch of them, weighted by the tokens as the loss is.
        top_k = getattr(model.config, "num_experts_per_tok", 1)
        routers = (state.get("intermediates", {}), top_k, sums["token_count"], aux_coefficient, router_z_loss)
        sums |= router_metric_sums(*routers)
        auxiliary = sums.get("z_loss_sum", 0.0) + sums.get("router_aux_loss_sum", 0.0)
        return sums["loss_sum"] + auxiliary + sums.get("router_z_loss_sum", 0.0), sums

    def train_step(state: TrainState, batch):
        grads, sums = step_gradients(loss_and_sums, state, batch, dropout_key, trains or is_trained)
        # The mean over every predicted token of the whole batch.
        new_state, update_metrics = apply_mean_update(state, grads, sums["token_count"], sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


# What flax_lm's set-up (set_up_training) builds the training from: this script's schedule, optimizer and train step,
# the sums its train step makes, and the flag of its sequence length.
SCRIPT_TRAINING = ScriptTraining(
    learning_rate_schedule, create_optimizer, make_train_step, TRAIN_METRIC_SUMS, "block_size"
)


def script_training(training_args, model, adapters=None) -> ScriptTraining:
    """SCRIPT_TRAINING, with --z_loss a train step that adds the z-loss and sums it apart, as a metric of its own; for
    a mixture of experts, with the sums of its routers (and their losses, where a coefficient asks for them); with
    `adapters` (LoRA's) one that trains them alone."""
    options = {"z_loss": training_args.z_loss, "router_z_loss": training_args.router_z_loss_coef}
    options["capacity_factor"] = training_args.moe_capacity_factor
    router_sums = router_metric_names(with_capacity(model, options["capacity_factor"]), jnp.zeros((1, 2), jnp.int32))
    for flag in ("router_z_loss_coef", "moe_capacity_factor"):
        if getattr(training_args, flag) and not router_sums:
            raise UsageError(f"--{flag} is for a mixture of experts; a {model.config.model_type} has no router")
    if router_sums and getattr(model.config, "output_router_logits", False) and model.config.router_aux_loss_coef:
        router_sums = ("router_aux_loss_sum", *router_sums)
    loss_sums = tuple(f"{name}_sum" for name in ("z_loss", "router_z_loss") if options[name])
    if adapters:
        options["trains"] = is_adapter
    step = partial(make_train_step, **options)
    training = replace(
        SCRIPT_TRAINING, make_train_step=step, metric_sums=(*TRAIN_METRIC_SUMS, *loss_sums, *router_sums)
    )
    if adapters:
        training = replace(training, create_optimizer=partial(create_optimizer, trains=is_adapter))
    return training


def make_eval_step(model, token_bytes: np.ndarray | None = None):
    """The summed loss and predicted tokens of a batch; with `token_bytes` (token_byte_counts) also the UTF-8
    bytes of the predicted tokens, for bits per byte."""

    def eval_step(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], deterministic=True)
        sums = causal_lm_loss_sums(logits, batch["input_ids"], batch["weights"])
        if token_bytes is not None:
            # The bytes of exactly the tokens the loss predicts: every token but the first of each block.
            target_bytes = jnp.asarray(token_bytes)[batch["input_ids"][:, 1:]]
            sums["byte_count"] = jnp.sum(target_bytes * batch["weights"][:, 1:])
        return sums

    return eval_step


def evaluation_sums(eval_step, params, blocks, global_batch_size, batch_sharding) -> dict:
    """The eval step's sums over every block."""
    num_batches = math.ceil(len(blocks) / global_batch_size)
    return summed_over_batches(eval_step, params, eval_batches(blocks, global_batch_size), num_batches, batch_sharding)


def describe_results(results: dict) -> str:
    bits_per_byte = f", bits per byte {results['bits_per_byte']:.4f}" if "bits_per_byte" in results else ""
    return f"loss {results['loss']:.4f}, perplexity {results['perplexity']:.2f}{bits_per_byte}"


# What each evaluation reports (the log, the trackers, eval_results.json), of what evaluation_results returns: a new
# metric is a sum in make_eval_step, its ratio in evaluation_results, and its name here.
EVAL_METRICS = ("loss", "perplexity", "bits_per_byte")


def evaluation_results(totals: dict) -> dict:
    """Loss and perplexity, averaged exactly over predicted tokens, and bits per byte (the summed loss in bits over
    the UTF-8 bytes of the predicted text) where the step counts bytes."""
    loss = totals["loss_sum"] / totals["token_count"]
    results = {"loss": loss, "perplexity": math.exp(min(loss, 100.0)), "tokens": int(totals["token_count"])}
    if totals.get("byte_count"):
        results["bits_per_byte"] = totals["loss_sum"] / math.log(2) / totals["byte_count"]
        results["bytes"] = int(totals["byte_count"])
    return results


# ----------------------------------------------------------------------------------------------------
# Evaluation, with samples from the same prompts each time
# ----------------------------------------------------------------------------------------------------


def sample_sampling(training_args) -> Sampling:
    """How the samples are decoded: the --sample_* flags, drawn from --seed."""
    settings = ("temperature", "top_k", "top_p", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens")
    return Sampling(
        max_new_tokens=training_args.sample_tokens,
        seed=training_args.seed,
        num_beams=training_args.sample_num_beams,
        **{name: getattr(training_args, f"sample_{name}") for name in settings},
    )


def sample_texts(sampler, params, tokenizer, prompts: list[str], sampling: Sampling, max_length: int, chat=False):
    """Each prompt continued by up to sampling.max_new_tokens tokens decoded by `sampling` (the --sample_* flags:
    by default drawn with temperature 1 from the 40 most likely). A prompt starts as the documents trained on do
    (ids_around_documents; an empty one of GPT-2 from the end-of-text token), or with `chat` (a model fine-tuned on
    conversations) is a user's turn that the chat template renders; a long one keeps its last tokens (at most
    `max_length` positions in all). The texts are decoded without special tokens: a reader sees text only."""
    num_tokens = min(sampling.max_new_tokens, max_length - 1)
    before_documents, _ = ids_around_documents(tokenizer)
    encoded = [
        conversation_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        if chat
        else before_documents + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for prompt in prompts
    ]
    prompt_ids = [(ids or [tokenizer.eos_token_id])[-(max_length - num_tokens) :] for ids in encoded]
    samplings = [
        replace(
            sampling,
            max_new_tokens=num_tokens,
            min_new_tokens=min(sampling.min_new_tokens, num_tokens),
            prompt_index=row,
        )
        for row in range(len(prompt_ids))
    ]
    new_ids = decode_rows(sampler, params, prompt_ids, samplings)
    return [tokenizer.decode(ids + new, skip_special_tokens=True) for ids, new in zip(prompt_ids, new_ids)]


class Evaluation:
    """Evaluation on the validation blocks and on the lm-evaluation-harness tasks of --eval_tasks, logged with samples
    from the same prompts each time, so that a reader sees the text get better; the sampler is compiled once."""

    def __init__(self, setup: "TrainingSetup", blocks, tokenizer, training_args, trackers, chat: bool = False):
        self.setup, self.blocks, self.tokenizer, self.trackers = setup, blocks, tokenizer, trackers
        self.output_dir = training_args.output_dir
        self.prompts, self.sampling = training_args.sample_prompt or [""], sample_sampling(training_args)
        self.chat = chat  # prompts are a user's turns
        # A reply ends at the end of its turn, where the chat template has one.
        self.stop_token_ids = stop_token_ids(tokenizer, tokenizer.eos_token_id)
        # Without gradient checkpointing, which sampling does not need, and decoding one sequence per row.
        sampling_model = setup.model.clone(remat_policy=None, document_separator_id=None)
        self.sampler = make_sampler(sampling_model, self.stop_token_ids)
        self.tasks = None
        if training_args.eval_tasks:
            from flax_lm.evaluation.harness import (
                FlaxLM,
                HarnessTasks,
            )  # lm-eval is optional: imported only when asked for

            scorer = Scorer(sampling_model, setup.eval_batch_size * setup.row_length, sampling_model.mesh)
            self.tasks = HarnessTasks(
                training_args.eval_tasks.split(","),
                training_args.eval_tasks_path,
                training_args.eval_tasks_limit,
                FlaxLM(scorer, self.sampler, tokenizer, batch_size=setup.eval_batch_size),
                training_args.apply_chat_template,
                training_args.fewshot_as_multiturn,
            )

    def __call__(self, params, step: int) -> dict:
        """The results on the whole evaluation data (if any); with a mixture, those of each source under "sources" too;
        with --eval_tasks, {task: {metric: value}} under "tasks"."""
        results = {}
        if self.blocks is not None:
            sums_of = partial(self.sums, params)
            results = validation_results(
                sums_of, self.blocks, evaluation_results, step, self.trackers, EVAL_METRICS, describe_results
            )
        if self.tasks:
            results["tasks"] = self.tasks(params)
            self.tasks.report(results["tasks"], step, self.trackers)
        if self.sampling.max_new_tokens > 0:  # the first compiles the sampler: tens of seconds on a CPU
            logger.info("step %d: sampling %d tokens after each of %d prompts", step, self.sampling.max_new_tokens,
                        len(self.prompts))  # fmt: skip
            texts = self.samples(params)
            for text in texts:
                logger.info("step %d: sample %r", step, text)
            # Indented four spaces: markdown shows the texts verbatim, line breaks and all.
            code_blocks = ["\n".join("    " + line for line in text.split("\n")) for text in texts]
            self.trackers.text("samples", "\n\n---\n\n".join(code_blocks), step)
        return results

    def sums(self, params, blocks) -> dict:
        setup = self.setup
        return evaluation_sums(setup.eval_step, params, blocks, setup.eval_batch_size, setup.batch_sharding)

    def samples(self, params, sampler=None) -> list[str]:
        max_length = self.setup.model.config.max_position_embeddings
        sampler = sampler or self.sampler
        return sample_texts(sampler, params, self.tokenizer, self.prompts, self.sampling, max_length, self.chat)

    def final(self, params, step: int) -> dict:
        """The evaluation of the final weights with the tasks' scores, written to eval_results.json, and its results
        (flax_lm.training.setup.finish_run keeps one already there for the step, of a complete run repeated)."""
        results = self(params, step)
        if jax.process_index() > 0:
            return results
        saved = {}
        if self.blocks is not None:
            # bits_per_byte and bytes are null where the tokens have no fixed byte count.
            names = (*EVAL_METRICS, "tokens", "bytes")
            saved = saved_results(results, names, self.blocks)
        for task, metrics in results.get("tasks", {}).items():
            saved.update({f"eval_{task}_{metric}": value for metric, value in metrics.items()})
        write_json(os.path.join(self.output_dir, "eval_results.json"), saved | {"step": step})
        if self.blocks is not None:
            bits_per_byte = f", {results['bits_per_byte']:.4f} bits per byte" if "bits_per_byte" in results else ""
            print(f"eval perplexity: {results['perplexity']:.2f} (loss {results['loss']:.4f}{bits_per_byte})")
        if self.tasks:
            print(f"eval tasks: {self.tasks.describe(results['tasks'])}")
        return results

    def sample_from_export(self, abstract_params):
        """Samples from the exported model, read back: they also show that the saved files hold the trained model."""
        if jax.process_index() != 0 or self.sampling.max_new_tokens <= 0:
            return
        exported = self.setup.read_export(self.output_dir, abstract_params)
        sampler = self.sampler
        if jax.process_count() > 1:  # process 0 alone, so on its own device, not on a mesh the others would share
            model = self.setup.model.clone(remat_policy=None, document_separator_id=None, mesh=None)
            sampler = make_sampler(model, self.stop_token_ids)
        for text in self.samples(exported, sampler):
            print(f"sample from {self.output_dir}: {text!r}")


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    argument_types = (ModelArguments, DataTrainingArguments, TrainingArguments)
    model_args, data_args, training_args = start_run(argument_types, check_arguments, FLAG_TABLES)

    config, tokenizer = load_config_and_tokenizer(model_loading(model_args), "gpt2")
    mesh = create_mesh(training_args.mesh_shape)
    model_code = load_model_code(
        config, model_args.model_file, True, "run_clm_flax.py", mesh, compare_exports=not model_args.skip_export_check
    )
    block_size = choose_block_size(data_args, tokenizer, config)
    texts_to_rows = script_texts_to_rows(data_args, tokenizer, block_size)
    route = data_args.data_route(model_args, training_args)
    rows, train_stream, example_format = load_data(route, texts_to_rows)
    if packs_only(training_args, data_args.packed_data_dir):
        return

    model = causal_lm_model(config, tokenizer, model_args, data_args, mesh, model_code)
    model, adapters = adapted(model, model_code, model_args, training_args, block_size, training_args.seed)
    eval_step = make_eval_step(model, token_byte_counts(tokenizer, config.vocab_size))
    script, settings = script_training(training_args, model, adapters), training_args.training_settings()
    setup = set_up_training(model, model_code, script, eval_step, settings, rows.get("train"), block_size, adapters)
    apply_strategies(training_args, setup.steps_per_epoch, setup.total_steps)
    compile_train_steps_ahead(setup, training_args)
    arguments = (model_args, data_args, training_args)
    state, this_run = start_training(setup, arguments, config, tokenizer, train_metrics, EVAL_METRICS, __file__)
    chat = is_chat(example_format)  # the samples' prompts are a user's turns
    evaluation = Evaluation(setup, rows.get("validation"), tokenizer, training_args, this_run.trackers, chat)

    if this_run.trains_now:
        batches = train_batches_from(
            this_run.progress.step, setup, train_stream, texts_to_rows, route, data_args, training_args
        )
        state, this_run.stopped_by = train(
            state, this_run.progress, batches, setup, this_run.save, evaluation, this_run.log, training_args
        )
    this_run.finish(state, evaluation, partial(evaluation.sample_from_export, setup.abstract_state.params))


def script_texts_to_rows(data_args, tokenizer, block_size: int) -> TextsToRows:
    """How this script's texts become rows of `block_size` tokens, with the settings of its flags bound."""
    workers = data_args.preprocessing_num_workers
    rows = partial(tokenized_rows, num_workers=workers)
    examples = partial(example_rows, num_workers=workers, document_attention=data_args.document_attention)
    return TextsToRows(read_texts, rows, tokenizer, block_size, "--block_size", examples, data_args.framing)


def choose_block_size(data_args, tokenizer, config) -> int:
    positions = config.max_position_embeddings  # GPT-2's n_positions
    block_size = data_args.block_size or min(tokenizer.model_max_length, positions, 1024)
    if block_size > positions:
        raise UsageError(f"--block_size {block_size} exceeds the model's {positions} positions; lower --block_size")
    return block_size


def causal_lm_model(config, tokenizer, model_args, data_args, mesh, model_code: ModelCode) -> nn.Module:
    """The model of `model_code` to train on `mesh`, in the dtypes asked for. With --document_attention it keeps the
    documents of a block apart, each starting at its BOS (Llama) or at the end-of-text token that ends the one before
    (GPT-2, whose documents have no BOS)."""
    dtypes = jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype)
    before_documents, _ = ids_around_documents(tokenizer)
    documents_apart = data_args.document_attention or data_args.packing  # packed examples are documents too
    separator_id = (before_documents or [tokenizer.eos_token_id])[0] if documents_apart else None
    return model_code.module.MODEL_CLASS(
        config, *dtypes, model_args.gradient_checkpointing, mesh, document_separator_id=separator_id
    )


def train_batches_from(first_step, setup: TrainingSetup, train_stream, texts_to_rows, route, data_args, training_args):
    """The global batches of each compiled call after `first_step` (steps_of_calls says how many steps each runs),
    stacked, and the token count of each step, read ahead on a thread: from the training blocks, or `train_stream`
    (the texts of `route`, which texts_to_rows makes into blocks as it does on every route).
    The data order is a function of the step, so a resumed run sees the batches the interrupted one would have."""
    batch_size, block_size, train_blocks = setup.train_batch_size, setup.row_length, setup.train_rows
    if isinstance(train_blocks, Mixture):
        data = f"on a mixture ({train_blocks.describe(setup.total_steps * batch_size)})"
        rows = process_slice(batch_size)
        global_batches = train_blocks.global_batches(batch_size, training_args.seed, first_step)
        local_batches = (batch_of(train_blocks[indices[rows]]) for indices in global_batches)
    elif train_stream is None:
        data = f"({setup.total_steps / setup.steps_per_epoch:.2f} epochs of {len(train_blocks)} blocks)"
        batches_of_epoch = partial(train_batches, train_blocks, batch_size, training_args.seed)
        local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    else:
        data = "on blocks packed from a stream"
        first_batch, seed = stream_position(first_step, batch_size, training_args.seed, training_args.ignore_data_skip)
        rows_of_texts = partial(texts_to_rows.rows_of, split="train", source=route.source, example_format=None)
        local_batches = streaming_train_batches(
            train_stream, rows_of_texts, batch_size, seed, data_args.shuffle_buffer_size, first_batch
        )
    logger.info(
        "Training steps %d to %d %s, global batch %d x %d tokens",
        first_step + 1,
        setup.total_steps,
        data,
        batch_size,
        block_size,
    )
    batches_and_tokens = ((batch, batch_size * block_size) for batch in local_batches)
    calls = steps_of_calls(first_step, setup.total_steps, training_args)
    accumulation_steps, sharding = training_args.gradient_accumulation_steps, setup.call_batches_sharding
    return call_batches(batches_and_tokens, accumulation_steps, calls, training_args.steps_per_call, sharding)


def compile_train_steps_ahead(setup: TrainingSetup, training_args):
    """With --do_train, start compiling the train step on a thread, while the weights are initialised or restored."""
    if training_args.do_train:
        abstract_batches = abstract_call_batches(setup, training_args)
        steps = training_args.steps_per_call
        compile_in_background(setup.compiled_train_steps, setup.abstract_state, abstract_batches, steps)


def abstract_call_batches(setup: TrainingSetup, training_args) -> dict:
    """Shape, dtype and sharding of the batches of one compiled call, as train_batches_from makes them."""
    shape = (setup.train_batch_size, setup.row_length)
    global_batch = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32)}
    if setup.train_rows is not None and len(setup.train_rows.shape) == 3:  # examples' rows: their weights
        global_batch["weights"] = jax.ShapeDtypeStruct(shape, jnp.float32)
    accumulation_steps, steps_per_call = training_args.gradient_accumulation_steps, training_args.steps_per_call
    return call_batch_shapes(global_batch, accumulation_steps, steps_per_call, setup.call_batches_sharding)


def steps_of_calls(first_step: int, total_steps: int, training_args) -> list[int]:
    """How many steps each compiled call runs, from the step after `first_step` to the last: --steps_per_call, or
    fewer where the loop logs, evaluates or saves sooner, so that a call ends at every such step."""
    intervals = [training_args.logging_steps, training_args.save_steps]
    if training_args.do_eval:
        intervals.append(training_args.eval_steps or training_args.logging_steps)
    calls, step = ([1], 1) if training_args.logging_first_step and first_step == 0 else ([], first_step)
    while step < total_steps:
        call_end = min([total_steps, step + training_args.steps_per_call] + [(step // n + 1) * n for n in intervals])
        calls.append(call_end - step)
        step = call_end
    return calls


def train(
    state, progress: TrainingProgress, batches, setup: TrainingSetup, save, evaluate, log: TrainingLog, training_args
):
    """Train from the step after `progress.step` to the last, in compiled calls of the steps `batches` holds for each
    (steps_of_calls), logging every --logging_steps, saving every --save_steps and at the end, or after the call in
    which a stop was requested, and evaluating every --eval_steps (with --do_eval; after a save at the same step).
    Returns the state and the signal that stopped training, None if it ran to the end."""
    eval_steps = training_args.eval_steps or training_args.logging_steps
    evaluate_on_start(evaluate, state.params, progress, training_args.evaluation_schedule())
    # Leaving this block, for whatever reason, waits for a checkpoint still being written.
    with (
        open_checkpoints(training_args.output_dir, training_args.save_total_limit, progress.best_model) as checkpoints,
        StopRequest() as stop,
        log,
    ):
        checkpoint_being_written, step = None, progress.step
        for batch, step_tokens in batches:
            state, metrics = setup.compiled_train_steps(state, batch, len(step_tokens))
            log.steps_done(metrics, step_tokens)
            step += len(step_tokens)
            checkpoint_being_written = log_when_committed(checkpoints, checkpoint_being_written)
            is_last = step == log.total_steps
            is_log_step = logs_at_step(step, is_last, training_args.logging_steps, training_args.logging_first_step)
            stopping = stop.requested(check_other_processes=is_log_step)
            is_save_step = step % training_args.save_steps == 0 or is_last or stopping
            if is_log_step or is_save_step:
                log.add_steps_to_progress(step, progress, checkpoints)
            if is_log_step or stopping:
                log.write(step)
            if is_save_step:  # before the evaluation: an evaluation that fails must not lose the steps before it
                # The save would wait for the checkpoint still being written: announce it first.
                wait_until_committed(checkpoints, checkpoint_being_written)
                progress.step = step
                checkpoint_being_written = save(checkpoints, state, progress)
            if training_args.do_eval and step % eval_steps == 0 and not is_last and not stopping:
                results = evaluate(state.params, step)
                if progress.best_model and is_save_step:  # the checkpoint just saved is the candidate
                    progress.best_model.consider(results, step)
            if stopping:
                break
        wait_until_committed(checkpoints, checkpoint_being_written)
    return state, stop.signal_name if stopping else None


if __name__ == "__main__":
    call_with_one_line_errors(main)
