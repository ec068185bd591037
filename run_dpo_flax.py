#!/usr/bin/env python3
"""Align a causal language model to preferences with Direct Preference Optimization (DPO), in JAX/Flax.

Starts from a model (--model_name_or_path: a Hugging Face checkpoint of a family flax_lm runs, or a run of
run_clm_flax.py) and trains it on preference pairs: a prompt with a chosen and a rejected completion, in the
preference formats of Hugging Face TRL (strings, or conversations rendered with the chat template; see
flax_lm/data/preferences.py), from .json/.jsonl files or a save_to_disk directory. The loss (Rafailov et al. 2023)
raises the policy's log-probability ratio to the reference model of the chosen completion over the rejected one;
the reference is the starting model, or --ref_model_name_or_path, held as a second set of weights that no optimizer
touches, or with --precompute_ref_log_probs only its log-probabilities, computed in one pass before training.

Flags, tokenization, the losses of --loss_type and the metrics follow TRL 1.16's DPOTrainer and DPOConfig, under
their names (--beta, --loss_type, --label_smoothing, --max_length, --truncation_mode, --precompute_ref_log_probs;
rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected), so that
`--do_eval` alone reports what DPOTrainer.evaluate() reports on the same model and pairs.

    ./run_dpo_flax.py --model_name_or_path my-sft-model --train_file pairs.jsonl --validation_file eval.jsonl \
        --output_dir dpo-run --do_train --do_eval --beta 0.1 --loss_type sigmoid --max_length 512

The output directory is an ordinary Hugging Face model directory, as run_clm_flax.py's. This file holds what an
experiment changes: its arguments, the loss with its --loss_type table, the optimizer, the train and eval steps and
the loop; the models and the machinery every run shares are imported from flax_lm.
"""

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from flax_lm.command_line.phases import start_training
from flax_lm.command_line.start import start_run
from flax_lm.command_line.trainer_flags import apply_strategies, check_best_model_flags
from flax_lm.data.data_files import data_file_patterns, pattern_files
from flax_lm.data.loading import call_batch_shapes, call_batches, epoch_batch_indices, epochs_of_batches
from flax_lm.data.preferences import TRUNCATION_MODES, encode_pair, padded_to, pair_rows, read_pairs
from flax_lm.devices.mesh import create_mesh, process_slice, to_global_batch
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.evaluation.validation import evaluate_on_start, saved_results, summed_over_batches, validation_results
from flax_lm.models import check_model_type
from flax_lm.models.huggingface import load_config_and_tokenizer, read_exported_params
from flax_lm.models.model_code import load_model_code
from flax_lm.run.checkpoints import StopRequest, log_when_committed, open_checkpoints, wait_until_committed
from flax_lm.run.output_dir import write_json
from flax_lm.run.record import TrainingProgress
from flax_lm.run.tracking import TrainingLog, logs_at_step
from flax_lm.training import optimizers
from flax_lm.training.compilation import compile_in_background
from flax_lm.training.lifecycle import ScriptTraining, TrainingSetup, set_up_training
from flax_lm.training.lora import is_adapter, without_adapters
from flax_lm.training.train_state import TrainState, apply_mean_update, step_gradients

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: this script's own, beside those of flax_lm.command_line.arguments that every script takes
# ----------------------------------------------------------------------------------------------------


@dataclass
class DPOModelArguments(ModelArguments):
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The reference model, a directory or hub name; default: the starting model (TRL's)."},
    )


@dataclass
class DataTrainingArguments(CommonDataArguments):
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Tokens of prompt and completion kept of each sequence (TRL's max_length); the rest is cut as "
            "--truncation_mode says."
        },
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "Which tokens of a sequence longer than --max_length are kept: its first (keep_start; a pair "
            "whose prompt alone fills --max_length is dropped) or its last (keep_end).",
            "choices": list(TRUNCATION_MODES),
        },
    )


