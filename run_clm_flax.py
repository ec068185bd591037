#!/usr/bin/env python3
"""Pretrain a GPT-2 causal language model with JAX/Flax.

Trains from scratch (a config and a tokenizer, for example from create_config.py and
train_tokenizer.py) or continues from a Hugging Face GPT-2 checkpoint, on text from local files
(txt, json/jsonl, csv, parquet; globs allowed), a local dataset directory or a `datasets` hub name.
Documents (a whole .txt file as written, unless --text_sample_by says otherwise; one row of other formats)
are tokenized, each ended by the end-of-text token, joined and packed into blocks of `--block_size` tokens.
Evaluation reports loss, perplexity and bits per byte.
Each global batch is split over every device of every process with `jax.jit` over a device mesh.
On several hosts every host runs the same command (see initialize_distributed for how the processes
find each other) and process 0 writes the outputs.

The output directory is an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer files, generation_config.json) that `transformers.AutoModelForCausalLM` loads in PyTorch.

    ./run_clm_flax.py --output_dir gpt2-run --config_name my-model --tokenizer_name my-model \
        --train_file "data/*.txt" --do_train --do_eval --block_size 512

A single .json file holding the arguments works too: `./run_clm_flax.py args.json`.

This file holds what an experiment changes, in reading order: its arguments, how texts become blocks, the loss, the
optimizer and schedule, the train and eval steps, evaluation with samples, and the loop in main(). The model
(flax_lm/models/gpt2.py) and the machinery every run shares (checkpoints, trackers, data storage, processes) are
imported from the flax_lm package: copy this file anywhere, edit it, and run it where flax_lm is installed.
"""

import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file
from tqdm.auto import tqdm

from flax_lm.arguments import (
    CommonTrainingArguments,
    DataArguments,
    ModelArguments,
    check_choices,
    check_common_arguments,
    check_numeric_arguments,
    parse_arguments,
    recorded_arguments,
)
from flax_lm.checkpoints import (
    StopRequest,
    TrainingProgress,
    check_resumed_run,
    committed_checkpoint,
    open_checkpoints,
    restore_checkpoint,
    save_checkpoint,
)
from flax_lm.compilation import compile_in_background
from flax_lm.data import (
    call_batch_shapes,
    call_batches,
    count_steps,
    epochs_of_batches,
    load_data,
    stream_position,
    streaming_train_batches,
)
from flax_lm.errors import UsageError, run
from flax_lm.hf_io import (
    check_architecture_fits,
    load_config_and_tokenizer,
    read_safetensors_checkpoint,
    save_model,
)
from flax_lm.mesh import BATCH_AXES, create_mesh, prefetch, process_slice, to_global_batch
from flax_lm.mixture import Mixture, evaluate_by_source, evaluation_sets, report_by_source
from flax_lm.models import gpt2
from flax_lm.models.gpt2 import FlaxGPT2LMHeadModel, check_model_config, from_hf_state_dict
from flax_lm.processes import (
    initialize_distributed,
    on_process_zero,
    print_once,
    setup_logging,
    wait_for_all_processes,
)
from flax_lm.run_dir import (
    check_output_dir,
    evaluated_step,
    prepare_output_dir,
    report_stop,
    write_all_results,
    write_json,
    write_train_results,
)
from flax_lm.sampling import generate_ids, make_sampler
from flax_lm.texts import token_arrays, token_byte_counts
from flax_lm.tracking import TrainingLog, open_trackers
from flax_lm.train_state import (
    TrainState,
    abstract_train_state,
    accumulate_gradients,
    apply_finite_update,
    create_train_state,
    repeat_train_step,
    train_step_compiler_options,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: this script's own, beside those of flax_lm.arguments that both scripts take
# ----------------------------------------------------------------------------------------------------


@dataclass
class DataTrainingArguments(DataArguments):
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training sequence. Defaults to the smaller of the tokenizer's model_max_length and "
            "the model's n_positions, capped at 1024."
        },
    )
    document_attention: bool = field(
        default=False,
        metadata={
            "help": "In a block of documents packed end to end, a token attends only to its own document and "
            "positions restart at each end-of-text token, which starts the document after it."
        },
    )


