"""Setting up training, the same for both scripts: the batches' shapes and shardings, the optimizer and the compiled
train and eval steps (set_up_training, from the script's own functions in ScriptTraining), the state a run starts from
(new weights, a model's, or a checkpoint's after comparing its run with this one), and the saves (a checkpoint and the
exported model)."""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from flax_lm.command_line.arguments import parse_arguments
from flax_lm.command_line.trainer_flags import apply_strategies
from flax_lm.data.loading import count_steps
from flax_lm.data.packed import tokenizer_fingerprint
from flax_lm.devices.mesh import BATCH_AXES
from flax_lm.devices.processes import (
    initialize_distributed,
    on_process_zero,
    print_once,
    setup_logging,
    wait_for_all_processes,
)
from flax_lm.models import huggingface
from flax_lm.models.huggingface import SAFETENSORS_INDEX, read_exported_params
from flax_lm.models.model_code import FLAX_WEIGHTS_NAME, ModelCode
from flax_lm.run.best_model import BestModel
from flax_lm.run.checkpoints import restore_checkpoint, save_checkpoint
from flax_lm.run.output_dir import check_output_dir, evaluated_step, links_replaced, write_all_results
from flax_lm.run.record import (
    TrainingProgress,
    check_optimizer_arguments,
    check_recorded_run,
    check_resumed_run,
    describe_run,
)
from flax_lm.run.tracking import tensorboard_dir
from flax_lm.training.fp8 import fp8_training
from flax_lm.training.train_state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    repeat_train_step,
    train_step_compiler_options,
)

logger = logging.getLogger(__name__)


def start_run(argument_types: tuple, check_arguments: Callable, flag_tables: dict) -> tuple:
    """The script's arguments (of `argument_types`: model, data, training; `flag_tables`: the tables its flags name,
    listed by --help), parsed and checked by the script's `check_arguments` on every process, once the processes of
    the run have joined; then the log, and --output_dir checked by process 0 before anything is written into it."""
    model_args, data_args, training_args, distributed_args = parse_arguments(*argument_types, flag_tables)
    initialize_distributed(distributed_args)
    check_arguments(model_args, data_args, training_args)
    # Every process checks --output_dir before process 0 writes into it. On CPU, this first exchange also sets up
    # the processes' collectives, which they must reach within 30 s of each other: right after joining, they do.
    wait_for_all_processes("arguments checked")
    setup_logging(is_main_process=jax.process_index() == 0)
    on_process_zero(lambda: check_output_dir(training_args), f"use --output_dir {training_args.output_dir}")
    return model_args, data_args, training_args


def finish_run(training_args, evaluation, trackers, params, step: int, trained_now: bool, show_export: Callable):
    """After training (or instead of it): the final evaluation of `params`, the weights of `step` the run exported
    (that of the last save where nothing was trained since, and final_weights' with --metric_for_best_model), every
    result in all_results.json and the trackers, then `show_export` (the script's look at what the exported model
    does) after a run that trained."""
    if training_args.do_eval:
        # A complete run, repeated, and a run that chose its best model have evaluated these weights already.
        reuse_saved = training_args.do_train and (not trained_now or bool(training_args.metric_for_best_model))
        if reuse_saved and evaluated_step(training_args.output_dir) == step:
            logger.info(
                "The complete run's evaluation is in %s", os.path.join(training_args.output_dir, "eval_results.json")
            )
        else:
            evaluation.final(params, step)
    if jax.process_index() == 0:
        trackers.results(write_all_results(training_args.output_dir), step)
    trackers.close()
    if trained_now:
        show_export()
    if training_args.do_train and "tensorboard" in training_args.report_to:
        print_once(f"TensorBoard: tensorboard --logdir {tensorboard_dir(training_args)}")


@dataclass(frozen=True)
class ScriptTraining:
    """What a training script gives the set-up beside its model: its own schedule, optimizer and train step, the sums
    its train step makes, and the name of its sequence length (the flag, and the key checkpoints record it under)."""

    learning_rate_schedule: Callable  # (training_args, total_steps) -> optax.Schedule
    create_optimizer: Callable  # (training_args, schedule) -> optax.GradientTransformation
    make_train_step: Callable  # (model, optimizer, schedule, seed) -> train_step(state, batch) -> (state, metrics)
    metric_sums: tuple[str, ...]  # the train step's metrics that are summed over steps (TRAIN_METRIC_SUMS)
    length_name: str  # block_size, max_seq_length