# The flags of low-rank adapters (--lora_rank ...) are in LoraArguments.
@dataclass
class TrainingArguments(LoraArguments, CommonTrainingArguments):
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (TRL's DPO default, 1e-6)."})
    beta: float = field(
        default=0.1,
        metadata={
            "help": "How far the policy may move from the reference: the DPO temperature (for ipo, the "
            "regularization tau). Higher keeps it closer."
        },
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "The preference loss, one of DPO_LOSSES: {names}."})
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "With --loss_type robust: the probability, below 0.5, that a pair's preference is flipped."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference model's log-probabilities of every pair in one pass before training and "
            "keep those instead of its weights: less memory, and no reference forward in the steps."
        },
    )


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments (after initialize_distributed: see check_common_arguments)."""
    check_model_type(model_args.model_type, generates_text=True)
    check_numeric_arguments(
        (data_args, training_args),
        max_length=(lambda value: value is None or value >= 2, "must be at least 2"),
        beta=(lambda value: value > 0, "must be positive, such as 0.1"),
        label_smoothing=(lambda value: 0 <= value < 0.5, "must be in [0, 0.5)"),
    )
    if not model_args.model_name_or_path:
        raise UsageError("DPO starts from a model, the reference too: pass --model_name_or_path")
    for flag in ("streaming", "packed_data_dir", "data_mixture"):
        if getattr(data_args, flag):
            raise UsageError(f"--{flag} is not supported by run_dpo_flax.py; pass --train_file or --dataset_name")
    if data_args.truncation_mode not in TRUNCATION_MODES:  # a JSON file of arguments skips argparse's choices
        raise UsageError(f"--truncation_mode {data_args.truncation_mode} is not one of {', '.join(TRUNCATION_MODES)}")
    if training_args.label_smoothing and training_args.loss_type != "robust":
        raise UsageError("--label_smoothing applies to --loss_type robust only; leave it out or pass that")
    check_common_arguments(model_args, data_args, training_args)
    check_best_model_flags(training_args, EVAL_METRICS)  # after the defaults of --do_train and --do_eval
    check_lora_flags(model_args, training_args)


# ----------------------------------------------------------------------------------------------------
# Data: preference pairs become rows of token ids and completion masks (flax_lm/data/preferences.py)
# ----------------------------------------------------------------------------------------------------


def read_split(data_args, split: str) -> list[dict] | None:
    """The pairs of one split: of --train_file or --validation_file, or of --dataset_name; None where none is given.
    To train on another source, return its pairs here: dicts of prompt, chosen and rejected."""
    files = data_args.train_file if split == "train" else data_args.validation_file
    if files:
        paths = [path for pattern in data_file_patterns(files) for path in pattern_files(pattern) or [pattern]]
        return [pair for path in paths for pair in read_pairs(path, split)]
    if data_args.dataset_name and (split == "train" or os.path.isdir(os.path.join(data_args.dataset_name, split))):
        return read_pairs(data_args.dataset_name, split)
    return None


def load_preference_rows(data_args, tokenizer, training_args) -> dict:
    """{split: rows} of the pairs of each split (flax_lm.data.preferences.pair_rows), all of one length: the longest
    sequence after truncation. Without validation pairs, --do_eval holds out the first --validation_split_percentage
    percent of the training pairs (at least one)."""
    pairs = {split: read_split(data_args, split) for split in ("train", "validation")}
    if pairs["validation"] is None and pairs["train"] and training_args.do_eval:
        held_out = max(1, len(pairs["train"]) * data_args.validation_split_percentage // 100)
        pairs["validation"], pairs["train"] = pairs["train"][:held_out], pairs["train"][held_out:]
    if not training_args.do_train:
        pairs["train"] = None
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = {}
    for split, split_pairs in pairs.items():
        if not split_pairs or (split == "validation" and not training_args.do_eval):
            continue
        encoded = (encode_pair(tokenizer, pair) for pair in split_pairs[: limits[split]])
        rows[split], dropped = pair_rows(encoded, data_args.max_length, data_args.truncation_mode, pad_id)
        if dropped:
            logger.warning("%d %s pairs left out: the prompt alone fills --max_length", dropped, split)
        if not len(rows[split]):
            raise UsageError(f"no {split} pair is left: every prompt fills --max_length; raise it")
    if training_args.do_eval and "validation" not in rows:
        raise UsageError("--do_eval needs pairs to evaluate: pass --validation_file, or --train_file to hold some out")
    length = max(split_rows.shape[-1] for split_rows in rows.values())
    return {split: padded_to(split_rows, length, pad_id) for split, split_rows in rows.items()}


def batch_of(rows: np.ndarray, reference_logps: np.ndarray | None = None) -> dict:
    """Pairs as the steps take them: "input_ids" and "completion_mask" (pairs, 2, length), chosen then rejected; and
    the reference model's log-probabilities of both, (pairs, 2), where they are known already."""
    batch = {"input_ids": rows[:, :, 0], "completion_mask": rows[:, :, 1]}
    if reference_logps is not None:
        batch["reference_logps"] = reference_logps
    return batch