@dataclass
class TrainingArguments(CommonTrainingArguments):
    sample_prompt: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A prompt that the model continues at every evaluation (in TensorBoard's text tab) and at the "
            "end of training; give it several times for several prompts. Default: one text from nothing.",
            "action": "extend",
        },
    )
    sample_tokens: int = field(default=40, metadata={"help": "Tokens sampled after each prompt; 0 for no samples."})


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments (after initialize_distributed: see check_common_arguments)."""
    model_args.model_type = model_args.model_type or "gpt2"
    if model_args.model_type != "gpt2":
        raise UsageError(
            f"--model_type {model_args.model_type} is not supported; this script trains gpt2 (run_mlm_flax.py "
            "trains roberta)"
        )
    check_numeric_arguments(
        (data_args, training_args),
        block_size=(lambda value: value is None or value >= 2, "must be at least 2"),
        sample_tokens=(lambda value: value >= 0, "must be 0 (no samples) or more"),
    )
    check_optimizer_arguments(training_args)
    check_common_arguments(model_args, data_args, training_args)


# ----------------------------------------------------------------------------------------------------
# Data: texts become blocks of tokens (flax_lm.data reads the texts from files or a stream, and keeps the blocks)
# ----------------------------------------------------------------------------------------------------


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
    """The rows of a packed corpus made from one split: its texts, each followed by EOS, joined and cut into blocks.
    The token cache is keyed by this function's code (and that of what it calls here), so an edit re-tokenizes."""
    tokens = token_arrays(dataset, tokenizer, data_args.text_column_name, data_args.preprocessing_num_workers, split)
    return pack_blocks(tokens, block_size)


