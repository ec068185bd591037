#!/usr/bin/env python3
"""Pretrain a T5 encoder-decoder with JAX/Flax on span corruption, or train it on input/target pairs.

Trains from scratch (a config and a tokenizer, for example from create_config.py --preset t5-tiny and
train_tokenizer.py --model_type t5) or continues from a Hugging Face T5 checkpoint, on text from local files (txt,
json/jsonl, csv, parquet; globs allowed), a local dataset directory or a `datasets` hub name.

Plain text is trained on with T5's objective, span corruption (Raffel et al. 2020, section 3.1.4): the texts, each
ending with </s>, are joined and cut into rows just long enough that, once --noise_density of their tokens (in spans
of --mean_noise_span_length on average) are each replaced by one sentinel token, the input is exactly
--max_seq_length tokens long; the target is the dropped spans, each after its sentinel. Every batch is corrupted on
the host with numpy, reproducibly from --seed (flax_lm.data.span_corruption). Data of input/target pairs, JSON Lines
rows with `prompt`/`completion` (or JaxSeq's `in_text`/`out_text`), are trained on as they are instead: the input
tokenized by `tokenizer(text)`, the target by `tokenizer(text_target=text)`, each up to --max_seq_length tokens. The
loss and the accuracy count the target tokens, averaged over all of them (token-weighted); so the eval loss on pairs is
what T5ForConditionalGeneration computes in PyTorch for the same pairs, all in one batch.

The output directory is an ordinary Hugging Face model directory (config.json, model.safetensors, tokenizer files) that
`T5ForConditionalGeneration` loads in PyTorch.

    ./run_t5_mlm_flax.py --output_dir t5-run --config_name my-t5 --tokenizer_name my-t5 \
        --train_file "data/*.txt" --do_train --do_eval --max_seq_length 512

This file holds what an experiment changes, in reading order: its arguments, how texts become rows and batches, the
loss, the optimizer and schedule (Adafactor, as T5 trains, by default), the train and eval steps, evaluation, and the
loop in main(). The model (flax_lm/models/t5/model.py, or --model_file) and what every run shares (checkpoints,
trackers, data storage, processes) are imported from the flax_lm package, as run_mlm_flax.py does.
"""

import itertools
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

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
from flax_lm.command_line.model_loading import model_loading
from flax_lm.command_line.phases import packs_only, start_training
from flax_lm.command_line.start import start_run
from flax_lm.command_line.trainer_flags import apply_strategies, check_best_model_flags
from flax_lm.data.finetune_examples import FORMAT_NAMES, PROMPT_COMPLETION
from flax_lm.data.loading import (
    TextsToRows,
    call_batch_shapes,
    call_batches,
    epoch_batch_indices,
    epochs_of_batches,
    load_data,
)
from flax_lm.data.mixture import Mixture
from flax_lm.data.source import ExampleSettings, TextSource
from flax_lm.data.span_corruption import SpanCorruption, corrupt_spans, span_corruption_lengths
from flax_lm.data.text_pairs import pair_columns, pair_rows
from flax_lm.data.texts import load_text_datasets, token_arrays
from flax_lm.devices.mesh import create_mesh, process_slice
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.evaluation.validation import (
    evaluate_on_start,
    saved_results,
    summed_over_batches,
    validation_results,
)
from flax_lm.models.huggingface import load_config_and_tokenizer
from flax_lm.models.model_code import load_model_code
from flax_lm.models.t5.tokenizer import sentinel_token_ids
from flax_lm.run.checkpoints import StopRequest, log_when_committed, open_checkpoints, wait_until_committed
from flax_lm.run.output_dir import write_json
from flax_lm.run.record import TrainingProgress
from flax_lm.run.tracking import TrainingLog, logs_at_step
from flax_lm.training import optimizers
from flax_lm.training.compilation import compile_in_background
from flax_lm.training.lifecycle import ScriptTraining, TrainingSetup, set_up_training
from flax_lm.training.train_state import TrainState, apply_mean_update, step_gradients

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: this script's own, beside those of flax_lm.command_line.arguments that every script takes
# ----------------------------------------------------------------------------------------------------


