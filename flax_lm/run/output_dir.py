"""The output directory of a run: one run at a time (a lock), no silent mixing with an earlier run's files, the
results files, and a copy of the script that ran."""

import contextlib
import filecmp
import itertools
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass

import jax
import orbax.checkpoint as ocp
from filelock import FileLock, Timeout

from flax_lm.devices.processes import on_process_zero, print_once
from flax_lm.errors import UsageError
from flax_lm.run.run_files import file_hash, forget_run_files, record_run_files, run_files, unlinked

logger = logging.getLogger(__name__)


OUTPUT_DIR_LOCK = ".lock"


@dataclass(frozen=True)
class OutputDirSettings:
    """What decides how a run may use its output directory: the training flags of the same names (the scripts'
    training arguments give theirs, CommonTrainingArguments.output_dir_settings)."""

    output_dir: str
    do_train: bool
    overwrite_output_dir: bool
    resume_from_checkpoint: str | None


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


def refuse_earlier_run(settings: OutputDirSettings):
    """Training into an earlier run's files needs --resume_from_checkpoint or --overwrite_output_dir. The lock and
    unfinished checkpoints, which the next run deletes anyway, are not such files (a run killed before its first
    checkpoint leaves nothing else of worth)."""
    output_dir = settings.output_dir
    if not settings.do_train or settings.overwrite_output_dir or settings.resume_from_checkpoint:
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


def check_output_dir(settings: OutputDirSettings):
    """Before any work, and writing nothing: refuse an output directory that another run holds (its lock is probed),
    one with an earlier run's files that these flags do not allow training into, or one that --overwrite_output_dir
    could not clear for a new run (refuse_user_steps)."""
    lock_path = os.path.join(settings.output_dir, OUTPUT_DIR_LOCK)
    if os.path.isfile(lock_path):
        probe = take_lock(lock_path, settings.output_dir)  # taken and let go at once
        if probe is not None:
            probe.release()
    refuse_earlier_run(settings)
    starts_afresh = settings.overwrite_output_dir and not settings.resume_from_checkpoint
    if settings.do_train and starts_afresh and os.path.isdir(settings.output_dir):
        refuse_user_steps(settings.output_dir, run_files(settings.output_dir))


# Where a run keeps the ids of its W&B and MLflow runs, to report into them again when it is resumed.
TRACKER_RUNS_FILE = "tracker_runs.json"


# Where a run keeps the versions of its code that trained it (keep_code_versions).
CODE_VERSIONS_DIR = "code"


# The results files a run writes (beside its export, config and tokenizer, which a new run writes over, and the
# script's copy): claimed for the run when it starts, so that a user's file of the same name is moved aside first.
RESULTS_FILES = ("train_results.json", "eval_results.json", "all_results.json", TRACKER_RUNS_FILE)


# How the log names what --overwrite_output_dir removed: the run's folders first, as they are listed.
REMOVED_ORDER = ("checkpoints", "discarded-checkpoints", "tensorboard", CODE_VERSIONS_DIR, *RESULTS_FILES)


def refuse_user_steps(output_dir: str, recorded: set[str]):
    """Refuse a folder in OUTPUT_DIR/checkpoints that no run recorded writing but that is named as a step is: Orbax
    would take it for the newest checkpoint and refuse every save before its step (or delete it, as an old one)."""
    checkpoints = os.path.join(output_dir, "checkpoints")
    names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
    if foreign := sorted(name for name in names if name.isdigit() and f"checkpoints/{name}" not in recorded):
        raise UsageError(
            f"--overwrite_output_dir: {os.path.join(checkpoints, foreign[0])} was not written by a run of this "
            "directory, and Orbax would take it for the training checkpoint of its step; move it out of "
            "checkpoints/ (or rename it) and run again"
        )