def train_batches(
    blocks: np.ndarray, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[dict]:
    """This process's rows of each global batch of one epoch, from batch `first_batch` on, in an order
    fixed by seed and epoch (so a resumed run continues with the very batches it would have seen).

    The blocks left over after the last full batch differ from epoch to epoch, so all data is seen.
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(blocks))
    rows = process_slice(global_batch_size)
    for step in range(first_batch, len(blocks) // global_batch_size):
        # Sorted (for reading the memory-mapped blocks in order) before the split, so that the global batch,
        # row for row, does not depend on the number of processes.
        batch_indices = np.sort(order[step * global_batch_size : (step + 1) * global_batch_size])[rows]
        yield {"input_ids": np.asarray(blocks[batch_indices], dtype=np.int32)}


def eval_batches(blocks: np.ndarray, global_batch_size: int) -> Iterator[dict]:
    """Every block once, in order; the last batch is padded with zero-weight rows so none is dropped."""
    rows = process_slice(global_batch_size)
    for start in range(0, len(blocks), global_batch_size):
        input_ids = np.asarray(blocks[start : start + global_batch_size], dtype=np.int32)
        weights = np.ones(input_ids.shape, dtype=np.float32)
        padding = global_batch_size - len(input_ids)
        if padding:
            input_ids = np.pad(input_ids, ((0, padding), (0, 0)))
            weights = np.pad(weights, ((0, padding), (0, 0)))
        yield {"input_ids": input_ids[rows], "weights": weights[rows]}


# ----------------------------------------------------------------------------------------------------
# Loss, optimizer, train and eval steps
# ----------------------------------------------------------------------------------------------------


def causal_lm_loss_sums(logits, input_ids, weights):
    """Summed next-token cross-entropy and the number of predicted tokens, both float32.

    Sums rather than means, so that averages over several batches (and over padded rows, weight 0)
    are exact: divide once, on the host.
    """
    # Position t predicts token t + 1; the last position has nothing to predict, so its weight is 0. The
    # labels and weights are shifted rather than the logits sliced: slicing would copy the (batch, length,
    # vocabulary) logits, and its gradient pad them back, in every step.
    next_tokens = jnp.roll(input_ids, -1, axis=1)
    target_weights = jnp.concatenate([weights[:, 1:], jnp.zeros_like(weights[:, :1])], axis=1)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), next_tokens)
    return jnp.sum(losses * target_weights), jnp.sum(target_weights)


# What the train step sums over tokens, and the metrics shown from those sums.
TRAIN_METRIC_SUMS = ("loss_sum", "token_count")


def train_metrics(sums: dict) -> dict:
    """The training metrics of a log line and of train_results.json, from the sums over the steps it covers."""
    return {"loss": sums["loss_sum"] / max(sums["token_count"], 1.0)}


def learning_rate_schedule(training_args, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    warmup_steps = training_args.warmup_steps or math.ceil(training_args.warmup_ratio * total_steps)
    if training_args.do_train and warmup_steps > total_steps:
        raise UsageError(
            f"--warmup_steps {warmup_steps} is longer than the run's {total_steps} steps, so the learning rate would "
            "never reach --learning_rate; pass fewer --warmup_steps, or --warmup_ratio"
        )
    warmup_steps = min(warmup_steps, total_steps)  # an evaluation alone has no steps
    after_warmup = LEARNING_RATE_SCHEDULES[training_args.lr_scheduler_type](training_args, warmup_steps, total_steps)
    warmup = optax.linear_schedule(0.0, training_args.learning_rate, max(warmup_steps, 1))
    return optax.join_schedules([warmup, after_warmup], [warmup_steps])


def decay_to_the_end(shape: str):
    """The schedule after warm-up that decays from the peak to --min_lr_rate of it over all the remaining steps."""

    def schedule(training_args, warmup_steps: int, total_steps: int) -> optax.Schedule:
        peak = training_args.learning_rate
        return DECAY_SHAPES[shape](peak, peak * training_args.min_lr_rate, max(total_steps - warmup_steps, 1))

    return schedule


def warmup_stable_decay(training_args, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """The peak, held until the last --lr_decay_ratio of the run's steps, which decay to --min_lr_rate of it in the
    shape --lr_decay_shape names. The decay is placed by the run's last step alone: a checkpoint of the stable phase
    resumed with another --max_steps decays at the end of the new budget."""
    peak = training_args.learning_rate
    decay_steps = round(training_args.lr_decay_ratio * total_steps)
    stable_steps = total_steps - warmup_steps - decay_steps
    if training_args.do_train and stable_steps < 0:
        raise UsageError(
            f"the warm-up ({warmup_steps} steps) and the decay (--lr_decay_ratio {training_args.lr_decay_ratio}: "
            f"{decay_steps} steps) are longer than the run's {total_steps} steps; shorten one of them"
        )
    decay = DECAY_SHAPES[training_args.lr_decay_shape](peak, peak * training_args.min_lr_rate, max(decay_steps, 1))
    return optax.join_schedules([optax.constant_schedule(peak), decay], [max(stable_steps, 0)])


# What --lr_scheduler_type names: the learning rate after the warm-up, from (training_args, warmup_steps, total_steps);
# its step 0 is the first step after the warm-up. Add an entry here and the flag takes it.
LEARNING_RATE_SCHEDULES = {
    "linear": decay_to_the_end("linear"),
    "cosine": decay_to_the_end("cosine"),
    "constant": lambda training_args, *_: optax.constant_schedule(training_args.learning_rate),
    "warmup_stable_decay": warmup_stable_decay,
}

# What --lr_decay_shape names: a decay from (peak, floor, steps), at `floor` from `steps` on. 1-sqrt falls fast at
# the end, which Hägele et al. (2024, arXiv:2405.18392) found better than linear for the decay of warmup_stable_decay.
DECAY_SHAPES = {
    "linear": lambda peak, floor, steps: optax.linear_schedule(peak, floor, steps),
    "cosine": lambda peak, floor, steps: optax.cosine_decay_schedule(peak, steps, alpha=floor / peak),
    "1-sqrt": lambda peak, floor, steps: (
        lambda step: floor + (peak - floor) * (1 - jnp.sqrt(jnp.clip(step / steps, 0.0, 1.0)))
    ),
}


def decay_mask(params):
    """True for the weights AdamW decays: matrices and embeddings, not biases or LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


def is_hidden_matrix(path, param) -> bool:
    """Whether --optim muon trains this parameter with Muon: a 2-D kernel of the blocks (the attention and MLP
    projections). The embeddings, the output layer and head (lm_head), norms and biases are AdamW's. Decided by name
    and shape, so a matrix added to a block goes to Muon as well; a new head named other than lm_head must be
    named here to stay with AdamW."""
    names = [entry.key for entry in path]
    return names[-1] == "kernel" and param.ndim == 2 and "lm_head" not in names


def muon_with_adamw(training_args, schedule: optax.Schedule) -> optax.GradientTransformation:
    """optax's Muon for the hidden matrices (is_hidden_matrix), at --muon_learning_rate, and AdamW as --optim adamw
    for every other parameter, at --learning_rate: both in the shape of `schedule`."""
    muon_scale = training_args.muon_learning_rate / training_args.learning_rate
    # optax.contrib.muon sends what is not 2-D to an Adam of its own; given only 2-D matrices, that Adam holds
    # nothing but a step count.
    muon = optax.contrib.muon(
        lambda step: schedule(step) * muon_scale,
        beta=training_args.muon_momentum,
        weight_decay=training_args.weight_decay,
    )
    return optax.partition(
        {"muon": muon, "adamw": OPTIMIZERS["adamw"](training_args, schedule)},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, param: "muon" if is_hidden_matrix(path, param) else "adamw", params
        ),
    )


