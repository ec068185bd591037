"""Training checkpoints with Orbax: the state and a progress record saved in the background, the newest readable
one restored (into any mesh), and a stop on SIGINT or SIGTERM that saves first."""

import logging
import math
import os
import signal
from dataclasses import dataclass

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from flax_lm.errors import UsageError
from flax_lm.train_state import TrainState

logger = logging.getLogger(__name__)


def open_checkpoints(output_dir: str, save_total_limit: int) -> ocp.CheckpointManager:
    """OUTPUT_DIR/checkpoints/STEP. Orbax writes each checkpoint into a temporary directory and renames it once
    complete; an unfinished one is deleted when the directory is next opened. Every process writes its own shards
    into the same directory, so on several hosts OUTPUT_DIR must be on a file system they share (NFS, a bucket)."""
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(output_dir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=save_total_limit, cleanup_tmp_directories=True),
    )


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


def restore_checkpoint(
    location: str, output_dir: str, abstract_state: TrainState, progress_keys: list[str]
) -> tuple[TrainState, dict, str] | None:
    """The training state (placed with the shardings of `abstract_state`), the progress record (which must hold
    `progress_keys`) and the path of the checkpoint at `location`: "auto" (the newest complete and readable one in
    output_dir; None where there is no complete one, for a fresh start), a checkpoints directory, or one STEP in it.
    An unreadable checkpoint is skipped with a warning for the next older one, except the one STEP asked for; where
    none can be read, or the checkpoint is of another model, the run is refused and the checkpoints stay as they are:
    a fresh start would set them aside, and with them the run."""
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
        unreadable = []
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
            unreadable.append((candidate, reason))
    if newest and unreadable:
        # Every process skipped the same checkpoints, so every one stops here.
        (newest_step, newest_reason), *_ = unreadable
        skipped_steps = ", ".join(str(skipped) for skipped, _ in unreadable)
        raise UsageError(
            f"--resume_from_checkpoint: every training checkpoint in {directory} is unreadable (steps "
            f"{skipped_steps}; step {newest_step}: {newest_reason}); they are left as they are: restore them from a "
            "copy to resume, or pass --overwrite_output_dir without --resume_from_checkpoint to start a new run"
        )
    if newest:
        return None
    raise UsageError(f"--resume_from_checkpoint: there is no readable training checkpoint in {directory}")


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


@dataclass
class TrainingProgress:
    """How far training has come: the step, and the sums of the train step's metrics (the script's TRAIN_METRIC_SUMS)
    over every finite step so far. Every training checkpoint records it (as "step" and "train_NAME"), so a resumed run
    carries on from it."""

    metric_sums: dict[str, float]
    step: int = 0

    @classmethod
    def start(cls, metric_names) -> "TrainingProgress":
        return cls(dict.fromkeys(metric_names, 0.0))

    def add(self, step_metrics: list[dict]):
        for metrics in step_metrics:
            for name in self.metric_sums:
                self.metric_sums[name] += float(metrics[name])

    def record(self, **details) -> dict:
        return {"step": self.step, **{f"train_{name}": value for name, value in self.metric_sums.items()}, **details}

    @classmethod
    def from_record(cls, record: dict, metric_names) -> "TrainingProgress":
        """The progress a checkpoint recorded, for a script that sums `metric_names`: a sum the record lacks (a metric
        added to the script since) starts at 0, one the script no longer makes is left out; both with a warning."""
        missing = [name for name in metric_names if f"train_{name}" not in record]
        if missing:
            logger.warning(
                "The checkpoint records no training sum of %s: counted from step %d on, so its average in "
                "train_results.json covers only the steps after this resume",
                ", ".join(missing),
                record["step"],
            )
        recorded = [key[len("train_") :] for key in record if key.startswith("train_")]
        if dropped := [name for name in recorded if name not in metric_names]:
            logger.warning("The checkpoint's training sums of %s are no longer summed; left out", ", ".join(dropped))
        return cls({name: float(record.get(f"train_{name}", 0.0)) for name in metric_names}, record["step"])


def check_resumed_run(record: dict, setup, training_args, length_name: str):
    """Warn where the resumed run's batches or training data differ from the checkpoint's (the data order then does
    too), or its learning rate at the checkpoint's step; refuse a checkpoint beyond this run's last step. `setup` is
    the script's TrainingSetup; `length_name` names the sequence length in the record (block_size, max_seq_length)."""
    if training_args.overwrite_output_dir:
        logger.warning("--overwrite_output_dir is ignored: --resume_from_checkpoint continues the run in it")
    if (record["global_batch_size"], record[length_name]) != (setup.train_batch_size, setup.sequence_length):
        logger.warning(
            "The checkpoint was trained with global batches of %d x %d tokens, this run uses %d x %d: the data "
            "order differs from the interrupted run's",
            record["global_batch_size"],
            record[length_name],
            setup.train_batch_size,
            setup.sequence_length,
        )
    training_examples = None if setup.train_examples is None else len(setup.train_examples)
    # A checkpoint written before the count was recorded has nothing to compare it with.
    if record.get("training_examples", training_examples) != training_examples:
        logger.warning(
            "The checkpoint was trained on %s, this run on %s: the training data changed, so the data order differs "
            "from the interrupted run's",
            describe_training_examples(record["training_examples"]),
            describe_training_examples(training_examples),
        )
    if not training_args.do_train:
        return
    # A checkpoint of warmup_stable_decay's stable phase resumed with another --max_steps trains on at the peak, with
    # the decay at the end of the new run: the steps before it are those the new run would have trained. Elsewhere,
    # another --max_steps changes the rate of the step resumed. A checkpoint that records no rate is not compared.
    resumed_rate, scheduled_rate = record.get("learning_rate"), float(setup.learning_rate_schedule(record["step"] - 1))
    if resumed_rate is not None and not math.isclose(resumed_rate, scheduled_rate, rel_tol=1e-5):
        logger.warning(
            "The checkpoint's step %d trained at learning rate %.6g, this run's schedule has %.6g there: the learning "
            "rate jumps at the resume (another --learning_rate or schedule, or another --max_steps outside the stable "
            "phase of warmup_stable_decay)",
            record["step"],
            resumed_rate,
            scheduled_rate,
        )
    if record["step"] > setup.total_steps:
        raise UsageError(
            f"the checkpoint is at step {record['step']}, after this run's last step {setup.total_steps}; "
            "raise --max_steps or --num_train_epochs to train further"
        )
    if record["step"] == setup.total_steps:
        logger.info("The run is complete (step %d of %d): nothing left to train", record["step"], setup.total_steps)


def describe_training_examples(count: int | None) -> str:
    return "a stream" if count is None else f"{count} training examples"