def train_batches(rows, reference_logps, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0):
    """This process's pairs of each global batch of one epoch, from batch `first_batch` on, in an order fixed by seed
    and epoch (so a resumed run continues with the very batches it would have seen)."""
    process_rows = process_slice(global_batch_size)
    for _, indices in epoch_batch_indices(len(rows), global_batch_size, seed, epoch, first_batch):
        indices = indices[process_rows]
        yield batch_of(rows[indices], None if reference_logps is None else reference_logps[indices])


def eval_batches(rows: np.ndarray, reference_logps: np.ndarray | None, global_batch_size: int) -> Iterator[dict]:
    """Every pair once, in order; the last batch is padded with pairs of no completion tokens, which weigh 0."""
    process_rows = process_slice(global_batch_size)
    for start in range(0, len(rows), global_batch_size):
        batch = batch_of(rows[start : start + global_batch_size])
        if reference_logps is not None:
            batch["reference_logps"] = reference_logps[start : start + global_batch_size]
        padding = global_batch_size - len(batch["input_ids"])
        batch = {name: np.pad(values, [(0, padding)] + [(0, 0)] * (values.ndim - 1)) for name, values in batch.items()}
        yield {name: values[process_rows] for name, values in batch.items()}


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
# ----------------------------------------------------------------------------------------------------


def completion_log_probs(model, params, input_ids, completion_mask):
    """The log-probability the model gives each sequence's completion, float32 (sequences,): the log-probabilities of
    its tokens summed, each predicted from the tokens before it (as TRL sums them)."""
    logits = model.apply({"params": params}, input_ids, deterministic=True).astype(jnp.float32)
    next_tokens = jnp.roll(input_ids, -1, axis=1)
    predicted = jnp.concatenate([completion_mask[:, 1:], jnp.zeros_like(completion_mask[:, :1])], axis=1)
    token_log_probs = -optax.softmax_cross_entropy_with_integer_labels(logits, next_tokens)
    return jnp.sum(token_log_probs * predicted, axis=1)


def pair_log_probs(model, params, batch):
    """completion_log_probs of the chosen and the rejected sequence of each pair, (pairs, 2): one forward pass of
    both together. Dropout is off (TRL's disable_dropout), so that policy and reference differ by their weights."""
    input_ids, completion_mask = batch["input_ids"], batch["completion_mask"]
    pairs, length = input_ids.shape[0], input_ids.shape[-1]
    flat = completion_log_probs(model, params, input_ids.reshape(-1, length), completion_mask.reshape(-1, length))
    return flat.reshape(pairs, 2)


def sigmoid_loss(chosen_scores, rejected_scores, completion_tokens, beta: float, label_smoothing: float):
    """DPO's own: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))."""
    return -jax.nn.log_sigmoid(beta * (chosen_scores - rejected_scores))


def hinge_loss(chosen_scores, rejected_scores, completion_tokens, beta: float, label_smoothing: float):
    """SLiC's: max(0, 1 - beta * (chosen log-ratio - rejected log-ratio))."""
    return jax.nn.relu(1 - beta * (chosen_scores - rejected_scores))


def ipo_loss(chosen_scores, rejected_scores, completion_tokens, beta: float, label_smoothing: float):
    """IPO's (Azar et al. 2023, eq. 17), beta its tau: (difference of the log-ratios per completion token -
    1 / (2 beta))^2; per token as TRL divides them, so that beta means the same for long and short completions."""
    chosen, rejected = (
        scores / jnp.maximum(tokens, 1.0)
        for scores, tokens in zip((chosen_scores, rejected_scores), completion_tokens)
    )
    return (chosen - rejected - 1 / (2 * beta)) ** 2


