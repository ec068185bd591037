"""Training checkpoints with Orbax: the state (flax_lm.training.train_state's TrainState, a PyTreeNode with its
params) and a progress record saved in the background, the newest readable one restored (into any mesh), and a stop
on SIGINT or SIGTERM that saves first."""

import logging
import os
import shutil
import signal
import sys
import traceback

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.struct import PyTreeNode
from jax.experimental import multihost_utils

from flax_lm.errors import UsageError, first_line
from flax_lm.run.best_model import KeepStep
from flax_lm.run.checksums import (
    CHECKPOINT_CHECKSUMS,
    SAVED_WITH_CHECKSUMS,
    checkpoint_checksum_problem,
    checkpoint_has_checksums,
    write_checkpoint_checksums,
)
from flax_lm.run.run_files import record_run_files

logger = logging.getLogger(__name__)


def open_checkpoints(output_dir: str, save_total_limit: int, best_model=None) -> ocp.CheckpointManager:
    """OUTPUT_DIR/checkpoints/STEP. Orbax writes each checkpoint into a temporary directory and renames it once
    complete; an unfinished one is deleted when the directory is next opened. Every process writes its own shards
    into the same directory, so on several hosts OUTPUT_DIR must be on a file system they share (NFS, a bucket).

    Each checkpoint holds the checksums of its files (flax_lm.run.checksums), which restore_checkpoint compares. Orbax
    keeps none of the arrays' bytes (its zarr format checks only a shard's index), so they are taken here: once
    every process's files are written and before the temporary directory is renamed into place, on process 0's
    thread that finishes the checkpoint in the background, so that a committed checkpoint always has them.

    The newest `save_total_limit` checkpoints are kept, and with `best_model` (a BestModel) the best one's as well."""
    directory = os.path.abspath(os.path.join(output_dir, "checkpoints"))
    if jax.process_index() == 0 and not os.path.isdir(directory):
        record_run_files(output_dir, ["checkpoints/"])

    def write_checksums_before_commit():
        for entry in os.scandir(directory):
            if ocp.step.is_tmp_checkpoint(entry.path):  # the checkpoint being finished: one at a time
                write_checkpoint_checksums(entry.path)

    keep = [ocp.checkpoint_managers.LatestN(save_total_limit)]
    if best_model is not None:
        keep.append(KeepStep(lambda: best_model.step))
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep),
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=write_checksums_before_commit),
        ),
    )


def save_checkpoint(checkpoints: ocp.CheckpointManager, state: PyTreeNode, progress_record: dict):
    """Returns once the arrays are copied off the devices; the files are written while training goes on. Refused in
    one line, with nothing written, where the disk has no room for the checkpoint and the model's export after it."""
    step = progress_record["step"]
    check_room_to_save(checkpoints, state, step)
    # Said in the record, so that a checkpoint whose checksums were removed is not taken for an unchecked one.
    progress_record = {**progress_record, SAVED_WITH_CHECKSUMS: CHECKPOINT_CHECKSUMS}
    started = checkpoints.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress_record))
    )
    if not started:  # Orbax skips a step at or before its newest checkpoint
        raise UsageError(
            f"cannot save training checkpoint {step}: {checkpoints.directory} already holds checkpoint "
            f"{checkpoints.latest_step()}; pass --overwrite_output_dir to start afresh"
        )
    if jax.process_index() == 0:  # recorded before the background commit puts the checkpoint in place
        record_run_files(os.path.dirname(str(checkpoints.directory)), [f"checkpoints/{step}"])


