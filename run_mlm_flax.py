#!/usr/bin/env python3
"""Pretrain a RoBERTa masked language model with JAX/Flax.

Trains from scratch (a config and a tokenizer, for example from create_config.py --preset roberta-tiny and
train_tokenizer.py --model_type roberta) or continues from a Hugging Face RoBERTa checkpoint, on text from local files
(txt, json/jsonl, csv, parquet; globs allowed), a local dataset directory or a `datasets` hub name. The blocks
it trains on (its rows) are grouped texts (the default: texts joined with the separator </s> and cut into blocks
framed as `<s> ... </s>` of exactly --max_seq_length tokens) or, with --line_by_line, one non-empty line (or text)
each, framed the same way, truncated and padded per batch.

Every batch is masked on the host with numpy, reproducibly from --seed: each token that is not a special token or
padding is chosen with probability --mlm_probability; of the chosen, 80% become <mask>, 10% a random token and 10% stay
as they are. The loss and the accuracy count the chosen tokens only. On several hosts every host runs the same command,
each makes and masks only its own rows of every batch, and process 0 writes the outputs.

The output directory is an ordinary Hugging Face model directory (config.json, model.safetensors, tokenizer files) that
`AutoModelForMaskedLM` and `pipeline("fill-mask")` load in PyTorch; with --lora_rank (low-rank adapters on the frozen
--model_name_or_path) a PEFT adapter (docs/adapting.md).

    ./run_mlm_flax.py --output_dir roberta-run --config_name my-model --tokenizer_name my-model \
        --train_file "data/*.txt" --do_train --do_eval --max_seq_length 128

A single .json file holding the arguments works too: `./run_mlm_flax.py args.json`.

This file holds what an experiment changes, in reading order: its arguments, how texts become blocks and how they are
masked, the loss, the optimizer and schedule, the train and eval steps, evaluation and fill-mask, and the loop in
main(). The model (flax_lm/models/roberta/model.py, or --model_file) and what every run shares (checkpoints, trackers,
data storage, processes) are imported from the flax_lm package: copy this file anywhere, edit it, and run it where
flax_lm is installed.
"""

import itertools
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
from flax_lm.command_line.lora_flags import LoraArguments, adapted, check_lora_flags
from flax_lm.command_line.model_loading import model_loading
from flax_lm.command_line.phases import packs_only, start_training
from flax_lm.command_line.start import start_run
from flax_lm.command_line.trainer_flags import apply_strategies, check_best_model_flags
from flax_lm.data.host_random import random_bits, uniform_from_bits
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
from flax_lm.data.source import TextSource
from flax_lm.data.texts import load_text_datasets, map_in_workers, text_batches, token_arrays
from flax_lm.devices.mesh import create_mesh, process_slice
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.evaluation.validation import (
    evaluate_on_start,
    evaluation_sets,
    saved_results,
    summed_over_batches,
    validation_results,
)
from flax_lm.models import check_model_type
from flax_lm.models.huggingface import load_config_and_tokenizer
from flax_lm.models.model_code import ModelCode, load_model_code
from flax_lm.models.roberta.model import check_tokenizer
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
class DataTrainingArguments(CommonDataArguments):
    max_seq_length: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per block (a row of a batch), <s> and </s> included. Defaults to the smaller of the "
            "tokenizer's model_max_length and the positions the model has (max_position_embeddings - pad_token_id - "
            "1)."
        },
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Fraction of the tokens chosen for the model to predict."}
    )
    line_by_line: bool = field(
        default=False,
        metadata={
            "help": "Make every non-empty line (or text) a block of its own, truncated to --max_seq_length, instead "
            "of joining the texts and cutting them into full blocks. Each line is stored padded to --max_seq_length, "
            "so short lines take more disk than their tokens (as uint16 ids, 2 x --max_seq_length bytes a line)."
        },
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "With --line_by_line, pad every batch to --max_seq_length. Otherwise a batch is padded to the "
            "next power of two (at least 16) above its longest line, so jit compiles only a few shapes."
        },
    )
    document_attention: bool = field(
        default=False,
        metadata={
            "help": "In a block of texts joined end to end, a token attends only to its own text and positions "
            "restart at each </s> between texts, which starts the text after it. Not with --line_by_line, where "
            "each block is one text already."
        },
    )

    @property
    def framing(self) -> str:
        return "line_by_line" if self.line_by_line else "grouped"