@dataclass
class DataTrainingArguments(CommonDataArguments):
    max_seq_length: int = field(
        default=512,
        metadata={
            "help": "Tokens of the encoder's input, </s> included: span corruption makes every input exactly this "
            "long (from rows of more tokens, whose dropped spans are each one sentinel); pairs have up to this many "
            "tokens in the input and in the target, longer ones are left out."
        },
    )
    noise_density: float = field(default=0.15, metadata={"help": "Fraction of the tokens span corruption drops."})
    mean_noise_span_length: float = field(
        default=3.0, metadata={"help": "Mean length of the spans span corruption drops."}
    )
    prompt_column: str | None = field(
        default=None,
        metadata={"help": "The column of the inputs of pair data (default: prompt, or in_text with out_text)."},
    )
    completion_column: str | None = field(
        default=None, metadata={"help": "The column of the targets of pair data (default: completion, or out_text)."}
    )

    def example_settings(self) -> ExampleSettings:
        """Pairs are read as prompt/completion examples, one per row."""
        return ExampleSettings(self.prompt_column, self.completion_column)

    def span_corruption(self) -> SpanCorruption:
        return SpanCorruption(self.noise_density, self.mean_noise_span_length)


@dataclass
class TrainingArguments(CommonTrainingArguments):
    # T5's recipe: Adafactor (factored second moments, no momentum, updates clipped at 1.0 by their root mean
    # square, not by a global norm), at a constant 1e-2.
    optim: str = field(
        default="adafactor",
        metadata={"help": "The optimizer, one of the script's OPTIMIZERS: {names}. adafactor is T5's."},
    )
    learning_rate: float = field(default=1e-2, metadata={"help": "Peak learning rate (T5 pretrained at 1e-2)."})
    lr_scheduler_type: str = field(
        default="constant",
        metadata={
            "help": "The learning rate after warm-up, one of the script's LEARNING_RATE_SCHEDULES: {names}. "
            "inverse_sqrt: the peak times sqrt(warmup_steps / step), T5's schedule after its 10,000 steps at 1e-2."
        },
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Clip gradients to this global norm; 0 (T5's Adafactor clips its updates): no clipping."},
    )


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line; fill in the defaults of check_common_arguments
    (after initialize_distributed: see check_common_arguments)."""
    check_numeric_arguments(
        (data_args, training_args),
        max_seq_length=(lambda value: value >= 2, "must be at least 2"),
        noise_density=(lambda value: 0 < value < 1, "must be between 0 and 1, such as 0.15"),
        mean_noise_span_length=(lambda value: value >= 1, "must be 1 or more, such as 3"),
    )
    if data_args.streaming and not data_args.packed_data_dir:
        raise UsageError(
            "run_t5_mlm_flax.py does not corrupt a stream while training; add --packed_data_dir to pack the stream "
            "once and train on it"
        )
    if data_args.text_sample_by is None:
        data_args.text_sample_by = "document"
    check_common_arguments(model_args, data_args, training_args)
    check_best_model_flags(training_args, EVAL_METRICS)  # after the defaults of --do_train and --do_eval


# ----------------------------------------------------------------------------------------------------
# Data: texts become rows of tokens (or pairs become rows of an input and a target), corrupted on the host
# ----------------------------------------------------------------------------------------------------


def read_texts(source: TextSource, streaming: bool = False, evaluation_only: bool = False) -> dict:
    """The texts of each split, {"train": ..., "validation": ...}: `datasets` datasets of one document (or one pair) a
    row. Every data route reads them here. JaxSeq's pair columns in_text/out_text are renamed prompt/completion."""
    texts = load_text_datasets(source, streaming, evaluation_only)
    return {split: pair_columns(dataset) for split, dataset in texts.items()}


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


def tokenized_rows(
    dataset, split: str, tokenizer, row_length: int, source: TextSource, num_workers=None
) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split of plain text: its texts, each followed by </s>, joined and
    cut into rows of `row_length` tokens, the length whose corrupted input is --max_seq_length long. Tokenized in
    `num_workers` processes (--preprocessing_num_workers)."""
    yield from pack_blocks(token_arrays(dataset, tokenizer, source.text_column_name, num_workers, split), row_length)


def example_rows(
    dataset,
    split: str,
    tokenizer,
    row_length: int,
    source: TextSource,
    example_format: str,
    max_seq_length: int,
    num_workers=None,
) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split of pairs: (count, 2, max_seq_length), the input's ids and the
    target's, padded (flax_lm.data.text_pairs). Conversations are refused: a sequence-to-sequence model reads pairs.
    The corpus records their length, --max_seq_length; `row_length`, that of rows of text, is not theirs."""
    if example_format != PROMPT_COMPLETION:
        raise UsageError(
            f"the {split} data are {FORMAT_NAMES[example_format]}; run_t5_mlm_flax.py trains on plain text or on "
            "input/target pairs of text (prompt/completion or in_text/out_text)"
        )
    yield from pair_rows(dataset, split, tokenizer, max_seq_length, source, num_workers)


@dataclass(frozen=True)
class BatchMaker:
    """Turns rows into model inputs: rows of text corrupted into inputs and targets (corrupt_spans), or rows of
    pairs taken as they are. Each process makes only its own rows of a global batch, and corrupts a row with random
    numbers drawn for its number in the global batch, so the global batch is the same whatever the process count.

    A batch: input_ids and attention_mask (rows, input width); labels, decoder_input_ids (the labels shifted right
    after the decoder's start token) and label_weights (1.0 for a target token, 0.0 for padding and for the empty
    rows that fill up a partial batch), (rows, target width); the widths are those of `widths`."""

    corruption: SpanCorruption
    sentinel_ids: tuple  # of <extra_id_0>, <extra_id_1>, ...: the n-th dropped span of a row becomes the n-th
    eos_token_id: int
    pad_token_id: int
    decoder_start_token_id: int
    max_seq_length: int
    row_length: int  # of plain text: tokens in a row before corruption
    target_length: int  # of plain text: tokens in a corrupted row's target

    def widths(self, rows, indices: np.ndarray) -> tuple[int, int]:
        """The lengths of the inputs and of the targets of a batch: of plain text, fixed; of pairs, the longest input
        and target of the global batch (so the same on every process), each rounded up to a power of two from 16 to
        --max_seq_length, so that short targets cost no decoder work and few shapes compile."""
        if len(rows.shape) != 3:
            return self.max_seq_length, self.target_length
        used = (np.asarray(rows[indices]) != self.pad_token_id).any(axis=0)  # (2, max_seq_length)
        longest = [int(np.flatnonzero(side)[-1]) + 1 if side.any() else 1 for side in used]
        return tuple(min(self.max_seq_length, max(16, 1 << (length - 1).bit_length())) for length in longest)

    def corrupted(self, rows: np.ndarray, seed: tuple, row_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of rows of text: T5's span corruption."""
        return corrupt_spans(rows, self.corruption, self.sentinel_ids, self.eos_token_id, seed, row_numbers)

    def __call__(self, rows, indices: np.ndarray, num_rows: int, seed: tuple, own: slice = slice(None)) -> dict:
        """The rows `own` of the batch of `num_rows` rows made from rows[indices], then empty rows."""
        row_numbers = np.arange(num_rows)[own]
        own_indices = indices[own]
        pairs = len(rows.shape) == 3  # a packed corpus, a mixture or an array
        input_width, target_width = self.widths(rows, indices)
        inputs = np.full((len(row_numbers), input_width), self.pad_token_id, np.int32)
        labels = np.full((len(row_numbers), target_width), self.pad_token_id, np.int32)
        if len(own_indices) and pairs:
            data = np.asarray(rows[own_indices])
            inputs[: len(own_indices)], labels[: len(own_indices)] = (
                data[:, 0, :input_width],
                data[:, 1, :target_width],
            )
        elif len(own_indices):
            data = np.asarray(rows[own_indices])
            inputs[: len(own_indices)], labels[: len(own_indices)] = self.corrupted(
                data, seed, row_numbers[: len(data)]
            )
        is_row = (np.arange(len(row_numbers)) < len(own_indices))[:, None]
        # A padding token is no input nor target of pairs; an empty row attends to its padding (all masked: NaN).
        attention_mask = ((inputs != self.pad_token_id) | ~is_row).astype(np.int32)
        label_weights = ((labels != self.pad_token_id) & is_row).astype(np.float32)
        decoder_input_ids = np.concatenate(
            [np.full_like(labels[:, :1], self.decoder_start_token_id), labels[:, :-1]], 1
        )
        return {
            "input_ids": inputs,
            "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids,
            "labels": labels,
            "label_weights": label_weights,
        }

    def tokens_of(self, rows, indices: np.ndarray) -> int:
        """The tokens of text the rows hold: a row of text's, or the input's and target's of a pair."""
        if len(rows.shape) == 3:
            return int((np.asarray(rows[indices]) != self.pad_token_id).sum())
        return len(indices) * self.row_length


# Separate random streams for the corruption of training and of evaluation batches.
TRAIN_CORRUPTION, EVAL_CORRUPTION = 0, 1


def train_batches(
    rows, make_batch: BatchMaker, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[tuple[dict, int]]:
    """This process's rows of each global batch of one epoch, from batch `first_batch` on, with the global batch's
    number of tokens. Order and corruption are fixed by seed, epoch and batch, so a resumed run goes on with the very
    batches the interrupted one would have seen."""
    own = process_slice(global_batch_size)
    for step, indices in epoch_batch_indices(len(rows), global_batch_size, seed, epoch, first_batch):
        batch = make_batch(rows, indices, global_batch_size, (seed, TRAIN_CORRUPTION, epoch, step), own)
        yield batch, make_batch.tokens_of(rows, indices)


def mixture_train_batches(
    mixture: Mixture, make_batch: BatchMaker, global_batch_size: int, seed: int, first_step: int
) -> Iterator[tuple[dict, int]]:
    """As train_batches, for the global batches a Mixture draws from the step after `first_step` on, without end;
    step s's corruption is drawn from (seed, s)."""
    own = process_slice(global_batch_size)
    global_batches = mixture.global_batches(global_batch_size, seed, first_step)
    for step, indices in zip(itertools.count(first_step), global_batches):
        batch = make_batch(mixture, indices, global_batch_size, (seed, TRAIN_CORRUPTION, step), own)
        yield batch, make_batch.tokens_of(mixture, indices)


def eval_batches(rows, make_batch: BatchMaker, global_batch_size: int, seed: int) -> Iterator[dict]:
    """This process's rows of batches holding every row once, in order, corrupted the same way at every evaluation
    (seeded by the batch's index), so evaluations are comparable. The last batch is filled up with empty rows."""
    own = process_slice(global_batch_size)
    for batch_index, start in enumerate(range(0, len(rows), global_batch_size)):
        indices = np.arange(start, min(start + global_batch_size, len(rows)))
        yield make_batch(rows, indices, global_batch_size, (seed, EVAL_CORRUPTION, batch_index), own)


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
# ----------------------------------------------------------------------------------------------------


def seq2seq_objective(logits, labels, label_weights):
    """What the train step differentiates and logs as train/loss: the target tokens' summed cross-entropy. Edit it to
    train on another loss (label smoothing): evaluation reports target_loss_sums, the exact cross-entropy."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.sum(losses * label_weights)


def target_loss_sums(logits, labels, label_weights):
    """Sum of cross-entropy, number of correct predictions and number of target tokens: the evaluation's metrics (and
    the training's accuracy), summed so that dividing once on the host gives exact token-weighted averages."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (loss * label_weights).sum(), (correct * label_weights).sum(), label_weights.sum()


# What the train step sums over target tokens, and the metrics shown from those sums.
TRAIN_METRIC_SUMS = ("loss_sum", "correct_sum", "weight_sum")


def train_metrics(sums: dict) -> dict:
    """The training metrics of a log line and of train_results.json, from the sums over the steps it covers."""
    target_tokens = max(sums["weight_sum"], 1.0)
    return {"loss": sums["loss_sum"] / target_tokens, "accuracy": sums["correct_sum"] / target_tokens}


# Copied from run_clm_flax.learning_rate_schedule
def learning_rate_schedule(settings: optimizers.OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    schedule_after_warmup = LEARNING_RATE_SCHEDULES[settings.lr_scheduler_type]
    return optimizers.after_linear_warmup(schedule_after_warmup, settings, total_steps)


def inverse_square_root(settings: optimizers.OptimizerSettings, warmup_steps: int, total_steps: int):
    """T5's decay: the peak times sqrt(warmup_steps / step), step counted from the run's start (T5: 1e-2 for 10,000
    steps, then 1 / sqrt(step))."""
    start = max(warmup_steps, 1)
    return lambda step: settings.learning_rate * jnp.sqrt(start / (start + step))


# What --lr_scheduler_type names: the learning rate after the warm-up, from (settings, warmup_steps, total_steps);
# its step 0 is the first step after the warm-up. Add an entry here and the flag takes it.
LEARNING_RATE_SCHEDULES = {
    "constant": lambda settings, *_: optax.constant_schedule(settings.learning_rate),
    "inverse_sqrt": inverse_square_root,
    "linear": optimizers.decay_to_the_end("linear"),
    "cosine": optimizers.decay_to_the_end("cosine"),
    "warmup_stable_decay": optimizers.warmup_stable_decay,
}


# Copied from run_clm_flax.decay_mask
def decay_mask(params):
    """True for the weights AdamW decays: matrices and embeddings, not biases or LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


# Copied from run_clm_flax.is_trained
def is_trained(path, param) -> bool:
    """Whether training updates this parameter (all do; to train only attention: `return "attn" in [entry.key for
    entry in path]`). A frozen one is not differentiated, has no optimizer state, no share in the gradient norm."""
    return True


# What --optim names: the optimizer from (settings, schedule). Add an entry here and the flag takes it. adafactor is
# optax's, whose defaults are T5's: second moments factored for matrices, decay 0.8, no momentum, updates clipped
# at a root mean square of 1.0 and scaled by the parameter's.
OPTIMIZERS = {
    "adafactor": lambda settings, schedule: optimizers.adafactor(settings, schedule, decay_mask),
    "adamw": lambda settings, schedule: optimizers.adamw(settings, schedule, decay_mask),
    "lion": lambda settings, schedule: optimizers.lion(settings, schedule, decay_mask),
}


# The tables the flags name, whose names --help lists.
# Copied from run_clm_flax.FLAG_TABLES
FLAG_TABLES = {"optim": OPTIMIZERS, "lr_scheduler_type": LEARNING_RATE_SCHEDULES}


# Copied from run_clm_flax.create_optimizer
def create_optimizer(
    settings: optimizers.OptimizerSettings, schedule: optax.Schedule, trains=None
) -> optax.GradientTransformation:
    """The optimizer of --optim, for the parameters is_trained picks (or `trains`, in its place: LoRA's adapters)."""
    optimizer = OPTIMIZERS[settings.optim](settings, schedule)
    if settings.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), optimizer)
    return optimizers.trained_only(optimizer, trains or is_trained)


def model_logits(model, params, batch, **options):
    return model.apply(
        {"params": params}, batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"], **options
    )


# The dropout masks' PRNG: Philox draws them 5 times faster than jax's default, Threefry, on a CPU, where they took a
# sixth of T5's step (attention weights are dropped out too); alike in law, another stream (benchmarks/README.md).
DROPOUT_PRNG = "philox2x32"


def make_train_step(model, optimizer, schedule, seed: int):
    dropout_key = jax.random.key(seed + 1, impl=DROPOUT_PRNG)

    def loss_and_sums(params, micro_batch, dropout_rng):
        logits = model_logits(model, params, micro_batch, deterministic=False, rngs={"dropout": dropout_rng})
        labels, label_weights = micro_batch["labels"], micro_batch["label_weights"]
        _, correct_sum, weight_sum = target_loss_sums(logits, labels, label_weights)
        loss_sum = seq2seq_objective(logits, labels, label_weights)
        return loss_sum, {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    def train_step(state: TrainState, batch):
        grads, sums = step_gradients(loss_and_sums, state, batch, dropout_key, is_trained)
        # The mean over every target token of the whole batch.
        target_tokens = jnp.maximum(sums["weight_sum"], 1.0)
        new_state, update_metrics = apply_mean_update(state, grads, target_tokens, sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


# What flax_lm's set-up (set_up_training) builds the training from: this script's schedule, optimizer and train step,
# the sums its train step makes, and the flag of its sequence length.
# Copied from run_clm_flax.SCRIPT_TRAINING with block_size->max_seq_length
SCRIPT_TRAINING = ScriptTraining(
    learning_rate_schedule, create_optimizer, make_train_step, TRAIN_METRIC_SUMS, "max_seq_length"
)


def make_eval_step(model):
    def eval_step(params, batch):
        logits = model_logits(model, params, batch)
        loss_sum, correct_sum, weight_sum = target_loss_sums(logits, batch["labels"], batch["label_weights"])
        return {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    return eval_step


def describe_results(results: dict) -> str:
    return (
        f"loss {results['loss']:.4f}, perplexity {results['perplexity']:.2f}, accuracy {results['accuracy']:.4f} "
        f"over {results['target_tokens']} target tokens"
    )


# What each evaluation reports (the log, the trackers, eval_results.json), of what evaluation_results returns.
EVAL_METRICS = ("loss", "perplexity", "accuracy")


def evaluation_results(totals: dict) -> dict:
    """Loss, perplexity and accuracy, averaged exactly over the target tokens."""
    target_tokens = totals["weight_sum"]
    loss = totals["loss_sum"] / max(target_tokens, 1.0)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 100.0)),
        "accuracy": totals["correct_sum"] / max(target_tokens, 1.0),
        "target_tokens": int(target_tokens),
    }


class Evaluation:
    """Evaluation on the validation rows, corrupted the same way each time."""

    def __init__(self, setup: TrainingSetup, rows, make_batch: BatchMaker, training_args, trackers):
        self.setup, self.rows, self.make_batch, self.trackers = setup, rows, make_batch, trackers
        self.output_dir, self.seed = training_args.output_dir, training_args.seed

    def __call__(self, params, step: int) -> dict:
        """The results on the whole evaluation data; with a mixture, those of each source under "sources" too."""
        sums_of = partial(self.sums, params)
        return validation_results(
            sums_of, self.rows, evaluation_results, step, self.trackers, EVAL_METRICS, describe_results
        )

    def sums(self, params, rows) -> dict:
        setup, batch_size = self.setup, self.setup.eval_batch_size
        batches = eval_batches(rows, self.make_batch, batch_size, self.seed)
        sums = summed_over_batches(
            setup.eval_step, params, batches, math.ceil(len(rows) / batch_size), setup.batch_sharding
        )
        return dict.fromkeys(TRAIN_METRIC_SUMS, 0.0) | sums

    def final(self, params, step: int) -> dict:
        """Evaluate the final weights: results written to eval_results.json by process 0 and printed, and returned."""
        results = self(params, step)
        if jax.process_index() == 0:
            saved = saved_results(results, (*EVAL_METRICS, "target_tokens"), self.rows) | {"step": step}
            write_json(os.path.join(self.output_dir, "eval_results.json"), saved)
            print(f"eval: {describe_results(results)}")
        return results


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    argument_types = (ModelArguments, DataTrainingArguments, TrainingArguments)
    model_args, data_args, training_args = start_run(argument_types, check_arguments, FLAG_TABLES)

    config, tokenizer = load_config_and_tokenizer(model_loading(model_args), "t5")
    make_batch = batch_maker(config, tokenizer, data_args)
    mesh = create_mesh(training_args.mesh_shape)
    compare_exports = not model_args.skip_export_check
    model_code = load_model_code(
        config,
        model_args.model_file,
        False,
        "run_t5_mlm_flax.py",
        mesh,
        compare_exports=compare_exports,
        encoder_decoder=True,
    )
    texts_to_rows = script_texts_to_rows(data_args, tokenizer, make_batch)
    route = data_args.data_route(model_args, training_args)
    rows, _, _ = load_data(route, texts_to_rows)
    if packs_only(training_args, data_args.packed_data_dir):
        return

    model = t5_model(config, model_args, mesh, model_code)
    settings, train_rows, eval_step = training_args.training_settings(), rows.get("train"), make_eval_step(model)
    setup = set_up_training(
        model, model_code, SCRIPT_TRAINING, eval_step, settings, train_rows, data_args.max_seq_length
    )
    apply_strategies(training_args, setup.steps_per_epoch, setup.total_steps)
    compile_train_steps_ahead(setup, make_batch, training_args)
    arguments = (model_args, data_args, training_args)
    state, this_run = start_training(setup, arguments, config, tokenizer, train_metrics, EVAL_METRICS, __file__)
    evaluation = Evaluation(setup, rows.get("validation"), make_batch, training_args, this_run.trackers)

    if this_run.trains_now:
        batches = train_batches_from(this_run.progress.step, setup, make_batch, training_args)
        state, this_run.stopped_by = train(
            state, this_run.progress, batches, setup, this_run.save, evaluation, this_run.log, training_args
        )
    this_run.finish(state, evaluation, lambda: None)


def batch_maker(config, tokenizer, data_args) -> BatchMaker:
    """The BatchMaker of the flags' lengths, refusing a config that is not T5's, a tokenizer without the sentinels
    span corruption needs, and a --max_seq_length too short for one span."""
    if config.model_type != "t5":
        raise UsageError(f"run_t5_mlm_flax.py trains T5 models, and the config is of a {config.model_type} model")
    corruption = data_args.span_corruption()
    row_length, target_length = span_corruption_lengths(data_args.max_seq_length, corruption)
    _, spans = corruption.noise_counts(row_length)
    sentinel_ids = sentinel_token_ids(tokenizer, tokenizer.name_or_path)
    if len(sentinel_ids) < spans:
        raise UsageError(
            f"--max_seq_length {data_args.max_seq_length} corrupts rows of {row_length} tokens, dropping {spans} "
            f"spans, and the tokenizer {tokenizer.name_or_path} has {len(sentinel_ids)} sentinels (one a span); "
            "lower --max_seq_length, or train a tokenizer with more (train_tokenizer.py --model_type t5 has 100)"
        )
    start = getattr(config, "decoder_start_token_id", None)  # T5's is pad
    return BatchMaker(
        corruption=corruption,
        sentinel_ids=tuple(sentinel_ids[:spans]),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=config.pad_token_id if start is None else start,
        max_seq_length=data_args.max_seq_length,
        row_length=row_length,
        target_length=target_length,
    )


def script_texts_to_rows(data_args, tokenizer, make_batch: BatchMaker) -> TextsToRows:
    """How this script's texts become rows of plain text (of make_batch.row_length tokens, which corrupt into inputs of
    --max_seq_length) or of pairs (of --max_seq_length, which keys their token cache), with the settings of its flags
    bound."""
    workers = data_args.preprocessing_num_workers
    rows = partial(tokenized_rows, num_workers=workers)
    examples = partial(example_rows, max_seq_length=data_args.max_seq_length, num_workers=workers)
    return TextsToRows(
        read_texts, rows, tokenizer, make_batch.row_length, "--max_seq_length", examples,
        example_row_length=data_args.max_seq_length,
    )  # fmt: skip


def t5_model(config, model_args, mesh, model_code):
    """The model of `model_code` to train on `mesh`, in the dtypes asked for."""
    dtypes = jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype)
    return model_code.module.MODEL_CLASS(config, *dtypes, model_args.gradient_checkpointing, mesh)


def train_batches_from(first_step, setup: TrainingSetup, make_batch: BatchMaker, training_args):
    """The global batches of each compiled call after `first_step` (steps_of_calls says how many steps each runs),
    stacked, and the token count of each step, read ahead on a thread. The data order and the corruption are a
    function of the step, so a resumed run sees the batches the interrupted one would have."""
    batch_size, train_rows = setup.train_batch_size, setup.train_rows
    if isinstance(train_rows, Mixture):
        data = f"on a mixture ({train_rows.describe(setup.total_steps * batch_size)})"
        local_batches = mixture_train_batches(train_rows, make_batch, batch_size, training_args.seed, first_step)
    else:
        data = f"({setup.total_steps / setup.steps_per_epoch:.2f} epochs of {len(train_rows)} rows)"
        batches_of_epoch = partial(train_batches, train_rows, make_batch, batch_size, training_args.seed)
        local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    logger.info("Training steps %d to %d %s, global batch %d", first_step + 1, setup.total_steps, data, batch_size)
    calls = steps_of_calls(first_step, setup.total_steps, training_args)
    accumulation_steps, sharding = training_args.gradient_accumulation_steps, setup.call_batches_sharding
    local_batches = as_wide_as_their_call(local_batches, calls, make_batch.pad_token_id)
    return call_batches(local_batches, accumulation_steps, calls, training_args.steps_per_call, sharding)


def as_wide_as_their_call(batches_and_tokens, calls: list[int], pad_token_id: int):
    """The batches of each call padded to the widest of the call, which runs them as one array: batches of pairs are
    as wide as their longest pair. Padding is the pad token, a weight of 0 and no attention."""
    for steps in calls:
        group = list(itertools.islice(batches_and_tokens, steps))
        widths = {name: max(batch[name].shape[1] for batch, _ in group) for name in group[0][0]}
        for batch, tokens in group:
            padded = {}
            for name, values in batch.items():
                fill = pad_token_id if name.endswith("ids") or name == "labels" else 0
                padded[name] = np.pad(values, ((0, 0), (0, widths[name] - values.shape[1])), constant_values=fill)
            yield padded, tokens


def compile_train_steps_ahead(setup: TrainingSetup, make_batch: BatchMaker, training_args):
    """With --do_train, start compiling the train step on a thread, while the weights are initialised or restored,
    for batches of the shape of the training rows (of text, or of pairs)."""
    if not training_args.do_train:
        return
    batch_size = setup.train_batch_size
    global_batch = make_batch(setup.train_rows, np.zeros(batch_size, np.int64), batch_size, (training_args.seed,))
    accumulation_steps, steps_per_call = training_args.gradient_accumulation_steps, training_args.steps_per_call
    abstract_batches = call_batch_shapes(global_batch, accumulation_steps, steps_per_call, setup.call_batches_sharding)
    compile_in_background(setup.compiled_train_steps, setup.abstract_state, abstract_batches, steps_per_call)


# Copied from run_clm_flax.steps_of_calls
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


# Copied from run_clm_flax.train
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