def check_room_to_save(checkpoints: ocp.CheckpointManager, state: PyTreeNode, step: int):
    """Refuse to save where the disk of the checkpoints (OUTPUT_DIR/checkpoints, or where a link of that name leads)
    or of the export (OUTPUT_DIR) has less room than they take: the state's bytes (Orbax compresses little of
    them), and the parameters' for the export. Written into a disk that fills, the checkpoint would fail in its
    background threads, with a traceback from each."""
    output_dir = os.path.dirname(str(checkpoints.directory))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))
    params_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state.params))
    by_disk = {}  # what is written to each disk: one of its directories, and the bytes
    for directory, size in ((str(checkpoints.directory), state_bytes), (output_dir, params_bytes)):
        disk = os.stat(directory).st_dev
        first_directory, total = by_disk.get(disk, (directory, 0))
        by_disk[disk] = (first_directory, total + size)
    short = [(directory, shutil.disk_usage(directory).free, size) for directory, size in by_disk.values()]
    short = [(directory, free, size) for directory, free, size in short if free < size]
    # Every process stops, or none: a save waits for all of them.
    anyone_short = bool(short)
    if jax.process_count() > 1:
        anyone_short = bool(np.any(multihost_utils.process_allgather(np.asarray(anyone_short))))
    advice = "nothing of them was written: free some space there, then continue with --resume_from_checkpoint"
    if short:
        directory, free, size = short[0]
        raise UsageError(
            f"the disk of {directory} has {free / 1e6:.1f} MB free, less than the {size / 1e6:.1f} MB that the "
            f"training checkpoint and model of step {step} take; {advice}"
        )
    if anyone_short:
        raise UsageError(
            f"another process found no room for the training checkpoint and model of step {step}; {advice}"
        )


def log_when_committed(checkpoints: ocp.CheckpointManager, step: int | None) -> int | None:
    """Log that the checkpoint of `step` is complete on disk (a kill after the message loses nothing before it), if
    it is by now. Returns the step still being written, None once none is. Orbax has no hook for this: its
    post_finalization_callback runs before the checkpoint is renamed into place."""
    if step is None or checkpoints.is_saving_in_progress():
        return step
    path = os.path.join(str(checkpoints.directory), str(step))
    if os.path.isdir(path):
        logger.info("step %d: training checkpoint committed to %s", step, path)
    else:
        logger.warning("step %d: the training checkpoint could not be written to %s", step, path)
    return None


def wait_until_committed(checkpoints: ocp.CheckpointManager, step: int | None):
    """Wait for the checkpoint being written in the background, and log it committed (log_when_committed)."""
    checkpoints.wait_until_finished()
    log_when_committed(checkpoints, step)


class DamagedCheckpoint(Exception):
    """A checkpoint whose files differ from the checksums taken when it was saved."""


# The row length each training script records in its checkpoints, with what the script trains: a checkpoint that
# records the other script's was saved by that script (or a copy of it).
ROW_LENGTH_KEYS = {"block_size": ("causal", "run_clm_flax.py"), "max_seq_length": ("masked", "run_mlm_flax.py")}


def last_intact_checkpoint(checkpoints: ocp.CheckpointManager) -> str | None:
    """The newest complete checkpoint whose files still match their checksums (or that has none), for a message
    naming the one to go back to; None where there is none. Waits for the one being written: it may be that one."""
    checkpoints.wait_until_finished()
    for step in sorted(checkpoints.all_steps(), reverse=True):
        path = os.path.join(str(checkpoints.directory), str(step))
        if os.path.isdir(path) and checkpoint_checksum_problem(path) is None:
            return path
    return None


def restore_checkpoint(
    location: str, output_dir: str, abstract_state: PyTreeNode, progress_keys: list[str], check_progress=None
) -> tuple[PyTreeNode, dict, str] | None:
    """The training state (placed with the shardings of `abstract_state`), the progress record (which must hold
    `progress_keys`) and the path of the checkpoint at `location`: "auto" (the newest complete and readable one in
    output_dir; None where there is no complete one, for a fresh start), a checkpoints directory, or one STEP in it.
    An unreadable checkpoint is skipped with a warning for the next older one, except the one STEP asked for; where
    none can be read, or the checkpoint is of another model, the run is refused and the checkpoints stay as they are:
    a fresh start would set them aside, and with them the run. `check_progress(progress_record)` may refuse a
    checkpoint by what its record says (UsageError), before its arrays are compared with this run's."""
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
        silence_reads_left_to_a_closed_loop()  # before a read can fail: the reads it leaves may end at once
        for candidate in steps:
            path = os.path.join(directory, str(candidate))
            try:
                # Process 0 compares the checksums for all: every process reading the whole checkpoint again would
                # multiply the reads of a shared file system by the process count.
                if jax.process_index() == 0 and (problem := checkpoint_checksum_problem(path)):
                    raise DamagedCheckpoint(problem)
                progress_args = ocp.args.Composite(progress=ocp.args.JsonRestore())
                progress = manager.restore(candidate, args=progress_args).progress
                check_progress_record(path, progress, progress_keys, candidate)
                if check_progress is not None:
                    check_progress(progress)
                check_checkpoint_fits(path, manager.item_metadata(candidate)["state"], abstract_state)
                # The shapes fit: what fails from here on is the files, not the model.
                args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
                restored, reason = (manager.restore(candidate, args=args).state, progress, path), None
            except UsageError:
                raise
            except DamagedCheckpoint as error:
                restored, reason = None, f"damaged ({error})"
            except Exception as error:  # noqa: BLE001 - Orbax and TensorStore raise many kinds for damaged files
                restored, reason = None, f"unreadable ({first_line(error)})"
            # Every process takes the same checkpoint, even where only some could not read theirs.
            if jax.process_count() > 1:
                if not np.all(multihost_utils.process_allgather(np.asarray(restored is not None))):
                    restored, reason = None, reason or "unreadable (another process could not read it)"
            if restored:
                if not checkpoint_has_checksums(path):
                    logger.warning(
                        "The training checkpoint %s has no checksums (it was saved by an earlier version), so its "
                        "bytes were not checked",
                        path,
                    )
                return restored
            if not newest:
                raise UsageError(
                    f"the training checkpoint {path} is {reason}; resume from an earlier one, or pass "
                    "--resume_from_checkpoint alone for the newest readable one"
                )
            logger.warning("skipping the training checkpoint %s: it is %s", path, reason)
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


