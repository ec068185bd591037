"""A training run's life after its flags are checked (flax_lm.command_line.start), the same for both scripts: the
set-up (the batches' shapes and shardings, the optimizer and the compiled train and eval steps: set_up_training, from
the script's own functions in ScriptTraining), the state a run starts from (new weights, a model's, or a checkpoint's
after comparing its run with this one), the saves (a checkpoint and the exported model) and the end (the final
weights, the results files)."""

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

from flax_lm.data.loading import count_steps
from flax_lm.data.mixture import Mixture
from flax_lm.data.packed import tokenizer_fingerprint
from flax_lm.devices.mesh import BATCH_AXES
from flax_lm.devices.processes import print_once
from flax_lm.models import huggingface
from flax_lm.models.huggingface import SAFETENSORS_INDEX
from flax_lm.models.model_code import FLAX_WEIGHTS_NAME, ModelCode
from flax_lm.run.best_model import BestModel, BestModelSettings
from flax_lm.run.checkpoints import restore_checkpoint, save_checkpoint
from flax_lm.run.output_dir import OutputDirSettings, evaluated_step, links_replaced, write_all_results, write_json
from flax_lm.run.record import (
    ResumeSettings,
    TrainingProgress,
    check_recorded_optimizer,
    check_recorded_run,
    check_resumed_run,
    describe_run,
)
from flax_lm.training.fp8 import fp8_training
from flax_lm.training.lora import ADAPTER_WEIGHTS, Adapters
from flax_lm.training.optimizers import OptimizerSettings
from flax_lm.training.train_state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    repeat_train_step,
    train_step_compiler_options,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingSettings:
    """What set_up_training builds the training from beside the model, its rows and the script's functions: the
    training flags of the same names (the scripts' training arguments give theirs,
    CommonTrainingArguments.training_settings)."""

    do_train: bool
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    gradient_accumulation_steps: int
    max_steps: int
    num_train_epochs: float
    steps_per_call: int
    seed: int
    fp8: bool
    max_shard_size: str | None
    optimizer: OptimizerSettings


@dataclass(frozen=True)
class RunSettings:
    """What a run's start, last saves and end need: the output directory, the run's parts (--do_train, --do_eval),
    how a resume goes, the best model's metric and the trackers' TensorBoard directory where --report_to
    names it (the scripts' training arguments give theirs, CommonTrainingArguments.run_settings)."""

    output: OutputDirSettings  # the output directory, and --do_train
    do_eval: bool
    resume: ResumeSettings
    best_model: BestModelSettings | None  # without --metric_for_best_model
    tensorboard_dir: str | None  # without tensorboard in --report_to


def finish_run(
    settings: RunSettings, evaluation, trackers, params, step: int, trained_now: bool, show_export: Callable
):
    """After training (or instead of it): the final evaluation of `params`, the weights of `step` the run exported
    (that of the last save where nothing was trained since, and final_weights' with --metric_for_best_model), every
    result in all_results.json and the trackers, then `show_export` (the script's look at what the exported model
    does) after a run that trained."""
    if settings.do_eval:
        # A complete run, repeated, and a run that chose its best model have evaluated these weights already.
        reuse_saved = settings.output.do_train and (not trained_now or settings.best_model is not None)
        output_dir = settings.output.output_dir
        if reuse_saved and evaluated_step(output_dir) == step:
            logger.info("The complete run's evaluation is in %s", os.path.join(output_dir, "eval_results.json"))
        else:
            evaluation.final(params, step)
    if jax.process_index() == 0:
        trackers.results(write_all_results(settings.output.output_dir), step)
    trackers.close()
    if trained_now:
        show_export()
    if settings.output.do_train and settings.tensorboard_dir:
        print_once(f"TensorBoard: tensorboard --logdir {settings.tensorboard_dir}")


