"""The output directory of a run: one run at a time (a lock), no silent mixing with an earlier run's files, the
results files, and a copy of the script that ran."""

import filecmp
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import socket

import jax
import orbax.checkpoint as ocp
from filelock import FileLock, Timeout

from flax_lm.data.mixture import Mixture
from flax_lm.devices.processes import on_process_zero, print_once
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)


OUTPUT_DIR_LOCK = ".lock"


def holder(lock_path: str) -> str:
    """Who holds the lock, as its holder wrote into the lock file."""
    try:
        with open(lock_path) as lock_file:
            return lock_file.read().strip() or "another process"
    except OSError:
        return "another process"


def take_lock(lock_path: str, output_dir: str, on_acquired=None) -> FileLock | None:
    """The lock at lock_path, taken without waiting; refuses in one line where another run holds it. None where the
    file system has no locks (then nothing stops a second run: the user is told)."""
    # No soft-lock fallback: a soft lock outlives a killed run, and a killed run must never leave the directory locked.
    lock = FileLock(lock_path, fallback_to_soft=False, on_acquired=on_acquired)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        raise UsageError(
            f"--output_dir {output_dir} is in use by another run ({holder(lock_path)}); wait for it to end or pass "
            "another --output_dir"
        ) from None
    except OSError as error:
        logger.warning(
            "cannot lock --output_dir %s (%s): make sure no other run writes into it", output_dir, error.strerror
        )
        return None
    return lock


def write_holder(lock_fd: int):
    """Name this process in the lock file, for the message of a run that finds the directory in use."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)


def lock_output_dir(output_dir: str) -> FileLock | None:
    """Hold OUTPUT_DIR/.lock, so that one run at a time writes into it, until the returned lock is released or the
    process ends: however it ends, the kernel releases the lock (flock), so a killed run never leaves the directory
    locked."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, OUTPUT_DIR_LOCK), "a"):
            pass
    except OSError as error:
        raise UsageError(
            f"cannot write into --output_dir {output_dir} ({error.strerror}); pass a writable directory"
        ) from None
    return take_lock(os.path.join(output_dir, OUTPUT_DIR_LOCK), output_dir, on_acquired=write_holder)


def refuse_earlier_run(training_args):
    """Training into an earlier run's files needs --resume_from_checkpoint or --overwrite_output_dir. The lock and
    unfinished checkpoints, which the next run deletes anyway, are not such files (a run killed before its first
    checkpoint leaves nothing else of worth)."""
    output_dir = training_args.output_dir
    if not training_args.do_train or training_args.overwrite_output_dir or training_args.resume_from_checkpoint:
        return
    checkpoints = os.path.join(output_dir, "checkpoints")
    entries = set(os.listdir(output_dir)) if os.path.isdir(output_dir) else set()
    if os.path.isdir(checkpoints) and all(
        ocp.step.is_tmp_checkpoint(os.path.join(checkpoints, name)) for name in os.listdir(checkpoints)
    ):
        entries.discard("checkpoints")
    if entries - {OUTPUT_DIR_LOCK}:
        raise UsageError(
            f"--output_dir {output_dir} already holds files; pass --resume_from_checkpoint to continue its run, or "
            "--overwrite_output_dir to start a new run in it"
        )


def check_output_dir(training_args):
    """Before any work, and writing nothing: refuse an output directory that another run holds (its lock is probed), or
    one with an earlier run's files that these flags do not allow training into."""
    lock_path = os.path.join(training_args.output_dir, OUTPUT_DIR_LOCK)
    if os.path.isfile(lock_path):
        probe = take_lock(lock_path, training_args.output_dir)  # taken and let go at once
        if probe is not None:
            probe.release()
    refuse_earlier_run(training_args)


# Where a run keeps the ids of its W&B and MLflow runs, to report into them again when it is resumed.
TRACKER_RUNS_FILE = "tracker_runs.json"


# Where a run keeps the versions of its code that trained it (keep_code_versions).
CODE_VERSIONS_DIR = "code"


PREVIOUS_RUN_RESULTS = [
    "checkpoints",
    "discarded-checkpoints",
    "tensorboard",
    CODE_VERSIONS_DIR,
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    TRACKER_RUNS_FILE,
]