@dataclass
class TrainingSetup:
    """What training and evaluation need, built once from the arguments, the model and the script's functions."""

    model: nn.Module
    model_code: ModelCode
    script: ScriptTraining
    sequence_length: int
    train_batch_size: int  # global: over all devices and micro-batches
    eval_batch_size: int
    train_rows: Any  # None for a stream
    steps_per_epoch: int | None
    total_steps: int
    batch_sharding: NamedSharding
    call_batches_sharding: NamedSharding
    learning_rate_schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    abstract_state: TrainState
    # (state, batches of up to --steps_per_call steps, the steps to run) -> (state, the metrics of each step)
    compiled_train_steps: Any
    eval_step: Any
    max_shard_size: str | None  # --max_shard_size of the exports


def set_up_training(
    model, model_code: ModelCode, script: ScriptTraining, eval_step, training_args, train_rows, sequence_length: int
) -> TrainingSetup:
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
    steps_per_epoch, total_steps = count_steps(
        training_args.do_train,
        training_args.max_steps,
        training_args.num_train_epochs,
        train_rows,
        train_batch_size,
        f"--{script.length_name}",
    )
    apply_strategies(training_args, steps_per_epoch, total_steps)
    schedule = script.learning_rate_schedule(training_args, total_steps)
    optimizer = script.create_optimizer(training_args, schedule)
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
    # With --fp8 the train step alone multiplies in FP8: evaluation and samples compute as the exports do.
    train_model = fp8_training(model) if training_args.fp8 else model
    train_step = script.make_train_step(train_model, optimizer, schedule, training_args.seed)
    return TrainingSetup(
        model=model,
        model_code=model_code,
        script=script,
        sequence_length=sequence_length,
        train_batch_size=train_batch_size,
        eval_batch_size=training_args.per_device_eval_batch_size * jax.device_count(),
        train_rows=train_rows,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        batch_sharding=batch_sharding,
        call_batches_sharding=call_batches_sharding,
        learning_rate_schedule=schedule,
        optimizer=optimizer,
        abstract_state=abstract_state,
        compiled_train_steps=jax.jit(
            repeat_train_step(train_step, training_args.steps_per_call),
            in_shardings=(state_shardings, call_batches_sharding, None),
            out_shardings=(state_shardings, None),
            donate_argnums=(0,),
            compiler_options=train_step_compiler_options(),
        ),
        eval_step=jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding)),
        max_shard_size=training_args.max_shard_size,
    )