def robust_loss(chosen_scores, rejected_scores, completion_tokens, beta: float, label_smoothing: float):
    """Robust DPO's (Chowdhury et al. 2024): unbiased under preferences flipped with probability label_smoothing."""
    delta = beta * (chosen_scores - rejected_scores)
    clean = -(1 - label_smoothing) * jax.nn.log_sigmoid(delta)
    flipped = -label_smoothing * jax.nn.log_sigmoid(-delta)
    return (clean - flipped) / (1 - 2 * label_smoothing)


# What --loss_type names: each pair's loss from the log-ratios of policy to reference of the chosen and the rejected
# completion (pairs,), their completion tokens (chosen, rejected), --beta and --label_smoothing. Add an entry here and
# the flag takes it.
DPO_LOSSES = {"sigmoid": sigmoid_loss, "hinge": hinge_loss, "ipo": ipo_loss, "robust": robust_loss}


def preference_sums(policy_logps, batch, loss_type: str, beta: float, label_smoothing: float) -> dict:
    """What the train and eval steps sum over a batch's pairs: the --loss_type loss ("loss_sum", what training
    differentiates), the pairs, and the sums of TRL's metrics (rewards: beta times the log-ratio of policy to
    reference). A pair without completion tokens is padding and weighs 0. Sums, so that averages over batches are
    exact: divide once, on the host."""
    completion_tokens = jnp.sum(batch["completion_mask"], axis=-1).astype(jnp.float32)  # (pairs, 2)
    weights = (completion_tokens[:, 0] > 0).astype(jnp.float32)
    logratios = policy_logps - batch["reference_logps"]
    losses = DPO_LOSSES[loss_type](
        logratios[:, 0], logratios[:, 1], (completion_tokens[:, 0], completion_tokens[:, 1]), beta, label_smoothing
    )
    rewards = jax.lax.stop_gradient(beta * logratios)
    logps = jax.lax.stop_gradient(policy_logps)
    return {
        "loss_sum": jnp.sum(losses * weights),
        "pair_count": jnp.sum(weights),
        "chosen_reward_sum": jnp.sum(rewards[:, 0] * weights),
        "rejected_reward_sum": jnp.sum(rewards[:, 1] * weights),
        "accuracy_sum": jnp.sum((rewards[:, 0] > rewards[:, 1]) * weights),
        "chosen_logps_sum": jnp.sum(logps[:, 0] * weights),
        "rejected_logps_sum": jnp.sum(logps[:, 1] * weights),
    }


# What the train step sums over pairs, and (preference_metrics) the metrics shown from those sums.
TRAIN_METRIC_SUMS = (
    "loss_sum",
    "pair_count",
    "chosen_reward_sum",
    "rejected_reward_sum",
    "accuracy_sum",
    "chosen_logps_sum",
    "rejected_logps_sum",
)


def preference_metrics(sums: dict) -> dict:
    """The loss and TRL's metrics under TRL's names, averaged over the pairs the sums cover: of a log line, of
    train_results.json and of an evaluation."""
    pairs = max(sums["pair_count"], 1.0)
    chosen, rejected = sums["chosen_reward_sum"] / pairs, sums["rejected_reward_sum"] / pairs
    return {
        "loss": sums["loss_sum"] / pairs,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": sums["accuracy_sum"] / pairs,
        "rewards/margins": chosen - rejected,
        "logps/chosen": sums["chosen_logps_sum"] / pairs,
        "logps/rejected": sums["rejected_logps_sum"] / pairs,
    }


# Copied from run_clm_flax.learning_rate_schedule
def learning_rate_schedule(settings: optimizers.OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    schedule_after_warmup = LEARNING_RATE_SCHEDULES[settings.lr_scheduler_type]
    return optimizers.after_linear_warmup(schedule_after_warmup, settings, total_steps)


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
FLAG_TABLES = {"optim": OPTIMIZERS, "lr_scheduler_type": LEARNING_RATE_SCHEDULES, "loss_type": DPO_LOSSES}


# Copied from run_clm_flax.create_optimizer
def create_optimizer(
    settings: optimizers.OptimizerSettings, schedule: optax.Schedule, trains=None
) -> optax.GradientTransformation:
    """The optimizer of --optim, for the parameters is_trained picks (or `trains`, in its place: LoRA's adapters)."""
    optimizer = OPTIMIZERS[settings.optim](settings, schedule)
    if settings.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), optimizer)
    return optimizers.trained_only(optimizer, trains or is_trained)