@dataclass
class TrainingArguments(LoraArguments, CommonTrainingArguments):  # LoRA's flags (--lora_rank ...): LoraArguments
    fill_mask_text: str = field(
        default="",
        metadata={
            "help": "Text with one <mask> (the tokenizer's mask token) for the fill-mask demo run on the saved model "
            "at the end of training. Default: the start of the first validation text, its middle word masked."
        },
    )
    fill_mask_top_k: int = field(default=5, metadata={"help": "Predictions shown by the fill-mask demo; 0 for none."})


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments: --text_sample_by from --line_by_line, one step per compiled call for batches padded each to its own
    length, and those of check_common_arguments (after initialize_distributed: see check_common_arguments)."""
    check_model_type(model_args.model_type, generates_text=False)
    check_lora_flags(model_args, training_args)
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
    if data_args.line_by_line and data_args.document_attention:
        raise UsageError(
            "--document_attention has no effect with --line_by_line, where each block is one line (or text) "
            "already; drop one of them"
        )
    if data_args.line_by_line and not data_args.pad_to_max_length:
        # Each batch is padded to its own length, and one compiled call runs steps of one shape only.
        if (training_args.steps_per_call or 1) > 1:
            raise UsageError(
                f"--steps_per_call {training_args.steps_per_call} needs batches of one length: with --line_by_line "
                "add --pad_to_max_length, or leave out --steps_per_call"
            )
        training_args.steps_per_call = 1
    check_common_arguments(model_args, data_args, training_args)
    check_best_model_flags(training_args, EVAL_METRICS)  # after the defaults of --do_train and --do_eval


# ----------------------------------------------------------------------------------------------------
# Data: texts become blocks or lines of tokens, framed as <s> ... </s> and masked on the host
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.read_texts
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
    dataset, split: str, tokenizer, block_size: int, source: TextSource, num_workers=None, line_by_line=False
) -> Iterator[np.ndarray]:
    """The rows of a packed corpus made from one split: its texts, each followed by </s>, joined and cut into blocks;
    or with --line_by_line a row per line (encode_lines). Tokenized in `num_workers` processes
    (--preprocessing_num_workers). The number of lines cut short is logged at the end."""
    column = source.text_column_name
    if not line_by_line:
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
    """Turns blocks into masked model inputs: every block framed as <s> tokens </s>, padded, masked.

    Blocks are rows of max_seq_length - 2 tokens (a 2-D array-like): blocks of grouped texts, or with line_by_line
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

    @property
    def pads_each_batch(self) -> bool:
        """Whether batches are padded each to its own length (and so differ in shape)."""
        return self.line_by_line and not self.pad_to_max_length

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest row has `longest` tokens is padded to. jit compiles the step once
        per length, so padded batches take only a few: powers of two from 16, capped at max_seq_length."""
        if self.pad_to_max_length:
            return self.max_seq_length
        return min(self.max_seq_length, max(16, 1 << (longest - 1).bit_length()))

    def block_lengths(self, blocks, indices: np.ndarray) -> np.ndarray:
        """The tokens between <s> and </s> of each of blocks[indices]: a block's width, or a line's length (the
        position after its last token that is not padding), which reads the rows."""
        if not self.line_by_line:
            return np.full(len(indices), blocks.shape[1])
        not_padding = np.asarray(blocks[indices]) != self.pad_token_id
        return (not_padding * np.arange(1, blocks.shape[1] + 1)).max(axis=1, initial=0)

    def token_ids(
        self, blocks, indices: np.ndarray, num_rows: int, rows: slice = slice(None)
    ) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), int32 (rows, length), unmasked: the rows `rows` of a batch of `num_rows`
        rows, blocks[indices] and then empty blocks (<s> </s>), which fill up a partial batch and have nothing
        to predict. The length, the same on every process, is that of the longest block of the whole batch,
        padded: so of lines every row of the batch is read, of blocks only the rows `rows`."""
        row_lengths = np.zeros(num_rows, np.int64)  # tokens between <s> and </s>
        row_lengths[: len(indices)] = self.block_lengths(blocks, indices)
        length = self.padded_length(int(row_lengths.max()) + 2)
        own_indices, row_lengths = indices[rows], row_lengths[rows]  # the blocks come first, so they lead here too

        input_ids = np.full((len(row_lengths), length), self.pad_token_id, np.int32)
        input_ids[:, 0] = self.bos_token_id
        if len(own_indices):  # a line's row is padded already; a block fills the row
            input_ids[: len(own_indices), 1:-1] = np.asarray(blocks[own_indices])[:, : length - 2]
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
        if (most_chosen := int(label_weights.sum(axis=1).max(initial=0))) > predictions:
            raise UsageError(
                f"the masking chose {most_chosen} positions of a row of {input_ids.shape[1]} tokens, more than the "
                f"{predictions} predictions_per_row makes room for: the rest would be corrupted and never predicted; "
                "let mask_tokens keep at most max_chosen_per_row of a row, or make predictions_per_row room for them"
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

    def __call__(self, blocks, indices: np.ndarray, num_rows: int, seed: tuple, rows: slice = slice(None)) -> dict:
        """The rows `rows` of the masked batch of `num_rows` rows made from blocks[indices]."""
        input_ids, attention_mask = self.token_ids(blocks, indices, num_rows, rows)
        return self.masked(input_ids, attention_mask, seed, np.arange(num_rows)[rows])


# Separate random streams for the masks of training and of evaluation batches.
TRAIN_MASKING, EVAL_MASKING = 0, 1


def train_batches(
    blocks, make_batch: BatchMaker, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[tuple[dict, int]]:
    """This process's rows of each masked global batch of one epoch, from batch `first_batch` on, with the
    global batch's number of tokens (padding left out). Order and masks are fixed by seed, epoch and batch, so a
    resumed run goes on with the very batches the interrupted one would have seen; the blocks left over after the
    last full batch differ from epoch to epoch."""
    rows = process_slice(global_batch_size)
    for step, indices in epoch_batch_indices(len(blocks), global_batch_size, seed, epoch, first_batch):
        batch = make_batch(blocks, indices, global_batch_size, (seed, TRAIN_MASKING, epoch, step), rows)
        yield batch, int(np.sum(make_batch.block_lengths(blocks, indices) + 2))


def mixture_train_batches(
    mixture: Mixture, make_batch: BatchMaker, global_batch_size: int, seed: int, first_step: int
) -> Iterator[tuple[dict, int]]:
    """As train_batches, for the global batches a Mixture draws from the step after `first_step` on, without end;
    step s's masks are drawn from (seed, s)."""
    rows = process_slice(global_batch_size)
    global_batches = mixture.global_batches(global_batch_size, seed, first_step)
    for step, indices in zip(itertools.count(first_step), global_batches):
        batch = make_batch(mixture, indices, global_batch_size, (seed, TRAIN_MASKING, step), rows)
        yield batch, int(np.sum(make_batch.block_lengths(mixture, indices) + 2))


def eval_batches(blocks, make_batch: BatchMaker, global_batch_size: int, seed: int) -> Iterator[dict]:
    """This process's rows of batches holding every block once, in order, masked the same way at every
    evaluation (the masks are seeded by the batch's index), so evaluations are comparable. The last batch is
    filled up with empty rows, none dropped."""
    rows = process_slice(global_batch_size)
    for batch_index, start in enumerate(range(0, len(blocks), global_batch_size)):
        indices = np.arange(start, min(start + global_batch_size, len(blocks)))
        yield make_batch(blocks, indices, global_batch_size, (seed, EVAL_MASKING, batch_index), rows)


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


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
# ----------------------------------------------------------------------------------------------------


def masked_lm_objective(logits, labels, label_weights):
    """What the train step differentiates and logs as train/loss: the masked tokens' summed cross-entropy. Edit it to
    train on another loss (label smoothing): evaluation reports masked_lm_loss_sums, the exact cross-entropy."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.sum(losses * label_weights.astype(jnp.float32))


def masked_lm_loss_sums(logits, labels, label_weights):
    """Sum of cross-entropy, number of correct predictions and number of counted positions: the evaluation's metrics
    (and the training's accuracy), apart from the objective trained on (masked_lm_objective), which an edit changes.

    logits: (batch, positions, vocab), at every position or only at those to predict; labels: (batch, positions)
    int; label_weights: (batch, positions), 1.0 where the position counts. Returns three float32 scalars; summing
    them over batches and dividing once on the host gives exact averages whatever the number of masked positions.
    """
    logits = logits.astype(jnp.float32)
    label_weights = label_weights.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # (batch, positions)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (loss * label_weights).sum(), (correct * label_weights).sum(), label_weights.sum()


# What the train step sums over masked tokens, and the metrics shown from those sums.
TRAIN_METRIC_SUMS = ("loss_sum", "correct_sum", "weight_sum")


def train_metrics(sums: dict) -> dict:
    """The training metrics of a log line and of train_results.json, from the sums over the steps it covers."""
    masked_tokens = max(sums["weight_sum"], 1.0)
    return {"loss": sums["loss_sum"] / masked_tokens, "accuracy": sums["correct_sum"] / masked_tokens}


# Copied from run_clm_flax.learning_rate_schedule
def learning_rate_schedule(settings: optimizers.OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    schedule_after_warmup = LEARNING_RATE_SCHEDULES[settings.lr_scheduler_type]
    return optimizers.after_linear_warmup(schedule_after_warmup, settings, total_steps)


# What --lr_scheduler_type names: the learning rate after the warm-up, from (settings, warmup_steps, total_steps);
# its step 0 is the first step after the warm-up. Add an entry here and the flag takes it. The decays end at
# --min_lr_rate of the peak, in a shape of flax_lm.training.optimizers.DECAY_SHAPES (warmup_stable_decay:
# --lr_decay_shape).
# Copied from run_clm_flax.LEARNING_RATE_SCHEDULES
LEARNING_RATE_SCHEDULES = {
    "linear": optimizers.decay_to_the_end("linear"),
    "cosine": optimizers.decay_to_the_end("cosine"),
    "constant": lambda settings, *_: optax.constant_schedule(settings.learning_rate),
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


# Copied from run_clm_flax.is_hidden_matrix
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
# Copied from run_clm_flax.OPTIMIZERS
OPTIMIZERS = {
    "adamw": lambda settings, schedule: optimizers.adamw(settings, schedule, decay_mask),
    "muon": lambda settings, schedule: optimizers.muon_with_adamw(
        settings, schedule, optimizers.adamw(settings, schedule, decay_mask), is_hidden_matrix
    ),
    "lion": lambda settings, schedule: optimizers.lion(settings, schedule, decay_mask),
    "adafactor": lambda settings, schedule: optimizers.adafactor(settings, schedule, decay_mask),
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


def make_train_step(model, optimizer, schedule, seed: int, trains=None):
    # `trains`: what trains in place of is_trained (LoRA's adapters: flax_lm.training.lora.is_adapter).
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
        labels, label_weights = micro_batch["masked_labels"], micro_batch["masked_weights"]
        _, correct_sum, weight_sum = masked_lm_loss_sums(logits, labels, label_weights)
        loss_sum = masked_lm_objective(logits, labels, label_weights)
        return loss_sum, {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": weight_sum}

    def train_step(state: TrainState, batch):
        grads, sums = step_gradients(loss_and_sums, state, batch, dropout_key, trains or is_trained)
        # The mean over every masked token of the whole batch; a batch with none leaves the gradients at 0.
        masked_tokens = jnp.maximum(sums["weight_sum"], 1.0)
        new_state, update_metrics = apply_mean_update(state, grads, masked_tokens, sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


def adapters_trained(script: ScriptTraining) -> ScriptTraining:
    """`script` training LoRA's adapters alone (--lora_rank): flax_lm.training.lora.is_adapter for is_trained."""
    optimizer, step = partial(create_optimizer, trains=is_adapter), partial(make_train_step, trains=is_adapter)
    return replace(script, create_optimizer=optimizer, make_train_step=step)


# What flax_lm's set-up (set_up_training) builds the training from: this script's schedule, optimizer and train step,
# the sums its train step makes, and the flag of its sequence length.
# Copied from run_clm_flax.SCRIPT_TRAINING with block_size->max_seq_length
SCRIPT_TRAINING = ScriptTraining(
    learning_rate_schedule, create_optimizer, make_train_step, TRAIN_METRIC_SUMS, "max_seq_length"
)


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


def evaluation_sums(eval_step, params, blocks, make_batch, global_batch_size, seed, batch_sharding) -> dict:
    """The eval step's sums over every block, masked the same way at each evaluation (by `seed`)."""
    num_batches = math.ceil(len(blocks) / global_batch_size)
    batches = eval_batches(blocks, make_batch, global_batch_size, seed)
    sums = summed_over_batches(eval_step, params, batches, num_batches, batch_sharding)
    return dict.fromkeys(TRAIN_METRIC_SUMS, 0.0) | sums  # the same sums as the train step's


def describe_results(results: dict) -> str:
    return (
        f"loss {results['loss']:.4f}, perplexity {results['perplexity']:.2f}, accuracy {results['accuracy']:.4f} "
        f"over {results['masked_tokens']} masked tokens"
    )


# What each evaluation reports (the log, the trackers, eval_results.json), of what evaluation_results returns: a new
# metric is a sum in make_eval_step, its ratio in evaluation_results, and its name here.
EVAL_METRICS = ("loss", "perplexity", "accuracy")


def evaluation_results(totals: dict) -> dict:
    """Loss, perplexity and accuracy, averaged exactly over masked tokens."""
    masked_tokens = totals["weight_sum"]
    loss = totals["loss_sum"] / max(masked_tokens, 1.0)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 100.0)),
        "accuracy": totals["correct_sum"] / max(masked_tokens, 1.0),
        "masked_tokens": int(masked_tokens),
    }