@dataclass(frozen=True)
class ScriptTraining:
    """What a training script gives the set-up beside its model: its own schedule, optimizer and train step, the sums
    its train step makes, and the name of its row length (the flag, and the key checkpoints record it under)."""

    learning_rate_schedule: Callable  # (OptimizerSettings, total_steps) -> optax.Schedule
    create_optimizer: Callable  # (OptimizerSettings, schedule) -> optax.GradientTransformation
    make_train_step: Callable  # (model, optimizer, schedule, seed) -> train_step(state, batch) -> (state, metrics)
    metric_sums: tuple[str, ...]  # the train step's metrics that are summed over steps (TRAIN_METRIC_SUMS)
    length_name: str  # block_size, max_seq_length


@dataclass
class TrainingSetup:
    """What training and evaluation need, built once from the arguments, the model and the script's functions."""

    model: nn.Module
    model_code: ModelCode
    script: ScriptTraining
    row_length: int
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
    seed: int  # --seed: of new weights, and of the train step's dropout
    adapters: Adapters | None = None  # LoRA's (--lora_rank, --lora_adapter): the model trains these alone

    def export(self, output_dir: str, params, config, tokenizer):
        """Export the model: a Hugging Face model directory (save_model), or with adapters a PEFT adapter."""
        if self.adapters is None:
            save_model(output_dir, params, config, tokenizer, self.model_code, self.max_shard_size)
        else:
            with links_replaced(output_dir):
                self.adapters.save(output_dir, params, config, tokenizer, self.model_code, self.max_shard_size)

    def read_export(self, output_dir: str, abstract_params):
        """The parameters of the model exported to `output_dir` (with adapters: on the base model's weights)."""
        if self.adapters is None:
            return huggingface.read_exported_params(output_dir, None, self.model_code, abstract_params)
        return self.adapters.read_export(output_dir, self.model_code, abstract_params)


def set_up_training(
    model,
    model_code: ModelCode,
    script: ScriptTraining,
    eval_step,
    settings: TrainingSettings,
    train_rows,
    row_length: int,
    adapters: Adapters | None = None,
) -> TrainingSetup:
    """The TrainingSetup of `model` (with `adapters`, adapted_model's) for `train_rows` of `row_length` tokens. The
    evaluation and save intervals of --eval_strategy and --save_strategy follow from its steps
    (flax_lm.command_line.trainer_flags.apply_strategies)."""
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
    accumulation_steps = settings.gradient_accumulation_steps
    train_batch_size = settings.per_device_train_batch_size * jax.device_count() * accumulation_steps
    steps_per_epoch, total_steps = count_steps(
        settings.do_train,
        settings.max_steps,
        settings.num_train_epochs,
        train_rows,
        train_batch_size,
        f"--{script.length_name}",
    )
    schedule = script.learning_rate_schedule(settings.optimizer, total_steps)
    optimizer = script.create_optimizer(settings.optimizer, schedule)
    abstract_state = abstract_train_state(model, optimizer, mesh, jnp.zeros((1, row_length), jnp.int32))
    state_shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
    logger.info(
        "%s with %.1fM parameters in %s, computing in %s, on a mesh of %s",
        type(model).__name__,
        sum(leaf.size for leaf in jax.tree_util.tree_leaves(abstract_state.params)) / 1e6,
        jnp.dtype(model.param_dtype),
        jnp.dtype(model.dtype),
        dict(mesh.shape),
    )
    if adapters is not None:
        logger.info(adapters.describe(abstract_state.params))
    optimizer_bytes = sum(
        leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(abstract_state.opt_state)
    )
    logger.info("The optimizer's state: %.2f MB", optimizer_bytes / 1e6)
    # With --fp8 the train step alone multiplies in FP8: evaluation and samples compute as the exports do.
    train_model = fp8_training(model) if settings.fp8 else model
    train_step = script.make_train_step(train_model, optimizer, schedule, settings.seed)
    return TrainingSetup(
        model=model,
        model_code=model_code,
        script=script,
        row_length=row_length,
        train_batch_size=train_batch_size,
        eval_batch_size=settings.per_device_eval_batch_size * jax.device_count(),
        train_rows=train_rows,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        batch_sharding=batch_sharding,
        call_batches_sharding=call_batches_sharding,
        learning_rate_schedule=schedule,
        optimizer=optimizer,
        abstract_state=abstract_state,
        compiled_train_steps=jax.jit(
            repeat_train_step(train_step, settings.steps_per_call),
            in_shardings=(state_shardings, call_batches_sharding, None),
            out_shardings=(state_shardings, None),
            donate_argnums=(0,),
            compiler_options=train_step_compiler_options(),
        ),
        eval_step=jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding)),
        max_shard_size=settings.max_shard_size,
        seed=settings.seed,
        adapters=adapters,
    )