def make_train_step(model, optimizer, schedule, seed: int, losses: dict, trains=None, reference_is_base: bool = False):
    """The train step: one forward of the chosen and rejected sequences of every pair, the --loss_type loss (`losses`:
    the flags --loss_type, --beta and --label_smoothing) against the reference log-probabilities the batch carries,
    and the update of its mean over the pairs; `trains`: what trains in place of is_trained (LoRA's adapters:
    flax_lm.training.lora.is_adapter). With `reference_is_base` (LoRA's adapters alone train, and no other
    reference is named) the reference is the base model, the same weights without the adapters: the step computes its
    log-probabilities itself, with no second copy of the weights."""
    dropout_key = jax.random.key(seed + 1)  # unused: dropout is off, as in TRL (pair_log_probs)

    def loss_and_sums(params, micro_batch, dropout_rng):
        policy_logps = pair_log_probs(model, params, micro_batch)
        if reference_is_base:
            base_logps = jax.lax.stop_gradient(pair_log_probs(model, without_adapters(params), micro_batch))
            micro_batch = micro_batch | {"reference_logps": base_logps}
        sums = preference_sums(policy_logps, micro_batch, **losses)
        return sums["loss_sum"], sums

    def train_step(state: TrainState, batch):
        grads, sums = step_gradients(loss_and_sums, state, batch, dropout_key, trains or is_trained)
        new_state, update_metrics = apply_mean_update(state, grads, sums["pair_count"], sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


def script_training(training_args, adapters=None, base_reference: bool = False) -> ScriptTraining:
    """What flax_lm's set-up (set_up_training) builds the training from: this script's schedule, optimizer and train
    step (with the loss the flags choose), the sums its train step makes, and the flag of its sequence length; with
    `adapters` (LoRA's) a train step that trains them alone, the reference the base model with `base_reference`."""
    make_step = partial(make_train_step, losses=loss_settings(training_args))
    if adapters is None:
        return ScriptTraining(learning_rate_schedule, create_optimizer, make_step, TRAIN_METRIC_SUMS, "max_length")
    make_step = partial(make_step, trains=is_adapter, reference_is_base=base_reference)
    optimizer = partial(create_optimizer, trains=is_adapter)
    return ScriptTraining(learning_rate_schedule, optimizer, make_step, TRAIN_METRIC_SUMS, "max_length")


def loss_settings(training_args) -> dict:
    return {name: getattr(training_args, name) for name in ("loss_type", "beta", "label_smoothing")}


def reference_is_base(model_args, training_args) -> bool:
    """Whether the train step computes the reference's log-probabilities with the base model (LoRA's adapters left
    out): with adapters, no --ref_model_name_or_path and no --precompute_ref_log_probs."""
    named_otherwise = model_args.ref_model_name_or_path or training_args.precompute_ref_log_probs
    return training_args.lora_settings() is not None and not named_otherwise


def make_eval_step(model, training_args):
    """The sums of preference_sums over a batch, with the loss --loss_type names: DPOTrainer.evaluate() reports the
    training loss, so the evaluation does too."""
    losses = loss_settings(training_args)

    def eval_step(params, batch):
        return preference_sums(pair_log_probs(model, params, batch), batch, **losses)

    return eval_step


def describe_results(results: dict) -> str:
    return ", ".join(f"{name} {results[name]:.4f}" for name in EVAL_METRICS)


# What each evaluation reports (the log, the trackers, eval_results.json as eval_NAME, TRL's keys).
EVAL_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


# ----------------------------------------------------------------------------------------------------
# The reference model, and evaluation
# ----------------------------------------------------------------------------------------------------


class Reference:
    """The reference model's log-probabilities of the pairs: of the validation pairs (and with
    --precompute_ref_log_probs of the training pairs) computed once here; otherwise of each training batch as it
    comes, from the reference weights held beside the trained ones (no optimizer state). The weights are read from
    --ref_model_name_or_path, or --model_name_or_path: never from a checkpoint, so that a resumed run keeps its
    reference. With LoRA's adapters and no --ref_model_name_or_path, the reference is the base model: the frozen
    weights of `state` without the adapters, no copy (and the train step computes it: reference_is_base)."""

    def __init__(self, setup: TrainingSetup, model_args, rows: dict, training_args, state):
        self.setup, self.logps, self.in_step = setup, {}, reference_is_base(model_args, training_args)
        abstract_params = setup.abstract_state.params
        if setup.adapters is not None and not model_args.ref_model_name_or_path:
            self.params = without_adapters(state.params)  # read before the train step donates them
        else:
            source = model_args.ref_model_name_or_path or model_args.model_name_or_path
            abstract_params = without_adapters(abstract_params)
            params = read_exported_params(source, model_loading(model_args), setup.model_code, abstract_params)
            self.params = jax.device_put(params, jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_params))
        shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, without_adapters(abstract_params))
        forward = jax.jit(partial(pair_log_probs, setup.model), in_shardings=(shardings, setup.batch_sharding))
        precomputed = ["validation"] + (["train"] if training_args.precompute_ref_log_probs else [])
        for split in precomputed:
            if split in rows:
                self.logps[split] = self.of_rows(forward, rows[split])
        if training_args.precompute_ref_log_probs or not training_args.do_train or self.in_step:
            self.params = None  # the log-probabilities are all it is needed for
        else:

            def of_call(
                params, batches
            ):  # (steps, micro-batches, pairs, 2, length) -> (steps, micro-batches, pairs, 2)
                flat = {
                    name: batches[name].reshape(-1, *batches[name].shape[3:])
                    for name in ("input_ids", "completion_mask")
                }
                return pair_log_probs(setup.model, params, flat).reshape(*batches["input_ids"].shape[:3], 2)

            self.of_call = jax.jit(of_call, out_shardings=setup.call_batches_sharding)

    def of_rows(self, forward, rows: np.ndarray) -> np.ndarray:
        """The log-probabilities of every pair of `rows`, in one pass of eval-sized batches."""
        size = self.setup.eval_batch_size
        batches = (to_global_batch(batch, self.setup.batch_sharding) for batch in eval_batches(rows, None, size))
        computed = [np.asarray(jax.device_get(forward(self.params, batch))) for batch in batches]
        return np.concatenate(computed)[: len(rows)]

    def added(self, call_batches):
        """The batches of each compiled call with the reference's log-probabilities, where they are not precomputed."""
        for batch, step_tokens in call_batches:
            if "reference_logps" not in batch and not self.in_step:
                batch = batch | {"reference_logps": self.of_call(self.params, batch)}
            yield batch, step_tokens