# ----------------------------------------------------------------------------------------------------
# Evaluation, and what the model predicts for a text with <mask> in it
# ----------------------------------------------------------------------------------------------------


def block_texts(blocks, tokenizer, count: int) -> Iterator[str]:
    """The texts of the first `count` blocks, decoded: each line, or each piece of a block between the
    </s> that end its texts."""
    for index in range(min(count, len(blocks))):
        block = np.asarray(blocks[index])
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


class Evaluation:
    """Evaluation on the validation blocks, masked the same way each time; and, at the end of training, what the
    exported model predicts for a masked text."""

    def __init__(self, setup: "TrainingSetup", blocks, make_batch, tokenizer, training_args, trackers):
        self.setup, self.blocks, self.make_batch = setup, blocks, make_batch
        self.tokenizer, self.trackers = tokenizer, trackers
        self.output_dir, self.seed = training_args.output_dir, training_args.seed
        self.fill_mask_text, self.fill_mask_top_k = training_args.fill_mask_text, training_args.fill_mask_top_k

    def __call__(self, params, step: int) -> dict:
        """The results on the whole evaluation data; with a mixture, those of each source under "sources" too."""
        sums_of = partial(self.sums, params)
        return validation_results(
            sums_of, self.blocks, evaluation_results, step, self.trackers, EVAL_METRICS, describe_results
        )

    def sums(self, params, blocks) -> dict:
        setup, batch_size = self.setup, self.setup.eval_batch_size
        return evaluation_sums(
            setup.eval_step, params, blocks, self.make_batch, batch_size, self.seed, setup.batch_sharding
        )

    def final(self, params, step: int) -> dict:
        """Evaluate the final weights: results written to eval_results.json by process 0 and printed, and returned
        (flax_lm.training.setup.finish_run keeps one already there for the step, of a complete run repeated)."""
        results = self(params, step)
        if jax.process_index() == 0:
            saved = saved_results(results, (*EVAL_METRICS, "masked_tokens"), self.blocks) | {"step": step}
            write_json(os.path.join(self.output_dir, "eval_results.json"), saved)
            print(f"eval: {describe_results(results)}")
        return results

    def fill_mask_with_export(self):
        """What the exported model, read back, predicts for --fill_mask_text (or a validation text with a word
        masked): this also shows that the saved files hold the trained model."""
        if jax.process_index() != 0 or self.fill_mask_top_k <= 0:
            return
        text, masked_word = self.fill_mask_text, None
        if not text and self.blocks is not None:
            texts = block_texts(next(iter(evaluation_sets(self.blocks).values())), self.tokenizer, 100)
            text, masked_word = fill_mask_demo_text(texts, self.tokenizer.mask_token)
        if not text:
            return
        abstract_params = self.setup.abstract_state.params
        exported = self.setup.read_export(self.output_dir, abstract_params)
        model = self.setup.model.clone(remat_policy=None, mesh=None)
        max_seq_length = self.setup.row_length
        predictions = fill_mask(model, exported, self.tokenizer, text, self.fill_mask_top_k, max_seq_length)
        masked = f" (masked: {masked_word!r})" if masked_word else ""
        print(f"fill-mask with {self.output_dir}: {text!r}{masked}")
        for token, probability in predictions:
            print(f"  {probability:.3f} {token!r}")


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    argument_types = (ModelArguments, DataTrainingArguments, TrainingArguments)
    model_args, data_args, training_args = start_run(argument_types, check_arguments, FLAG_TABLES)

    config, tokenizer = load_config_and_tokenizer(model_loading(model_args), "roberta")
    mesh = create_mesh(training_args.mesh_shape)
    model_code = load_model_code(
        config, model_args.model_file, False, "run_mlm_flax.py", mesh, compare_exports=not model_args.skip_export_check
    )
    check_model_and_tokenizer(config, tokenizer, training_args)
    max_seq_length = choose_max_seq_length(data_args, tokenizer, config)
    # Rows of max_seq_length - 2 tokens, which <s> and </s> frame.
    texts_to_rows = script_texts_to_rows(data_args, tokenizer, max_seq_length - 2)
    route = data_args.data_route(model_args, training_args)
    rows, train_stream, _ = load_data(route, texts_to_rows)
    if packs_only(training_args, data_args.packed_data_dir):
        return
    make_batch = BatchMaker.from_tokenizer(tokenizer, max_seq_length, data_args)

    model = masked_lm_model(config, tokenizer, model_args, data_args, mesh, model_code)
    model, adapters = adapted(model, model_code, model_args, training_args, max_seq_length, training_args.seed, None)
    settings, train_rows, eval_step = training_args.training_settings(), rows.get("train"), make_eval_step(model)
    script = adapters_trained(SCRIPT_TRAINING) if adapters else SCRIPT_TRAINING
    setup = set_up_training(model, model_code, script, eval_step, settings, train_rows, max_seq_length, adapters)
    apply_strategies(training_args, setup.steps_per_epoch, setup.total_steps)
    compile_train_steps_ahead(setup, make_batch, training_args)
    arguments = (model_args, data_args, training_args)
    state, this_run = start_training(setup, arguments, config, tokenizer, train_metrics, EVAL_METRICS, __file__)
    evaluation = Evaluation(setup, rows.get("validation"), make_batch, tokenizer, training_args, this_run.trackers)

    if this_run.trains_now:
        batches = train_batches_from(
            this_run.progress.step, setup, train_stream, make_batch, texts_to_rows, route, data_args, training_args
        )
        state, this_run.stopped_by = train(
            state, this_run.progress, batches, setup, this_run.save, evaluation, this_run.log, training_args
        )
    this_run.finish(state, evaluation, evaluation.fill_mask_with_export)