# What --optim names: the optimizer from (training_args, schedule). Add an entry here and the flag takes it.
OPTIMIZERS = {
    "adamw": lambda training_args, schedule: optax.adamw(
        schedule,
        b1=training_args.adam_beta1,
        b2=training_args.adam_beta2,
        eps=training_args.adam_epsilon,
        weight_decay=training_args.weight_decay,
        mask=decay_mask,
    ),
    "muon": muon_with_adamw,
    "lion": lambda training_args, schedule: optax.lion(
        schedule,
        b1=training_args.adam_beta1,
        b2=training_args.adam_beta2,
        weight_decay=training_args.weight_decay,
        mask=decay_mask,
    ),
    "adafactor": lambda training_args, schedule: optax.adafactor(
        schedule, weight_decay_rate=training_args.weight_decay or None, weight_decay_mask=decay_mask
    ),
}


def check_optimizer_arguments(training_args):
    """Refuse, before any work, an optimizer, schedule or decay shape that the tables above do not name, and a floor
    for a schedule that does not decay."""
    check_choices(
        training_args, optim=OPTIMIZERS, lr_scheduler_type=LEARNING_RATE_SCHEDULES, lr_decay_shape=DECAY_SHAPES
    )
    if training_args.min_lr_rate and training_args.lr_scheduler_type == "constant":
        raise UsageError("--min_lr_rate sets where a decay ends; use it with a --lr_scheduler_type that decays")


def create_optimizer(training_args, schedule: optax.Schedule) -> optax.GradientTransformation:
    optimizer = OPTIMIZERS[training_args.optim](training_args, schedule)
    if training_args.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(training_args.max_grad_norm), optimizer)
    return optimizer


def make_train_step(model, optimizer, schedule, seed: int):
    dropout_key = jax.random.key(seed + 1)

    def loss_and_sums(params, micro_batch, dropout_rng):
        input_ids = micro_batch["input_ids"]
        logits = model.apply({"params": params}, input_ids, deterministic=False, rngs={"dropout": dropout_rng})
        loss_sum, token_count = causal_lm_loss_sums(logits, input_ids, jnp.ones(input_ids.shape, jnp.float32))
        return loss_sum, {"loss_sum": loss_sum, "token_count": token_count}

    def train_step(state: TrainState, batch):
        # Dropout randomness depends only on the step, so a resumed run draws the same masks.
        step_rng = jax.random.fold_in(dropout_key, state.step)
        grads, sums = accumulate_gradients(loss_and_sums, state.params, batch, step_rng)
        # The mean over every predicted token of the whole batch, however it was split into micro-batches, in
        # the parameters' dtype: the float32 count would otherwise turn bfloat16 gradients, and with them the
        # optimizer state, into float32.
        grads = jax.tree_util.tree_map(
            lambda grad, param: (grad / sums["token_count"]).astype(param.dtype), grads, state.params
        )
        new_state, update_metrics = apply_finite_update(state, grads, sums["loss_sum"], optimizer)
        return new_state, sums | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


def make_eval_step(model, token_bytes: np.ndarray | None = None):
    """The summed loss and predicted tokens of a batch; with `token_bytes` (token_byte_counts) also the UTF-8
    bytes of the predicted tokens, for bits per byte."""

    def eval_step(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], deterministic=True)
        loss_sum, token_count = causal_lm_loss_sums(logits, batch["input_ids"], batch["weights"])
        sums = {"loss_sum": loss_sum, "token_count": token_count}
        if token_bytes is not None:
            # The bytes of exactly the tokens the loss predicts: every token but the first of each block.
            target_bytes = jnp.asarray(token_bytes)[batch["input_ids"][:, 1:]]
            sums["byte_count"] = jnp.sum(target_bytes * batch["weights"][:, 1:])
        return sums

    return eval_step


def evaluation_sums(eval_step, params, blocks, global_batch_size, batch_sharding) -> dict:
    """The eval step's sums over every block."""
    totals = {}
    num_batches = math.ceil(len(blocks) / global_batch_size)
    batches = prefetch(to_global_batch(batch, batch_sharding) for batch in eval_batches(blocks, global_batch_size))
    for batch in tqdm(batches, total=num_batches, desc="Evaluating", leave=False, disable=jax.process_index() > 0):
        for name, value in jax.device_get(eval_step(params, batch)).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def describe_results(results: dict) -> str:
    bits_per_byte = f", bits per byte {results['bits_per_byte']:.4f}" if "bits_per_byte" in results else ""
    return f"loss {results['loss']:.4f}, perplexity {results['perplexity']:.2f}{bits_per_byte}"


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