class Evaluation:
    """The loss and TRL's metrics over the validation pairs, logged and written to eval_results.json."""

    def __init__(self, setup: TrainingSetup, rows, reference_logps, trackers, output_dir: str):
        self.setup, self.rows, self.reference_logps = setup, rows, reference_logps
        self.trackers, self.output_dir = trackers, output_dir

    def __call__(self, params, step: int) -> dict:
        if self.rows is None:
            return {}
        return validation_results(
            partial(self.sums, params),
            self.rows,
            preference_metrics,
            step,
            self.trackers,
            EVAL_METRICS,
            describe_results,
        )

    def sums(self, params, rows) -> dict:
        setup = self.setup
        batches = eval_batches(rows, self.reference_logps, setup.eval_batch_size)
        count = math.ceil(len(rows) / setup.eval_batch_size)
        return summed_over_batches(setup.eval_step, params, batches, count, setup.batch_sharding)

    def final(self, params, step: int) -> dict:
        """The evaluation of the final weights, written to eval_results.json under TRL's keys (eval_loss,
        eval_rewards/accuracies ...)."""
        results = self(params, step)
        if jax.process_index() == 0 and self.rows is not None:
            saved = saved_results(results, EVAL_METRICS, self.rows)
            write_json(os.path.join(self.output_dir, "eval_results.json"), saved | {"step": step})
            print(f"eval: {describe_results(results)}")
        return results


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    argument_types = (DPOModelArguments, DataTrainingArguments, TrainingArguments)
    model_args, data_args, training_args = start_run(argument_types, check_arguments, FLAG_TABLES)

    config, tokenizer = load_config_and_tokenizer(model_loading(model_args), "llama")
    mesh = create_mesh(training_args.mesh_shape)
    model_code = load_model_code(
        config, model_args.model_file, True, "run_dpo_flax.py", mesh, compare_exports=not model_args.skip_export_check
    )
    rows = load_preference_rows(data_args, tokenizer, training_args)
    row_length = next(iter(rows.values())).shape[-1]
    model = policy_model(config, model_args, mesh, model_code)
    model, adapters = adapted(model, model_code, model_args, training_args, row_length, training_args.seed)
    eval_step = make_eval_step(model, training_args)
    script = script_training(training_args, adapters, reference_is_base(model_args, training_args))
    settings = training_args.training_settings()
    setup = set_up_training(model, model_code, script, eval_step, settings, rows.get("train"), row_length, adapters)
    apply_strategies(training_args, setup.steps_per_epoch, setup.total_steps)
    compile_train_steps_ahead(setup, training_args, reference_is_base(model_args, training_args))
    arguments = (model_args, data_args, training_args)
    state, this_run = start_training(setup, arguments, config, tokenizer, preference_metrics, EVAL_METRICS, __file__)
    reference = Reference(setup, model_args, rows, training_args, state)
    validation_logps = reference.logps.get("validation")
    evaluation = Evaluation(
        setup, rows.get("validation"), validation_logps, this_run.trackers, training_args.output_dir
    )

    if this_run.trains_now:
        batches = train_batches_from(this_run.progress.step, setup, reference, training_args)
        state, this_run.stopped_by = train(
            state, this_run.progress, batches, setup, this_run.save, evaluation, this_run.log, training_args
        )
    this_run.finish(state, evaluation, lambda: None)