def check_model_and_tokenizer(config, tokenizer, training_args):
    """The tokenizer must have the special tokens RoBERTa and masking need."""
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
    check_tokenizer(config, tokenizer)


def script_texts_to_rows(data_args, tokenizer, row_length: int) -> TextsToRows:
    """How this script's texts become rows of `row_length` tokens, with the settings of its flags bound."""
    workers, line_by_line = data_args.preprocessing_num_workers, data_args.line_by_line
    rows = partial(tokenized_rows, num_workers=workers, line_by_line=line_by_line)
    return TextsToRows(read_texts, rows, tokenizer, row_length, "--max_seq_length", framing=data_args.framing)


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


def masked_lm_model(config, tokenizer, model_args, data_args, mesh, model_code: ModelCode) -> nn.Module:
    """The model of `model_code` to train on `mesh`, in the dtypes asked for. With --document_attention it keeps the
    texts of a block apart, each starting at the </s> that joins it to the one before (the block's first at its
    <s>)."""
    dtypes = jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype)
    separator_id = tokenizer.eos_token_id if data_args.document_attention else None
    return model_code.module.MODEL_CLASS(
        config, *dtypes, model_args.gradient_checkpointing, mesh, document_separator_id=separator_id
    )


def train_batches_from(
    first_step, setup: TrainingSetup, train_stream, make_batch, texts_to_rows, route, data_args, training_args
):
    """The global batches of each compiled call after `first_step` (steps_of_calls says how many steps each runs),
    stacked, and the token count of each step, read ahead on a thread: from the training rows, or `train_stream` (the
    texts of `route`, which texts_to_rows makes into blocks as it does on every route). The data order and the masks
    are a function of the step, so a resumed run sees the batches the interrupted one would have."""
    batch_size, max_seq_length, train_blocks = setup.train_batch_size, setup.row_length, setup.train_rows
    if isinstance(train_blocks, Mixture):
        data = f"on a mixture ({train_blocks.describe(setup.total_steps * batch_size)})"
        local_batches = mixture_train_batches(train_blocks, make_batch, batch_size, training_args.seed, first_step)
    elif train_stream is None:
        data = f"({setup.total_steps / setup.steps_per_epoch:.2f} epochs of {len(train_blocks)} blocks)"
        batches_of_epoch = partial(train_batches, train_blocks, make_batch, batch_size, training_args.seed)
        local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    else:
        data = "on blocks grouped from a stream"  # (--line_by_line is refused with --streaming)
        first_batch, seed = stream_position(first_step, batch_size, training_args.seed, training_args.ignore_data_skip)
        rows_of_texts = partial(texts_to_rows.rows_of, split="train", source=route.source, example_format=None)
        block_batches = streaming_train_batches(
            train_stream, rows_of_texts, batch_size, seed, data_args.shuffle_buffer_size, first_batch
        )
        local_batches = masked_stream_batches(block_batches, make_batch, batch_size, training_args.seed, first_step)
    padded = " at most (padded per batch)" if data_args.line_by_line else ""
    batch = f"global batch {batch_size} x {max_seq_length} tokens{padded}"
    logger.info("Training steps %d to %d %s, %s", first_step + 1, setup.total_steps, data, batch)
    calls = steps_of_calls(first_step, setup.total_steps, training_args)
    accumulation_steps, sharding = training_args.gradient_accumulation_steps, setup.call_batches_sharding
    return call_batches(local_batches, accumulation_steps, calls, training_args.steps_per_call, sharding)


def compile_train_steps_ahead(setup: TrainingSetup, make_batch: BatchMaker, training_args):
    """With --do_train, start compiling the train step on a thread, while the weights are initialised or restored;
    not where batches are padded each to its own length, and so differ in shape."""
    if training_args.do_train and not make_batch.pads_each_batch:
        abstract_batches = abstract_call_batches(setup, make_batch, training_args)
        steps = training_args.steps_per_call
        compile_in_background(setup.compiled_train_steps, setup.abstract_state, abstract_batches, steps)


def abstract_call_batches(setup: TrainingSetup, make_batch: BatchMaker, training_args) -> dict:
    """Shape, dtype and sharding of the batches of one compiled call, as train_batches_from makes them: those of a
    batch made from stand-in blocks."""
    batch_size, stand_in = setup.train_batch_size, np.zeros((1, setup.row_length - 2), np.int32)
    global_batch = make_batch(
        stand_in, np.zeros(batch_size, np.int64), batch_size, (training_args.seed, TRAIN_MASKING)
    )
    accumulation_steps, steps_per_call = training_args.gradient_accumulation_steps, training_args.steps_per_call
    return call_batch_shapes(global_batch, accumulation_steps, steps_per_call, setup.call_batches_sharding)


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