def sample_texts(sampler, params, tokenizer, prompts: list[str], num_tokens: int, max_length: int, seed: int):
    """Each prompt continued by up to `num_tokens` tokens drawn with temperature 1 from the 40 most likely; an
    empty prompt starts from the end-of-text token, and long prompts keep their last tokens (at most
    `max_length` positions in all). The texts are decoded without special tokens: a reader sees text only."""
    num_tokens = min(num_tokens, max_length - 1)
    encoded = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    prompt_ids = [(ids or [tokenizer.eos_token_id])[-(max_length - num_tokens) :] for ids in encoded]
    new_ids = generate_ids(sampler, params, prompt_ids, num_tokens, temperature=1.0, top_k=40, seed=seed)
    return [tokenizer.decode(ids + new, skip_special_tokens=True) for ids, new in zip(prompt_ids, new_ids)]


class Evaluation:
    """Evaluation on the validation blocks, logged with samples from the same prompts each time, so that a
    reader sees the text get better; the sampler is compiled once."""

    # What TensorBoard's HParams tab compares runs by.
    metric_tags = ["eval/loss", "eval/perplexity", "eval/bits_per_byte"]

    def __init__(self, setup: "TrainingSetup", blocks, tokenizer, training_args, trackers):
        self.setup, self.blocks, self.tokenizer, self.trackers = setup, blocks, tokenizer, trackers
        self.output_dir, self.seed = training_args.output_dir, training_args.seed
        self.prompts, self.sample_tokens = training_args.sample_prompt or [""], training_args.sample_tokens
        model = setup.model  # without gradient checkpointing, which sampling does not need
        sampling_model = FlaxGPT2LMHeadModel(
            model.config, dtype=model.dtype, param_dtype=model.param_dtype, mesh=model.mesh
        )
        self.sampler = make_sampler(sampling_model, tokenizer.eos_token_id)

    def __call__(self, params, step: int) -> dict:
        """The results on the whole evaluation data; with a mixture, those of each source under "sources" too."""
        setup = self.setup
        results = evaluate_by_source(
            partial(
                evaluation_sums,
                setup.eval_step,
                params,
                global_batch_size=setup.eval_batch_size,
                batch_sharding=setup.batch_sharding,
            ),
            self.blocks,
            evaluation_results,
        )
        report_by_source(results, step, self.trackers, ("loss", "perplexity", "bits_per_byte"), describe_results)
        if self.sample_tokens > 0:
            texts = self.samples(params)
            for text in texts:
                logger.info("step %d: sample %r", step, text)
            # Indented four spaces: markdown shows the texts verbatim, line breaks and all.
            code_blocks = ["\n".join("    " + line for line in text.split("\n")) for text in texts]
            self.trackers.text("samples", "\n\n---\n\n".join(code_blocks), step)
        return results

    def samples(self, params, sampler=None) -> list[str]:
        max_length = self.setup.model.config.n_positions
        return sample_texts(
            sampler or self.sampler, params, self.tokenizer, self.prompts, self.sample_tokens, max_length, self.seed
        )

    def final(self, params, step: int, reuse_saved: bool):
        """The evaluation of the final weights, into eval_results.json; with `reuse_saved`, one already there for
        this step is kept."""
        if reuse_saved and evaluated_step(self.output_dir) == step:
            logger.info("The complete run's evaluation is in %s", os.path.join(self.output_dir, "eval_results.json"))
            return
        results = self(params, step)
        if jax.process_index() == 0:
            # bits_per_byte and bytes are null where the tokens have no fixed byte count.
            names = ("loss", "perplexity", "bits_per_byte", "tokens", "bytes")
            saved = {f"eval_{name}": results.get(name) for name in names}
            for source, source_results in results["sources"].items():
                saved.update({f"eval_{source}_{name}": source_results.get(name) for name in names})
            saved.update(eval_samples=sum(map(len, evaluation_sets(self.blocks).values())), step=step)
            write_json(os.path.join(self.output_dir, "eval_results.json"), saved)
            bits_per_byte = f", {results['bits_per_byte']:.4f} bits per byte" if "bits_per_byte" in results else ""
            print(f"eval perplexity: {results['perplexity']:.2f} (loss {results['loss']:.4f}{bits_per_byte})")

    def sample_from_export(self, abstract_params):
        """Samples from the exported model, read back: they also show that the saved files hold the trained model."""
        if jax.process_index() != 0 or self.sample_tokens <= 0:
            return
        exported = load_file(os.path.join(self.output_dir, "model.safetensors"))
        sampler = self.sampler
        if jax.process_count() > 1:  # process 0 alone, so on its own device, not on a mesh the others would share
            model = self.setup.model
            sampler = make_sampler(
                FlaxGPT2LMHeadModel(model.config, dtype=model.dtype, param_dtype=model.param_dtype),
                self.tokenizer.eos_token_id,
            )
        for text in self.samples(from_hf_state_dict(exported, abstract_params), sampler):
            print(f"sample from {self.output_dir}: {text!r}")


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    model_args, data_args, training_args, distributed_args = parse_arguments(
        ModelArguments, DataTrainingArguments, TrainingArguments
    )
    initialize_distributed(distributed_args)
    check_arguments(model_args, data_args, training_args)
    # Every process checks --output_dir before process 0 writes into it. On CPU, this first exchange also sets up
    # the processes' collectives, which they must reach within 30 s of each other: right after joining, they do.
    wait_for_all_processes("arguments checked")
    setup_logging(is_main_process=jax.process_index() == 0)
    on_process_zero(lambda: check_output_dir(training_args), f"use --output_dir {training_args.output_dir}")

    config, tokenizer = load_config_and_tokenizer(model_args)
    mesh = create_mesh(training_args.mesh_shape)
    check_model_config(config, mesh)
    block_size = choose_block_size(data_args, tokenizer, config)
    blocks, train_stream = load_data(
        model_args, data_args, training_args, tokenized_rows, tokenizer, block_size, f"--block_size {block_size}"
    )
    if not (training_args.do_train or training_args.do_eval):
        print_once(f"packed data: {data_args.packed_data_dir}")
        return

    model = causal_lm_model(config, tokenizer, model_args, data_args, mesh)
    eval_step = make_eval_step(model, token_byte_counts(tokenizer, config.vocab_size))
    setup = set_up_training(model, eval_step, training_args, blocks.get("train"), block_size)
    compile_train_steps_ahead(setup, training_args)
    state, progress = initial_state(model_args, training_args, setup)
    # Process 0 holds the lock on the output directory until this process ends, for all processes.
    output_dir_lock = on_process_zero(  # noqa: F841
        lambda: prepare_output_dir(training_args, progress.step, __file__),
        f"lock --output_dir {training_args.output_dir}",
    )
    arguments = recorded_arguments(model_args, data_args, training_args)
    trackers = open_trackers(training_args, progress, arguments, config, Evaluation.metric_tags)
    evaluation = Evaluation(setup, blocks.get("validation"), tokenizer, training_args, trackers)

    train_now = training_args.do_train and progress.step < setup.total_steps
    if train_now:
        batches = train_batches_from(
            progress.step, setup, blocks.get("train"), train_stream, tokenizer, data_args, training_args
        )
        save = partial(save_run, setup, config, tokenizer, arguments)
        log = TrainingLog(trackers, progress, setup.total_steps, train_metrics, training_args.skip_nonfinite_steps)
        state, stopped_by = train(state, progress, batches, setup.train_steps, save, evaluation, log, training_args)
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
        evaluation.sample_from_export(setup.abstract_state.params)
    if training_args.do_train and "tensorboard" in training_args.report_to:
        print_once(f"TensorBoard: tensorboard --logdir {os.path.join(training_args.output_dir, 'tensorboard')}")