def clear_previous_run(output_dir: str, code_files: list[str]):
    """For --overwrite_output_dir: remove what earlier runs recorded writing (flax_lm.run.run_files: checkpoints,
    TensorBoard logs, code versions and copies, results) and nothing else: the user's files, in the run's folders too,
    stay, and a folder of the run's goes only once it is empty. The export (config, weights, tokenizer) stays, to be
    written over: it may be the model or tokenizer this run starts from. The script a run runs from its copy in the
    directory stays too."""
    recorded = run_files(output_dir)
    refuse_user_steps(output_dir, recorded)
    running = {os.path.realpath(path) for path in code_files}
    # A copy of code that the user edited since the run made it: its bytes are no version the run kept.
    versions = code_versions(output_dir)
    for name in sorted(path for path in recorded if "/" not in path and path.endswith(".py")):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path) and os.path.realpath(path) not in running:
            if not any(files.get(name) == file_hash(path) for files in versions):
                move_aside(
                    output_dir, name, "you edited it after the run copied it there, and a new run copies its own"
                )
                recorded.discard(name)
    checkpoints = os.path.join(output_dir, "checkpoints")
    checkpoint_entries = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
    removed, gone = set(), set()
    for path in sorted(path for path in recorded if not path.endswith("/")):
        full_path = os.path.join(output_dir, path)
        if os.path.realpath(full_path) in running:
            continue
        # With a recorded checkpoint, Orbax's unfinished copy of it: checkpoints/STEP.orbax-checkpoint-tmp-TIME.
        targets = [full_path] + [
            os.path.join(checkpoints, entry)
            for entry in checkpoint_entries
            if path.startswith("checkpoints/") and entry.startswith(f"{path.split('/')[1]}.orbax-checkpoint-tmp")
        ]
        gone.add(path)
        for target in targets:
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
                removed.add(path)
            elif os.path.lexists(target):
                os.remove(target)
                removed.add(path)
    kept = []
    for folder in sorted(path for path in recorded if path.endswith("/")):
        full_path = os.path.join(output_dir, folder.removesuffix("/"))  # with the /, a link reads as its folder
        if left := sorted(os.listdir(full_path)) if os.path.isdir(full_path) else []:
            kept += [folder + name for name in left if folder + name not in recorded - gone]
            continue
        if os.path.isdir(full_path) and not os.path.islink(full_path):
            os.rmdir(full_path)
            removed.add(folder)
        gone.add(folder)
    forget_run_files(output_dir, gone)
    # Files named as runs name theirs that no run recorded writing: the user's, or an earlier version's not recognised.
    kept += [
        name
        for name in (*RESULTS_FILES, *TRAINING_SCRIPTS)
        if name not in recorded and os.path.isfile(os.path.join(output_dir, name))
    ]
    named = []
    for name in sorted({path.split("/")[0] for path in removed}, key=removal_order):
        full_path = os.path.join(output_dir, name)
        if not any(path.startswith(f"{name}/") for path in recorded):
            named.append(name)
        elif os.path.islink(full_path):
            named.append(f"{name}/ (in {os.path.realpath(full_path)}, where the link leads)")
        else:
            named.append(f"{name}/")
    if named:
        logger.warning("--overwrite_output_dir: removed the previous run's %s from %s", ", ".join(named), output_dir)
    if kept:
        logger.warning("--overwrite_output_dir: kept %s, which no run wrote", ", ".join(kept))


def removal_order(name: str) -> tuple:
    return (REMOVED_ORDER.index(name), "") if name in REMOVED_ORDER else (len(REMOVED_ORDER), name)


# The training scripts, whose copies an output directory holds: one there that no run recorded is the user's.
TRAINING_SCRIPTS = ("run_clm_flax.py", "run_mlm_flax.py")


def move_aside(output_dir: str, name: str, why: str):
    """Move the user's file OUTPUT_DIR/`name`, in the way of the run's file of that name, to NAME.kept (-2, -3, ...:
    never over another)."""
    target = f"{name}.kept"
    copies = itertools.count(2)
    while os.path.lexists(os.path.join(output_dir, target)):
        target = f"{name}.kept-{next(copies)}"
    os.rename(os.path.join(output_dir, name), os.path.join(output_dir, target))
    logger.warning("moved your %s in %s to %s: %s", name, output_dir, target, why)


def claim_results_files(output_dir: str):
    """Record the results files as the run's, moving aside a file of the user's of the same name first."""
    recorded = run_files(output_dir)
    for name in RESULTS_FILES:
        if name not in recorded and os.path.lexists(os.path.join(output_dir, name)):
            move_aside(output_dir, name, "the run writes its results there")
    record_run_files(output_dir, RESULTS_FILES)