def silence_reads_left_to_a_closed_loop():
    """Orbax runs a restore's reads as tasks of an event loop of its own, which it closes as soon as one read fails
    (orbax.checkpoint's asyncio_utils, run_sync), with the reads of the other arrays still under way in TensorStore's
    threads: each hands its result to the closed loop when it ends, and Python prints `RuntimeError: Event loop is
    closed` for it, an exception ignored in that thread, a traceback for each array of the checkpoint after the line
    that says it is skipped or refused (seen in the tests' process, where a damaged checkpoint's reads outlive the
    loop). Nothing of ours holds those reads, and they harm nothing: from the first restore on, that exception is not
    printed; any other is, as before."""
    printing = sys.unraisablehook
    if getattr(printing, "silences_reads_left_to_a_closed_loop", False):
        return

    def unraisable_hook(unraisable):
        frames = traceback.extract_tb(unraisable.exc_traceback)
        left_to_a_closed_loop = isinstance(unraisable.exc_value, RuntimeError) and any(
            frame.name == "call_soon_threadsafe" for frame in frames
        )
        if not (left_to_a_closed_loop and str(unraisable.exc_value) == "Event loop is closed"):
            printing(unraisable)

    unraisable_hook.silences_reads_left_to_a_closed_loop = True
    sys.unraisablehook = unraisable_hook


def check_progress_record(path: str, progress, progress_keys: list[str], step: int):
    """Refuse, in one line, the checkpoint of the other training script (a ValueError, which skips the checkpoint as
    unreadable, for a record that is damaged)."""
    if not isinstance(progress, dict):
        raise ValueError("its progress record is not a mapping")
    ours = [key for key in progress_keys if key in ROW_LENGTH_KEYS]
    theirs = [key for key in ROW_LENGTH_KEYS if key in progress and key not in progress_keys]
    if ours and theirs and ours[0] not in progress:
        (our_kind, _), (their_kind, their_script) = ROW_LENGTH_KEYS[ours[0]], ROW_LENGTH_KEYS[theirs[0]]
        raise UsageError(
            f"the training checkpoint {path} is of a {their_kind} language model, saved by {their_script} or a copy "
            f"of it, not of this script's {our_kind} one: resume it with the script that saved it, or train into "
            "another --output_dir"
        )
    if any(key not in progress for key in progress_keys):
        raise ValueError("its progress record lacks one of " + ", ".join(progress_keys))
    if progress["step"] != step:
        raise ValueError(f"its progress record is of step {progress['step']}")


def check_checkpoint_fits(path: str, stored_metadata, abstract_state: PyTreeNode):
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
        if is_parameter or name in stored and name in needed:
            found = f"has shape {stored.get(name)} there, {needed.get(name)} here"
        else:  # a frozen parameter has no optimizer state (the script's is_trained)
            found = "is there but not here" if name in stored else "is not there but here"
            fix += " and the is_trained (the parameters it freezes)"
        raise UsageError(
            f"the checkpoint {path} does not fit this model ({what} {name} {found}); resume with the {fix} it was "
            "trained with"
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