def choose_block_size(data_args, tokenizer, config) -> int:
    block_size = data_args.block_size or min(tokenizer.model_max_length, config.n_positions, 1024)
    if block_size > config.n_positions:
        raise UsageError(
            f"--block_size {block_size} exceeds the model's n_positions {config.n_positions}; lower --block_size"
        )
    return block_size


def causal_lm_model(config, tokenizer, model_args, data_args, mesh) -> FlaxGPT2LMHeadModel:
    """The model to train on `mesh`, in the dtypes asked for. With --document_attention it keeps the documents of a
    block apart, each starting at the end-of-text token that ends the one before."""
    dtypes = jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype)
    separator_id = tokenizer.eos_token_id if data_args.document_attention else None
    return FlaxGPT2LMHeadModel(
        config, *dtypes, model_args.gradient_checkpointing, mesh, document_separator_id=separator_id
    )


@dataclass
class TrainingSetup:
    """What training and evaluation need, built once from the arguments and the model."""

    model: nn.Module
    sequence_length: int
    train_batch_size: int  # global: over all devices and micro-batches
    eval_batch_size: int
    train_examples: Any  # None for a stream
    steps_per_epoch: int | None
    total_steps: int
    batch_sharding: NamedSharding
    call_batches_sharding: NamedSharding
    learning_rate_schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    abstract_state: TrainState
    train_steps: Any  # (state, batches of up to --steps_per_call steps, steps) -> (state, metrics of each step)
    eval_step: Any


