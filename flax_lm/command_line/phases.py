"""The phases of a training script's main() that are the same for every experiment, given the script's arguments
(here in command_line/, where the settings each part receives are filled from them): from the set-up to the run on
disk (the state it starts from, the output directory held, the trackers), and from the end of the loop to the
results (the weights the run ends with, train_results.json, the final evaluation, all_results.json). The script keeps
what it changes: its data, model, steps, evaluation and the loop `train`, which main() calls between the two."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flax_lm.command_line.arguments import recorded_arguments
from flax_lm.devices.processes import print_once
from flax_lm.run.output_dir import open_output_dir, report_stop
from flax_lm.run.record import TrainingProgress
from flax_lm.run.tracking import TrainingLog, open_trackers
from flax_lm.training.lifecycle import (
    RunSettings,
    TrainingSetup,
    export_complete_run,
    final_weights,
    finish_run,
    initial_state,
    run_description,
    save_run,
    write_train_results,
)
from flax_lm.training.train_state import TrainState


def packs_only(training_args, packed_data_dir: str | None) -> bool:
    """Whether the run only packs its data (--packed_data_dir without --do_train or --do_eval): then it is done."""
    if training_args.do_train or training_args.do_eval:
        return False
    print_once(f"packed data: {packed_data_dir}")
    return True


@dataclass
class TrainingRun:
    """A run on disk, from the state it starts from to its results: what main() hands the loop (the progress, the
    save, the log) and what it needs at the end."""

    setup: TrainingSetup
    config: Any
    tokenizer: Any
    settings: RunSettings
    description: dict  # run_description's: what each checkpoint records of the run
    progress: TrainingProgress
    trackers: Any
    log: TrainingLog
    trains_now: bool  # steps are left to train: with --do_train, and the run not complete already
    # The lock on the output directory, held by process 0 for all processes while the run is kept.
    output_dir_lock: Any
    stopped_by: str | None = None  # the signal that stopped the loop; None where it ran to the end

    def save(self, checkpoints, state, progress) -> int:
        """What the loop calls at each save: a checkpoint and the exported model (save_run). Returns the step."""
        return save_run(self.setup, self.config, self.tokenizer, self.description, checkpoints, state, progress)

    def finish(self, state, evaluation, show_export: Callable):
        """After the loop (or instead of it): where a signal stopped it (stopped_by), say how to continue; otherwise
        the export of a complete run that lacks it, the weights the run ends with (final_weights), train_results.json
        after training, the final evaluation and all_results.json (finish_run), and `show_export` after training."""
        settings, setup = self.settings, self.setup
        output_dir = settings.output.output_dir
        if self.stopped_by:
            report_stop(self.stopped_by, self.progress.step, output_dir, self.trackers)
            return
        if settings.output.do_train and not self.trains_now:
            export_complete_run(settings, state.params, self.config, self.tokenizer, setup)
        params, step = final_weights(settings, setup, evaluation, state, self.progress, self.config, self.tokenizer)
        if self.trains_now:
            write_train_results(output_dir, self.log.train_metrics, self.progress, setup, self.log, step)
        finish_run(settings, evaluation, self.trackers, params, step, self.trains_now, show_export)


def start_training(
    setup: TrainingSetup,
    argument_groups: tuple,
    config,
    tokenizer,
    train_metrics,
    eval_metrics: tuple,
    script_file: str,
) -> tuple[TrainState, TrainingRun]:
    """The state the run starts from (initial_state: new weights, a model's, or a resumed checkpoint's) and the
    TrainingRun around it: the output directory prepared and held, the script and `model_args.model_file` kept in it,
    the trackers opened. `argument_groups`: the script's (model, data, training) arguments; `train_metrics(sums)`:
    the script's metrics of a log line; `eval_metrics`: what the evaluation reports (TensorBoard's HParams tab
    compares runs by them); `script_file`: the script that runs, kept in the output directory."""
    model_args, _, training_args = argument_groups
    arguments, settings = recorded_arguments(*argument_groups), training_args.run_settings()
    description = run_description(arguments, config, tokenizer, setup)
    state, progress = initial_state(settings, setup, description, model_args.pretrained_weights())
    output_dir_lock = open_output_dir(settings.output, progress.step, [script_file, model_args.model_file])
    metric_tags = [f"eval/{name}" for name in eval_metrics]
    trackers = open_trackers(training_args.tracker_settings(), progress, arguments, config, metric_tags)
    log = TrainingLog(trackers, progress, setup.total_steps, train_metrics, training_args.skip_nonfinite_steps)
    trains_now = training_args.do_train and progress.step < setup.total_steps
    training_run = TrainingRun(
        setup, config, tokenizer, settings, description, progress, trackers, log, trains_now, output_dir_lock
    )
    return state, training_run