def set_aside_checkpoints_after(output_dir: str, step: int):
    """Move the training checkpoints after `step` (unreadable ones, or those of a later point the run resumes
    before) to OUTPUT_DIR/discarded-checkpoints, so that this run's saves at those steps are not refused."""
    directory = os.path.join(output_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    later = sorted(int(name) for name in names if name.isdigit() and int(name) > step)
    if not later:
        return
    recorded = run_files(output_dir)
    discarded = os.path.join(output_dir, "discarded-checkpoints")
    if not os.path.isdir(discarded):
        record_run_files(output_dir, ["discarded-checkpoints/"])
        os.makedirs(discarded)
    for later_step in later:
        target = os.path.join(discarded, str(later_step))
        copies = itertools.count(2)
        while os.path.exists(target):
            target = os.path.join(discarded, f"{later_step}-{next(copies)}")
        # A folder of the user's named as a step is moved too (Orbax would take it for one), but stays theirs.
        if f"checkpoints/{later_step}" in recorded:
            record_run_files(output_dir, [f"discarded-checkpoints/{os.path.basename(target)}"])
        # Copied, then removed, where checkpoints/ is a link to another disk, which a rename cannot cross.
        shutil.move(os.path.join(directory, str(later_step)), target)
    forget_run_files(output_dir, [f"checkpoints/{later_step}" for later_step in later])
    logger.warning("moved the training checkpoints of steps %s to %s", ", ".join(map(str, later)), discarded)


def prepare_output_dir(settings: OutputDirSettings, resumed_step: int, code_files: list[str | None]):
    """Lock the output directory for this run (the lock is returned: it lasts as long as the object), clear or set
    aside what an earlier run left that this one would mix with its own, and copy the `code_files` that run (the
    script, a model file of the experiment's own; None for none) into it, so that the directory says which code made
    it. What the run writes there is recorded (flax_lm.run.run_files); a file of the user's in the way of one of the
    run's is moved aside, and said."""
    code_files = [path for path in code_files if path]
    lock = lock_output_dir(settings.output_dir)
    refuse_earlier_run(settings)  # again: another run may have ended in it since the check
    if settings.do_train:
        if settings.overwrite_output_dir and not resumed_step:
            clear_previous_run(settings.output_dir, code_files)
        set_aside_checkpoints_after(settings.output_dir, resumed_step)
    os.makedirs(settings.output_dir, exist_ok=True)
    claim_results_files(settings.output_dir)
    keep_code_versions(settings.output_dir, code_files, resumed_step, branched_from(settings))
    return lock


def code_versions(output_dir: str) -> list[dict]:
    """The files ({name: hash}) of each version of the code that trained the run in OUTPUT_DIR (keep_code_versions)."""
    try:
        with open(os.path.join(output_dir, CODE_VERSIONS_DIR, "versions.json")) as file:
            return [version["files"] for version in json.load(file)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def branched_from(settings: OutputDirSettings) -> str | None:
    """The output directory of another run whose checkpoint --resume_from_checkpoint names (a run branched into a new
    --output_dir); None for a resume in the run's own directory, or none."""
    location = settings.resume_from_checkpoint
    if not location or location == "auto":
        return None
    path = os.path.normpath(location)
    run_dir = os.path.dirname(os.path.dirname(path) if os.path.basename(path).isdigit() else path)
    return None if os.path.realpath(run_dir) == os.path.realpath(settings.output_dir) else run_dir


def keep_code_versions(output_dir: str, code_files: list[str], first_step: int, earlier_run: str | None = None):
    """Copy the `code_files` that run now (the script, a model file of the experiment's own) into OUTPUT_DIR, and keep
    every version of them that trained the run: where they differ from the version before (a resume with the script
    edited, said in the log), each file is kept as OUTPUT_DIR/code/HASH/NAME and code/versions.json lists, for each
    version, its files' hashes and the step it trained from (the steps after it, up to the next version's). A run
    branched from the checkpoint of `earlier_run` (another output directory) starts with the versions that trained
    that run up to `first_step`. A file there of the name of a copy, whose bytes are no version's, is the user's: it is
    moved aside."""
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
        record_run_files(output_dir, [f"{CODE_VERSIONS_DIR}/versions.json"])
        write_json(versions_path, versions)
    for code_file in code_files:
        name = os.path.basename(code_file)
        copy = os.path.join(output_dir, name)
        if os.path.isfile(copy) and (os.path.samefile(code_file, copy) or filecmp.cmp(code_file, copy, shallow=False)):
            continue  # a repeat leaves it as it was
        if os.path.lexists(copy) and not (
            os.path.isfile(copy) and os.path.isfile(os.path.join(output_dir, CODE_VERSIONS_DIR, file_hash(copy), name))
        ):
            move_aside(output_dir, name, f"the run keeps the copy of the {name} it runs there")
        record_run_files(output_dir, [name])
        shutil.copyfile(code_file, unlinked(copy))


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
                shutil.copyfile(kept, unlinked(target))
    return versions


def code_version(output_dir: str, code_files: list[str], first_step: int) -> dict:
    """{"from_step": first_step, "files": {name: hash}}, each file kept as OUTPUT_DIR/code/HASH/NAME."""
    files = {}
    for path in code_files:
        name, digest = os.path.basename(path), file_hash(path)
        kept = os.path.join(output_dir, CODE_VERSIONS_DIR, digest, name)
        if not os.path.isfile(kept):
            made_folder = not os.path.isdir(os.path.join(output_dir, CODE_VERSIONS_DIR))
            record_run_files(output_dir, [f"{CODE_VERSIONS_DIR}/"] * made_folder + [f"{CODE_VERSIONS_DIR}/{digest}"])
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            shutil.copyfile(path, unlinked(kept))
        files[name] = digest
    return {"from_step": first_step, "files": files}


def open_output_dir(settings: OutputDirSettings, resumed_step: int, code_files: list[str | None]):
    """prepare_output_dir, by process 0 for every process: the lock it returns (None on the other processes) must be
    kept, as process 0 holds the directory as long as it keeps it."""
    return on_process_zero(
        lambda: prepare_output_dir(settings, resumed_step, code_files),
        f"lock --output_dir {settings.output_dir}",
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
    exported_step = train_results.get("exported_step", train_results.get("train_steps"))
    if train_results and eval_results and eval_results.get("step") != exported_step:
        logger.warning(
            "eval_results.json holds the evaluation of step %s, not of the trained model's step %d, so "
            "all_results.json leaves it out; resume with --do_eval to evaluate the trained model",
            eval_results.get("step"),
            exported_step,
        )
        eval_results = {}
    results = {}
    for partial_results in (train_results, eval_results):
        results.update((HUGGING_FACE_RESULT_NAMES.get(key, key), value) for key, value in partial_results.items())
    if read("all_results.json") != results:  # a repeat of a complete run leaves the file as it was
        write_json(os.path.join(output_dir, "all_results.json"), results)
    return results


def write_json(path: str, values: dict):
    """Write via a temporary file, so an interrupted write never leaves a truncated file behind (and a link at `path`
    is replaced, as a link, never written through)."""
    temporary_path = unlinked(f"{path}.tmp")
    with open(temporary_path, "w") as file:
        json.dump(values, file, indent=2)
        file.write("\n")
    os.replace(temporary_path, path)


@contextlib.contextmanager
def links_replaced(output_dir: str):
    """For an export into OUTPUT_DIR by code that writes through links (save_pretrained, the weights' writers): each
    link there to a file (or to nothing) is set aside while it writes, then removed where the export wrote a file of
    its name, which replaces it as a link is replaced, and put back otherwise (a link of the user's to their own
    file). Never is a file written through a link into what it leads to: a model's in a cache, another run's, anyone's.
    Links to folders (checkpoints/ on another disk) stay in place. On process 0, which writes the export."""
    names = os.listdir(output_dir) if jax.process_index() == 0 and os.path.isdir(output_dir) else []
    links = [
        name for name in names if os.path.islink(path := os.path.join(output_dir, name)) and not os.path.isdir(path)
    ]
    set_aside = {}
    for name in links:
        hidden = f".{name}.link"
        copies = itertools.count(2)
        while os.path.lexists(os.path.join(output_dir, hidden)):
            hidden = f".{name}.link-{next(copies)}"
        os.rename(os.path.join(output_dir, name), os.path.join(output_dir, hidden))
        set_aside[name] = hidden
    try:
        yield
    finally:
        for name, hidden in set_aside.items():
            path, link = os.path.join(output_dir, name), os.path.join(output_dir, hidden)
            if os.path.lexists(path):
                logger.warning(
                    "replaced the link %s (to %s) with the file the export writes there, rather than write into %s",
                    path,
                    os.readlink(link),
                    os.path.realpath(link),
                )
                os.unlink(link)
            else:
                os.rename(link, path)


def evaluated_step(output_dir: str) -> int | None:
    """The step of the evaluation in OUTPUT_DIR/eval_results.json; None if there is none."""
    try:
        with open(os.path.join(output_dir, "eval_results.json")) as file:
            return json.load(file).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def report_stop(signal_name: str, step: int, output_dir: str, trackers):
    trackers.close()
    print_once(
        f"Stopped by {signal_name} after step {step}; the training checkpoint is in "
        f"{os.path.join(output_dir, 'checkpoints', str(step))}. To continue, run the same command with "
        "--resume_from_checkpoint added."
    )