def run_description(arguments: dict, config, tokenizer, setup: TrainingSetup) -> dict:
    """What each checkpoint of the run records of it, and a resume compares with its own (flax_lm.run.record)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    return describe_run(arguments, config, fingerprint, setup.model_code, setup.train_rows, setup.train_batch_size)


def check_checkpoint_record(run: dict, setup, resume: ResumeSettings, progress_record: dict):
    """What a checkpoint's record alone refuses, before its arrays are compared with this run's (where each would
    surface as a mismatch of shapes): another optimizer, whose state no allowed change carries over; other model code;
    a difference in what trains that --allow_resume_changes does not name."""
    check_recorded_optimizer(run, progress_record)
    check_recorded_run(run, setup, resume, progress_record)


def initial_state(
    settings: RunSettings, setup: TrainingSetup, run: dict, read_pretrained: Callable | None
) -> tuple[TrainState, TrainingProgress]:
    """The state to start from: with --resume_from_checkpoint the newest (or the named) training checkpoint, if
    there is one, whose run agrees with this one (`run`: run_description's); otherwise new weights, or those
    `read_pretrained(model_code, abstract_params)` reads (the model --model_name_or_path; None without one)."""
    metric_sums, resume = setup.script.metric_sums, settings.resume
    if resume.resume_from_checkpoint:
        restored = restore_checkpoint(
            resume.resume_from_checkpoint,
            settings.output.output_dir,
            setup.abstract_state,
            ["step", "global_batch_size", setup.script.length_name],
            partial(check_checkpoint_record, run, setup, resume),  # before the arrays' shapes
        )
        if restored:
            state, record, path = restored
            logger.info("Resumed from %s at step %d", path, record["step"])
            progress = TrainingProgress.from_record(record, metric_sums)
            progress.best_model = BestModel.for_settings(settings.best_model, record)
            check_resumed_run(record, run, progress, setup, resume)
            return state, progress
        logger.info("No training checkpoint to resume from in %s: starting a new run", settings.output.output_dir)
    dummy_input = jnp.zeros((1, setup.row_length), jnp.int32)
    loaded_params = None
    if setup.adapters is not None:
        loaded_params = setup.adapters.start_params(setup.model_code, setup.abstract_state.params, setup.seed)
    elif read_pretrained is not None:
        loaded_params = read_pretrained(setup.model_code, setup.abstract_state.params)
    state = create_train_state(
        setup.model, setup.optimizer, setup.abstract_state, setup.seed, dummy_input, loaded_params
    )
    progress = TrainingProgress.start(metric_sums)
    progress.best_model = BestModel.for_settings(settings.best_model)
    return state, progress


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
        **{setup.script.length_name: setup.row_length},
    )
    if setup.steps_per_epoch:
        record["epoch"], record["batch_in_epoch"] = divmod(progress.step, setup.steps_per_epoch)
    save_checkpoint(checkpoints, state, record)
    output_dir = os.path.dirname(str(checkpoints.directory))
    # Gathering a sharded model's weights and checking the export against them takes a while on a big mesh.
    logger.info("step %d: exporting the model to %s", progress.step, output_dir)
    setup.export(output_dir, state.params, config, tokenizer)
    logger.info("step %d: exported the model; writing the training checkpoint in the background", progress.step)
    return progress.step


def export_complete_run(settings: RunSettings, params, config, tokenizer, setup: TrainingSetup):
    """Export the model of a run that is complete, where it is missing: the run was stopped after its last
    checkpoint was committed but before the export."""
    output_dir = settings.output.output_dir
    weights = (
        ("model.safetensors", SAFETENSORS_INDEX, FLAX_WEIGHTS_NAME) if setup.adapters is None else (ADAPTER_WEIGHTS,)
    )
    if not any(os.path.isfile(os.path.join(output_dir, name)) for name in weights):
        setup.export(output_dir, params, config, tokenizer)
        logger.info("Exported the model of the complete run to %s", output_dir)


def final_weights(
    settings: RunSettings, setup: TrainingSetup, evaluation, state, progress, config, tokenizer
) -> tuple:
    """The weights the run ends with and their step: the last ones, or with --load_best_model_at_end those of the
    checkpoint best by --metric_for_best_model, read back, exported and evaluated finally (eval_results.json). The
    last step's evaluation, the final one, is compared with the others first."""
    best, step = progress.best_model, int(state.step)
    if best is None:
        return state.params, step
    if best.evaluated_step < step:
        best.consider(evaluation.final(state.params, step), step)
    if not settings.best_model.load_at_end or best.step in (None, step):
        return state.params, step
    output_dir = settings.output.output_dir
    checkpoint = os.path.join(output_dir, "checkpoints", str(best.step))
    best_state, _, _ = restore_checkpoint(checkpoint, output_dir, setup.abstract_state, ["step"])
    setup.export(output_dir, best_state.params, config, tokenizer)
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


def write_train_results(output_dir: str, train_metrics, progress, setup, log, exported_step: int):
    """train_results.json: the script's training metrics (`train_metrics` of the summed metrics of `progress`) over
    the most steps that all their sums cover (from train_metrics_from_step on: the first step, unless a resume added a
    sum), what each source of a mixture gave the run (since its sources or weights last changed in a resume), the
    changes resumes allowed, how long it took, the step of the exported weights and, with --metric_for_best_model, the
    best checkpoint; `setup` is the run's TrainingSetup, `log` its TrainingLog."""
    if jax.process_index() != 0:
        return
    summary = progress.summary()
    results = {f"train_{name}": value for name, value in train_metrics(summary.sums).items()}
    train_rows = setup.train_rows
    if isinstance(train_rows, Mixture):
        changes = [change["step"] for change in progress.resume_changes if change["name"] in MIXTURE_CHANGES]
        mixture_from_step = max(changes, default=0)
        batch = setup.train_batch_size
        contributions = train_rows.contributions(setup.total_steps * batch, mixture_from_step * batch)
        results.update({f"train_{name}": value for name, value in contributions.items()})
        if mixture_from_step:
            results["train_mixture_from_step"] = mixture_from_step
    results.update(
        train_metrics_from_step=summary.from_step,
        train_samples=None if train_rows is None else len(train_rows),
        train_steps=setup.total_steps,
        epochs=setup.total_steps / setup.steps_per_epoch if setup.steps_per_epoch else None,
        resume_changes=progress.resume_changes,
        exported_step=exported_step,
    )
    # Over the whole run: every segment, this one to its end (its last save may have come before).
    progress.segment_done(log.first_step, progress.step, log.runtime, log.tokens)
    runtime = sum(segment["runtime_seconds"] for segment in progress.segments)
    results.update(
        train_runtime_seconds=runtime,
        train_tokens_per_second=sum(segment["tokens"] for segment in progress.segments) / runtime,
        # Checkpoints saved before segments were recorded leave the earlier ones out: the totals start here.
        train_runtime_from_step=progress.segments[0]["from_step"],
        train_segments=progress.segments,
    )
    if progress.best_model:
        results.update(progress.best_model.results(output_dir))
    write_json(os.path.join(output_dir, "train_results.json"), results)


# What a resume may change of a mixture: its sources' rows or its weights (flax_lm.run.record).
MIXTURE_CHANGES = ("training_data", "mixture_weights")