def set_up_training(model, eval_step, training_args, train_examples, sequence_length: int) -> TrainingSetup:
    logger.info(
        "%d devices over %d processes (%d here): %s",
        jax.device_count(),
        jax.process_count(),
        jax.local_device_count(),
        jax.devices(),
    )
    mesh = model.mesh
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    # (step of a compiled call, micro-batch, row, ...)
    call_batches_sharding = NamedSharding(mesh, PartitionSpec(None, None, BATCH_AXES))
    accumulation_steps = training_args.gradient_accumulation_steps
    train_batch_size = training_args.per_device_train_batch_size * jax.device_count() * accumulation_steps
    steps_per_epoch, total_steps = count_steps(training_args, train_examples, train_batch_size, "--block_size")
    schedule = learning_rate_schedule(training_args, total_steps)
    optimizer = create_optimizer(training_args, schedule)
    abstract_state = abstract_train_state(model, optimizer, mesh, jnp.zeros((1, sequence_length), jnp.int32))
    check_architecture_fits(abstract_state.params, model.config, gpt2)  # before any training
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
        train_examples=train_examples,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        batch_sharding=batch_sharding,
        call_batches_sharding=call_batches_sharding,
        learning_rate_schedule=schedule,
        optimizer=optimizer,
        abstract_state=abstract_state,
        train_steps=jax.jit(
            repeat_train_step(
                make_train_step(model, optimizer, schedule, training_args.seed), training_args.steps_per_call
            ),
            in_shardings=(state_shardings, call_batches_sharding, None),
            out_shardings=(state_shardings, None),
            donate_argnums=(0,),
            compiler_options=train_step_compiler_options(),
        ),
        eval_step=jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding)),
    )


def initial_state(model_args, training_args, setup: TrainingSetup) -> tuple[TrainState, "TrainingProgress"]:
    """The state to start from: with --resume_from_checkpoint the newest (or the named) training checkpoint, if
    there is one; otherwise new weights, or those of the Hugging Face checkpoint --model_name_or_path."""
    if training_args.resume_from_checkpoint:
        record_keys = ["step", "global_batch_size", "block_size"]
        restored = restore_checkpoint(
            training_args.resume_from_checkpoint, training_args.output_dir, setup.abstract_state, record_keys
        )
        if restored:
            state, record, path = restored
            logger.info("Resumed from %s at step %d", path, record["step"])
            check_resumed_run(record, setup, training_args, "block_size")
            return state, TrainingProgress.from_record(record, TRAIN_METRIC_SUMS)
        logger.info("No training checkpoint to resume from in %s: starting a new run", training_args.output_dir)
    dummy_input = jnp.zeros((1, setup.sequence_length), jnp.int32)
    loaded_params = pretrained_params(model_args, setup)
    state = create_train_state(
        setup.model, setup.optimizer, setup.abstract_state, training_args.seed, dummy_input, loaded_params
    )
    return state, TrainingProgress.start(TRAIN_METRIC_SUMS)


def pretrained_params(model_args, setup: TrainingSetup):
    """The weights of the Hugging Face checkpoint --model_name_or_path in this model's layout; None without one."""
    if not model_args.model_name_or_path:
        return None
    checkpoint = read_safetensors_checkpoint(model_args.model_name_or_path, model_args)
    params = from_hf_state_dict(checkpoint, setup.abstract_state.params)
    logger.info("Loaded weights from %s", model_args.model_name_or_path)
    return params


def train_batches_from(
    first_step, setup: TrainingSetup, train_blocks, train_stream, tokenizer, data_args, training_args
):
    """The global batches of each compiled call after `first_step` (steps_of_calls says how many steps each runs),
    stacked, and the token count of each step, read ahead on a thread. The data order is a function of the step, so a
    resumed run sees the batches the interrupted one would have."""
    batch_size, block_size = setup.train_batch_size, setup.sequence_length
    if isinstance(train_blocks, Mixture):
        data = f"on a mixture ({train_blocks.describe(setup.total_steps * batch_size)})"
        rows = process_slice(batch_size)
        global_batches = train_blocks.global_batches(batch_size, training_args.seed, first_step)
        local_batches = ({"input_ids": train_blocks[indices[rows]]} for indices in global_batches)
    elif train_stream is None:
        data = f"({setup.total_steps / setup.steps_per_epoch:.2f} epochs of {len(train_blocks)} blocks)"
        batches_of_epoch = partial(train_batches, train_blocks, batch_size, training_args.seed)
        local_batches = epochs_of_batches(batches_of_epoch, first_step, setup.steps_per_epoch)
    else:
        data = "on blocks packed from a stream"
        first_batch, seed = stream_position(first_step, batch_size, training_args)
        local_batches = streaming_train_batches(
            train_stream,
            tokenizer,
            data_args.text_column_name,
            pack_blocks,
            block_size,
            batch_size,
            seed,
            data_args.shuffle_buffer_size,
            first_batch,
        )
    logger.info(
        "Training steps %d to %d %s, global batch %d x %d tokens",
        first_step + 1,
        setup.total_steps,
        data,
        batch_size,
        block_size,
    )
    accumulation_steps = training_args.gradient_accumulation_steps
    micro_batches = (
        ({"input_ids": batch["input_ids"].reshape(accumulation_steps, -1, block_size)}, batch_size * block_size)
        for batch in local_batches
    )
    calls = steps_of_calls(first_step, setup.total_steps, training_args)
    return call_batches(micro_batches, calls, training_args.steps_per_call, setup.call_batches_sharding)