# How a run names what it writes into each directory of PREVIOUS_RUN_RESULTS: the directory may hold files of the
# user's too (where it is a link to another disk, say), and only these are the run's to remove.
RUN_ENTRY_NAMES = {
    "checkpoints": re.compile(r"\d+(\.orbax-checkpoint-tmp.*)?"),
    "discarded-checkpoints": re.compile(r"\d+(-\d+)?"),
    "tensorboard": re.compile(r"events\.out\.tfevents\..*"),
    CODE_VERSIONS_DIR: re.compile(r"[0-9a-f]{12}|versions\.json"),
}


# The training scripts, each of which copies itself into its output directory: a copy of the other one there is an
# earlier run's, and would say that it made the model.
TRAINING_SCRIPTS = ("run_clm_flax.py", "run_mlm_flax.py")


def clear_run_directory(directory: str, name: str) -> list[str]:
    """Remove what runs wrote into OUTPUT_DIR/`name` (`directory`, or where a link of that name leads; the link
    stays: the user made it). The directory goes too where nothing else is left in it; the names of the files of the
    user's kept there are returned."""
    target = os.path.realpath(directory)
    for entry in os.listdir(target):
        if RUN_ENTRY_NAMES[name].fullmatch(entry):
            path = os.path.join(target, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    kept = sorted(os.listdir(target))
    if not kept and not os.path.islink(directory):
        os.rmdir(directory)
    return kept


def clear_previous_run(output_dir: str, script: str):
    """For --overwrite_output_dir: remove what an earlier run left that would mix with this run's (checkpoints,
    TensorBoard logs, results, the other training script's copy). The model files stay, to be overwritten: they may be
    this run's config or tokenizer. Files of the user's in the run's directories stay."""
    removed, kept = [], []
    for name in PREVIOUS_RUN_RESULTS:
        path = os.path.join(output_dir, name)
        if name in RUN_ENTRY_NAMES and os.path.isdir(path):
            kept += [os.path.join(name, entry) for entry in clear_run_directory(path, name)]
            where = f" (in {os.path.realpath(path)}, where the link leads)" if os.path.islink(path) else ""
            removed.append(f"{name}/{where}")
        elif os.path.exists(path):
            os.remove(path)
            removed.append(name)
    for name in TRAINING_SCRIPTS:
        if name != os.path.basename(script) and os.path.isfile(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
            removed.append(name)
    if removed:
        logger.warning("--overwrite_output_dir: removed the previous run's %s from %s", ", ".join(removed), output_dir)
    if kept:
        logger.warning("--overwrite_output_dir: kept %s, which no run wrote", ", ".join(kept))


def set_aside_checkpoints_after(output_dir: str, step: int):
    """Move the training checkpoints after `step` (unreadable ones, or those of a later point the run resumes
    before) to OUTPUT_DIR/discarded-checkpoints, so that this run's saves at those steps are not refused."""
    directory = os.path.join(output_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    later = sorted(int(name) for name in names if name.isdigit() and int(name) > step)
    if not later:
        return
    discarded = os.path.join(output_dir, "discarded-checkpoints")
    os.makedirs(discarded, exist_ok=True)
    for later_step in later:
        target = os.path.join(discarded, str(later_step))
        copies = itertools.count(2)
        while os.path.exists(target):
            target = os.path.join(discarded, f"{later_step}-{next(copies)}")
        # Copied, then removed, where checkpoints/ is a link to another disk, which a rename cannot cross.
        shutil.move(os.path.join(directory, str(later_step)), target)
    logger.warning("moved the training checkpoints of steps %s to %s", ", ".join(map(str, later)), discarded)


def prepare_output_dir(training_args, resumed_step: int, code_files: list[str | None]):
    """Lock the output directory for this run (the lock is returned: it lasts as long as the object), clear or set
    aside what an earlier run left that this one would mix with its own, and copy the `code_files` that run (the
    script, a model file of the experiment's own; None for none) into it, so that the directory says which code made
    it."""
    lock = lock_output_dir(training_args.output_dir)
    refuse_earlier_run(training_args)  # again: another run may have ended in it since the check
    if training_args.do_train:
        if training_args.overwrite_output_dir and not resumed_step:
            clear_previous_run(training_args.output_dir, code_files[0])
        set_aside_checkpoints_after(training_args.output_dir, resumed_step)
    os.makedirs(training_args.output_dir, exist_ok=True)
    code_files = [path for path in code_files if path]
    keep_code_versions(training_args.output_dir, code_files, resumed_step, branched_from(training_args))
    return lock


def branched_from(training_args) -> str | None:
    """The output directory of another run whose checkpoint --resume_from_checkpoint names (a run branched into a new
    --output_dir); None for a resume in the run's own directory, or none."""
    location = training_args.resume_from_checkpoint
    if not location or location == "auto":
        return None
    path = os.path.normpath(location)
    run_dir = os.path.dirname(os.path.dirname(path) if os.path.basename(path).isdigit() else path)
    return None if os.path.realpath(run_dir) == os.path.realpath(training_args.output_dir) else run_dir


def file_hash(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()[:12]


def keep_code_versions(output_dir: str, code_files: list[str], first_step: int, earlier_run: str | None = None):
    """Copy the `code_files` that run now (the script, a model file of the experiment's own) into OUTPUT_DIR, and keep
    every version of them that trained the run: where they differ from the version before (a resume with the script
    edited, said in the log), each file is kept as OUTPUT_DIR/code/HASH/NAME and code/versions.json lists, for each
    version, its files' hashes and the step it trained from (the steps after it, up to the next version's). A run
    branched from the checkpoint of `earlier_run` (another output directory) starts with the versions that trained
    that run up to `first_step`."""
    versions_path = os.path.join(output_dir, CODE_VERSIONS_DIR, "versions.json")
    recorded = read_code_versions(output_dir)
    versions = list(recorded)
    if not versions and first_step:
        versions = earlier_code_versions(earlier_run or output_dir, code_files, first_step, output_dir)
        if earlier_run and versions:
            logger.info(
                "Branched at step %d from the run in %s: its code versions are kept in %s",
                first_step,
                earlier_run,
                versions_path,
            )
    current = code_version(output_dir, code_files, first_step)
    if versions and versions[-1]["files"] != current["files"]:
        logger.warning(
            "Resumed at step %d with other code than the checkpoint's: %s (from step %d), now %s; every version is "
            "kept in %s",
            first_step,
            describe_files(versions[-1]["files"]),
            versions[-1]["from_step"],
            describe_files(current["files"]),
            versions_path,
        )
    if not versions or versions[-1]["files"] != current["files"]:
        versions.append(current)
    if versions != recorded:
        write_json(versions_path, versions)
    for code_file in code_files:
        copy = os.path.join(output_dir, os.path.basename(code_file))
        if not (os.path.isfile(copy) and filecmp.cmp(code_file, copy, shallow=False)):  # a repeat leaves it as it was
            shutil.copyfile(code_file, copy)


def describe_files(files: dict) -> str:
    return ", ".join(f"{name} {digest}" for name, digest in files.items())


def read_code_versions(run_dir: str) -> list:
    try:
        with open(os.path.join(run_dir, CODE_VERSIONS_DIR, "versions.json")) as file:
            return json.load(file)
    except (OSError, ValueError):
        return []


def earlier_code_versions(run_dir: str, code_files: list[str], first_step: int, output_dir: str) -> list:
    """The versions of the code that trained the steps up to `first_step` of the run in `run_dir`, kept in OUTPUT_DIR
    too: its code/versions.json, or for a run of before the versions were kept, its copies of the code files (the
    version that trained its first steps)."""
    versions = [version for version in read_code_versions(run_dir) if version["from_step"] < first_step]
    if not versions:
        earlier = [os.path.join(run_dir, os.path.basename(path)) for path in code_files]
        earlier_files = [path for path in earlier if os.path.isfile(path)]
        return [code_version(output_dir, earlier_files, 0)] if earlier_files else []
    for version in versions:
        for name, digest in version["files"].items():
            kept = os.path.join(run_dir, CODE_VERSIONS_DIR, digest, name)
            target = os.path.join(output_dir, CODE_VERSIONS_DIR, digest, name)
            if os.path.isfile(kept) and not os.path.isfile(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(kept, target)
    return versions


def code_version(output_dir: str, code_files: list[str], first_step: int) -> dict:
    """{"from_step": first_step, "files": {name: hash}}, each file kept as OUTPUT_DIR/code/HASH/NAME."""
    files = {}
    for path in code_files:
        name, digest = os.path.basename(path), file_hash(path)
        kept = os.path.join(output_dir, CODE_VERSIONS_DIR, digest, name)
        if not os.path.isfile(kept):
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            shutil.copyfile(path, kept)
        files[name] = digest
    return {"from_step": first_step, "files": files}


def open_output_dir(training_args, resumed_step: int, code_files: list[str | None]):
    """prepare_output_dir, by process 0 for every process: the lock it returns (None on the other processes) must be
    kept, as process 0 holds the directory as long as it keeps it."""
    return on_process_zero(
        lambda: prepare_output_dir(training_args, resumed_step, code_files),
        f"lock --output_dir {training_args.output_dir}",
    )


# all_results.json names a result as the Hugging Face examples do where it means the same.
HUGGING_FACE_RESULT_NAMES = {
    "train_runtime_seconds": "train_runtime",
    "epochs": "epoch",
    "eval_perplexity": "perplexity",
}


def write_all_results(output_dir: str) -> dict:
    """Merge OUTPUT_DIR/train_results.json and eval_results.json (those there are) into all_results.json, as the
    Hugging Face examples do; returns the merged results. An evaluation of another step than the training's (a run
    resumed without --do_eval keeps the earlier one) is left out, so that it never reads as the model's."""

    def read(name: str) -> dict:
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            return {}
        with open(path) as file:
            return json.load(file)

    train_results, eval_results = read("train_results.json"), read("eval_results.json")
    if train_results and eval_results and eval_results.get("step") != train_results["train_steps"]:
        logger.warning(
            "eval_results.json holds the evaluation of step %s, not of the trained model's step %d, so "
            "all_results.json leaves it out; resume with --do_eval to evaluate the trained model",
            eval_results.get("step"),
            train_results["train_steps"],
        )
        eval_results = {}
    results = {}
    for partial_results in (train_results, eval_results):
        results.update((HUGGING_FACE_RESULT_NAMES.get(key, key), value) for key, value in partial_results.items())
    if read("all_results.json") != results:  # a repeat of a complete run leaves the file as it was
        write_json(os.path.join(output_dir, "all_results.json"), results)
    return results


def write_json(path: str, values: dict):
    """Write via a temporary file, so an interrupted write never leaves a truncated file behind."""
    temporary_path = f"{path}.tmp"
    with open(temporary_path, "w") as file:
        json.dump(values, file, indent=2)
        file.write("\n")
    os.replace(temporary_path, path)


def evaluated_step(output_dir: str) -> int | None:
    """The step of the evaluation in OUTPUT_DIR/eval_results.json; None if there is none."""
    try:
        with open(os.path.join(output_dir, "eval_results.json")) as file:
            return json.load(file).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def write_train_results(output_dir: str, train_metrics, progress, setup, log):
    """train_results.json: the script's training metrics (`train_metrics` of the summed metrics of `progress`) over
    the most steps that all their sums cover (from train_metrics_from_step on: the first step, unless a resume added a
    sum), what each source of a mixture gave the run (since its sources or weights last changed in a resume), the
    changes resumes allowed, and how long it took; `setup` is the run's TrainingSetup, `log` its TrainingLog."""
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
        train_runtime_seconds=log.runtime,
        train_tokens_per_second=log.tokens / log.runtime,
        resume_changes=progress.resume_changes,
    )
    write_json(os.path.join(output_dir, "train_results.json"), results)


# What a resume may change of a mixture: its sources' rows or its weights (flax_lm.run.record).
MIXTURE_CHANGES = ("training_data", "mixture_weights")


def report_stop(signal_name: str, step: int, output_dir: str, trackers):
    trackers.close()
    print_once(
        f"Stopped by {signal_name} after step {step}; the training checkpoint is in "
        f"{os.path.join(output_dir, 'checkpoints', str(step))}. To continue, run the same command with "
        "--resume_from_checkpoint added."
    )