def run_description(arguments: dict, config, tokenizer, setup: TrainingSetup) -> dict:
    """What each checkpoint of the run records of it, and a resume compares with its own (flax_lm.run.record)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    return describe_run(arguments, config, fingerprint, setup.model_code, setup.train_rows, setup.train_batch_size)


def check_checkpoint_record(run: dict, allowed: list[str], setup, training_args, progress_record: dict):
    """What a checkpoint's record alone refuses, before its arrays are compared with this run's (where each would
    surface as a mismatch of shapes): another optimizer, whose state no allowed change carries over; other model code;
    a difference in what trains that --allow_resume_changes does not name."""
    check_optimizer_arguments(run, progress_record)
    check_recorded_run(run, allowed, setup, training_args, progress_record)


def initial_state(model_args, training_args, setup: TrainingSetup, run: dict) -> tuple[TrainState, TrainingProgress]:
    """The state to start from: with --resume_from_checkpoint the newest (or the named) training checkpoint, if
    there is one, whose run agrees with this one (`run`: run_description's); otherwise new weights, or those of the
    model --model_name_or_path."""
    metric_sums = setup.script.metric_sums
    if training_args.resume_from_checkpoint:
        allowed = training_args.allow_resume_changes or []
        restored = restore_checkpoint(
            training_args.resume_from_checkpoint,
            training_args.output_dir,
            setup.abstract_state,
            ["step", "global_batch_size", setup.script.length_name],
            partial(check_checkpoint_record, run, allowed, setup, training_args),  # before the arrays' shapes
        )
        if restored:
            state, record, path = restored
            logger.info("Resumed from %s at step %d", path, record["step"])
            progress = TrainingProgress.from_record(record, metric_sums)
            progress.best_model = BestModel.for_arguments(training_args, record)
            check_resumed_run(record, run, progress, allowed, setup, training_args)
            return state, progress
        logger.info("No training checkpoint to resume from in %s: starting a new run", training_args.output_dir)
    dummy_input = jnp.zeros((1, setup.sequence_length), jnp.int32)
    loaded_params = pretrained_params(model_args, setup)
    state = create_train_state(
        setup.model, setup.optimizer, setup.abstract_state, training_args.seed, dummy_input, loaded_params
    )
    progress = TrainingProgress.start(metric_sums)
    progress.best_model = BestModel.for_arguments(training_args)
    return state, progress


def pretrained_params(model_args, setup: TrainingSetup):
    """The weights of the model --model_name_or_path in this model's layout; None without one."""
    if not model_args.model_name_or_path:
        return None
    source = model_args.model_name_or_path
    params = read_exported_params(source, model_args, setup.model_code, setup.abstract_state.params)
    logger.info("Loaded weights from %s", source)
    return params


def save_model(output_dir: str, *model, **options):
    """huggingface.save_model, replacing the links in OUTPUT_DIR that it would write through (links_replaced)."""
    with links_replaced(output_dir):
        huggingface.save_model(output_dir, *model, **options)


def save_run(setup: TrainingSetup, config, tokenizer, run: dict, checkpoints, state, progress) -> int:
    """Save a training checkpoint (written in the background; its record holds the progress and `run`, what a
    resume compares) and export the model. Returns the step saved."""
    record = progress.record(
        run=run,
        global_batch_size=setup.train_batch_size,
        training_examples=None if setup.train_rows is None else len(setup.train_rows),
        learning_rate=float(setup.learning_rate_schedule(progress.step - 1)),  # that of the step just trained
        **{setup.script.length_name: setup.sequence_length},
    )
    if setup.steps_per_epoch:
        record["epoch"], record["batch_in_epoch"] = divmod(progress.step, setup.steps_per_epoch)
    save_checkpoint(checkpoints, state, record)
    output_dir = os.path.dirname(str(checkpoints.directory))
    save_model(output_dir, state.params, config, tokenizer, setup.model_code, setup.max_shard_size)
    logger.info(
        "step %d: exported the model to %s; writing the training checkpoint in the background",
        progress.step,
        output_dir,
    )
    return progress.step


def export_complete_run(training_args, params, config, tokenizer, model_code: ModelCode):
    """Export the model of a run that is complete, where it is missing: the run was stopped after its last
    checkpoint was committed but before the export."""
    output_dir, weights = training_args.output_dir, ("model.safetensors", SAFETENSORS_INDEX, FLAX_WEIGHTS_NAME)
    if not any(os.path.isfile(os.path.join(output_dir, name)) for name in weights):
        save_model(output_dir, params, config, tokenizer, model_code, training_args.max_shard_size)
        logger.info("Exported the model of the complete run to %s", output_dir)


def final_weights(training_args, setup: TrainingSetup, evaluation, state, progress, config, tokenizer) -> tuple:
    """The weights the run ends with and their step: the last ones, or with --load_best_model_at_end those of the
    checkpoint best by --metric_for_best_model, read back, exported and evaluated finally (eval_results.json). The
    last step's evaluation, the final one, is compared with the others first."""
    best, step = progress.best_model, int(state.step)
    if best is None:
        return state.params, step
    if best.evaluated_step < step:
        best.consider(evaluation.final(state.params, step), step)
    if not training_args.load_best_model_at_end or best.step in (None, step):
        return state.params, step
    output_dir = training_args.output_dir
    checkpoint = os.path.join(output_dir, "checkpoints", str(best.step))
    best_state, _, _ = restore_checkpoint(checkpoint, output_dir, setup.abstract_state, ["step"])
    save_model(output_dir, best_state.params, config, tokenizer, setup.model_code, setup.max_shard_size)
    logger.info(
        "Exported the best model, of step %d (%s %.6g), from %s to %s",
        best.step,
        best.metric,
        best.value,
        checkpoint,
        output_dir,
    )
    evaluation.final(best_state.params, best.step)
    return best_state.params, best.step