def compile_train_steps_ahead(setup: TrainingSetup, training_args):
    """With --do_train, start compiling the train step on a thread, while the weights are initialised or restored."""
    if training_args.do_train:
        abstract_batches = abstract_call_batches(setup, training_args)
        compile_in_background(setup.train_steps, setup.abstract_state, abstract_batches, training_args.steps_per_call)


def abstract_call_batches(setup: TrainingSetup, training_args) -> dict:
    """Shape, dtype and sharding of the batches of one compiled call, as train_batches_from makes them."""
    global_batch = {"input_ids": jax.ShapeDtypeStruct((setup.train_batch_size, setup.sequence_length), jnp.int32)}
    accumulation_steps, steps_per_call = training_args.gradient_accumulation_steps, training_args.steps_per_call
    return call_batch_shapes(global_batch, accumulation_steps, steps_per_call, setup.call_batches_sharding)


def steps_of_calls(first_step: int, total_steps: int, training_args) -> list[int]:
    """How many steps each compiled call runs, from the step after `first_step` to the last: --steps_per_call, or
    fewer where the loop logs, evaluates or saves sooner, so that a call ends at every such step."""
    intervals = [training_args.logging_steps, training_args.save_steps]
    if training_args.do_eval:
        intervals.append(training_args.eval_steps or training_args.logging_steps)
    calls, step = [], first_step
    while step < total_steps:
        call_end = min([total_steps, step + training_args.steps_per_call] + [(step // n + 1) * n for n in intervals])
        calls.append(call_end - step)
        step = call_end
    return calls


def train(state, progress: TrainingProgress, batches, train_steps, save, evaluate, log: TrainingLog, training_args):
    """Train from the step after `progress.step` to the last, in compiled calls of the steps `batches` holds for each
    (steps_of_calls), logging every --logging_steps, evaluating every --eval_steps (with --do_eval) and saving every
    --save_steps and at the end, or after the call in which a stop was requested. Returns the state and the signal
    that stopped training, None if it ran to the end."""
    eval_steps = training_args.eval_steps or training_args.logging_steps
    # Leaving this block, for whatever reason, waits for a checkpoint still being written.
    with (
        open_checkpoints(training_args.output_dir, training_args.save_total_limit) as checkpoints,
        StopRequest() as stop,
        log,
    ):
        checkpoint_being_written, step = None, progress.step
        for batch, step_tokens in batches:
            state, metrics = train_steps(state, batch, len(step_tokens))
            log.steps_done(metrics, step_tokens)
            step += len(step_tokens)
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


def save_run(setup: TrainingSetup, config, tokenizer, arguments: dict, checkpoints, state, progress) -> int:
    """Save a training checkpoint (written in the background) and export the model. Returns the step saved."""
    record = progress.record(
        global_batch_size=setup.train_batch_size,
        block_size=setup.sequence_length,
        training_examples=None if setup.train_examples is None else len(setup.train_examples),
        learning_rate=float(setup.learning_rate_schedule(progress.step - 1)),  # that of the step just trained
        arguments=arguments,
    )
    if setup.steps_per_epoch:
        record["epoch"], record["batch_in_epoch"] = divmod(progress.step, setup.steps_per_epoch)
    save_checkpoint(checkpoints, state, record)
    output_dir = os.path.dirname(str(checkpoints.directory))
    save_model(output_dir, state.params, config, tokenizer, gpt2)
    logger.info(
        "step %d: saved the model to %s; writing the training checkpoint in the background", progress.step, output_dir
    )
    return progress.step


def export_complete_run(output_dir: str, params, config, tokenizer):
    """Export the model of a run that is complete, where it is missing: the run was stopped after its last
    checkpoint was committed but before the export."""
    if not os.path.isfile(os.path.join(output_dir, "model.safetensors")):
        save_model(output_dir, params, config, tokenizer, gpt2)
        logger.info("Exported the model of the complete run to %s", output_dir)


if __name__ == "__main__":
    run(main)