def policy_model(config, model_args, mesh, model_code) -> nn.Module:
    """The model of `model_code` to train on `mesh`, in the dtypes asked for."""
    dtypes = jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype)
    return model_code.module.MODEL_CLASS(config, *dtypes, model_args.gradient_checkpointing, mesh)


def train_batches_from(first_step, setup: TrainingSetup, reference: Reference, training_args):
    """The global batches of each compiled call after `first_step` (steps_of_calls says how many steps each runs),
    with the reference's log-probabilities, and the token count of each step. The data order is a function of the
    step, so a resumed run sees the batches the interrupted one would have."""
    batch_size, rows = setup.train_batch_size, setup.train_rows
    batches_of_epoch = partial(train_batches, rows, reference.logps.get("train"), batch_size, training_args.seed)
    local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    logger.info(
        "Training steps %d to %d (%.2f epochs of %d pairs), global batch %d pairs of 2 x %d tokens",
        first_step + 1,
        setup.total_steps,
        setup.total_steps / setup.steps_per_epoch,
        len(rows),
        batch_size,
        setup.row_length,
    )
    batches_and_tokens = ((batch, 2 * batch_size * setup.row_length) for batch in local_batches)
    calls = steps_of_calls(first_step, setup.total_steps, training_args)
    accumulation_steps, sharding = training_args.gradient_accumulation_steps, setup.call_batches_sharding
    call_batch_stream = call_batches(
        batches_and_tokens, accumulation_steps, calls, training_args.steps_per_call, sharding
    )
    return reference.added(call_batch_stream)


def compile_train_steps_ahead(setup: TrainingSetup, training_args, base_reference: bool):
    """With --do_train, start compiling the train step on a thread, while the weights are read. The batches carry the
    reference's log-probabilities unless the step computes them (`base_reference`)."""
    if training_args.do_train:
        pairs, length = setup.train_batch_size, setup.row_length
        global_batch = {
            "input_ids": jax.ShapeDtypeStruct((pairs, 2, length), jnp.int32),
            "completion_mask": jax.ShapeDtypeStruct((pairs, 2, length), jnp.int32),
        }
        if not base_reference:
            global_batch["reference_logps"] = jax.ShapeDtypeStruct((pairs, 2), jnp.float32)
        accumulation_steps, steps = training_args.gradient_accumulation_steps, training_args.steps_per_call
        abstract_batches = call_batch_shapes(global_batch, accumulation_steps, steps, setup.call_batches_sharding)
        compile_in_background(setup.compiled_train_steps, setup.abstract_state, abstract_batches, steps)


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
