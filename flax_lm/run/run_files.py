"""The record of what runs wrote into an output directory (OUTPUT_DIR/run_files.json): the paths, relative to it, of
the files and folders a run created there, each recorded as it is made (before it, where the run names it itself).
--overwrite_output_dir removes what the record lists and nothing else: files of the user's, wherever they are in the
directory, stay. A path that ends with / is a folder the run made to hold its files (checkpoints/), removed only once
nothing else is left in it; any other is a file, or a folder that is the run's whole (a checkpoint).

A directory written before runs kept the record holds none; its record starts with what is recognisably a run's own
(recognised_run_files), and anything else there counts as the user's.

A record is a file that a user or another program can edit: each path it lists must be of a kind a run writes
(RUN_FILE_KINDS), spelled as a run spells it, and lie inside the directory once every link on its way is followed (or
inside the folder that a link checkpoints/ leads to, the checkpoints of a run kept on another disk); a record listing
anything else is refused whole, so that nothing outside the run's own files is ever removed for it."""

import contextlib
import hashlib
import json
import os
import re

from flax_lm.errors import UsageError

RUN_FILES = "run_files.json"


def run_files(output_dir: str) -> set[str]:
    """The paths the record of OUTPUT_DIR lists; where it has none (a directory of an earlier version, or a new one),
    those that are recognisably a run's."""
    try:
        with open(os.path.join(output_dir, RUN_FILES)) as file:
            recorded = json.load(file)["paths"]
        if isinstance(recorded, list) and all(isinstance(path, str) for path in recorded):
            check_run_files(output_dir, recorded)
            return set(recorded)
    except FileNotFoundError:
        recognised = recognised_run_files(output_dir)
        return {path for path in recognised if not outside_problem(output_dir, path, {})}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise UsageError(
        f"{os.path.join(output_dir, RUN_FILES)}, the record of what runs wrote there, is unreadable; restore it, or "
        "delete it (runs' files are then recognised by their content, as in a directory of an earlier version)"
    )


# The kinds of paths runs record (flax_lm.run.output_dir, checkpoints, tracking): their checkpoints, code versions and
# copies of the code that ran, results files, logs of metrics (run_grpo_flax.py's grpo_log.jsonl), TensorBoard's event
# files (wherever --logging_dir puts them inside the directory) and the folders that hold them.
RUN_FILE_KINDS = re.compile(
    r"checkpoints/\d+(\.orbax-checkpoint-tmp[^/]*)?|discarded-checkpoints/\d+(-\d+)?"
    r"|code/([0-9a-f]{12}|versions\.json)|[^/]+\.py"
    r"|train_results\.json|eval_results\.json|all_results\.json|tracker_runs\.json|[^/]+_log\.jsonl"
    r"|([^/]+/)*events\.out\.tfevents\.[^/]+|([^/]+/)+"
)


def check_run_files(output_dir: str, paths: list[str]):
    """Refuse, in one line, a record listing a path that is no run's file inside OUTPUT_DIR (see the module's
    docstring): `../elsewhere`, an absolute path, `checkpoints/../../x`, `.`, an empty one, or one through a link
    that leads out of the directory."""
    resolved_folders = {}
    for path in paths:
        parts = path.removesuffix("/").split("/")
        if any(part in ("", ".", "..") for part in parts) or not RUN_FILE_KINDS.fullmatch(path):
            problem = "which is not a path a run writes there"
        else:
            problem = outside_problem(output_dir, path, resolved_folders)
        if problem:
            raise UsageError(
                f"{os.path.join(output_dir, RUN_FILES)}, the record of what runs wrote there, lists {path!r}, "
                f"{problem}; a run removes only its own files in its directory: take that entry out of the record, "
                "or delete the record (runs' files are then recognised by their content)"
            )


def outside_problem(output_dir: str, path: str, resolved_folders: dict) -> str | None:
    """Why `path` (relative to OUTPUT_DIR) lies outside it once the links on its way are followed, or None. The path
    itself is not followed (a link there is removed as the link), nor checkpoints/, which may be a link to another
    disk that the run saves its checkpoints through. `resolved_folders` holds the folders resolved so far."""
    folder = os.path.dirname(path.removesuffix("/"))
    if folder in ("", "checkpoints"):
        return None
    if folder not in resolved_folders:
        resolved_folders[folder] = os.path.realpath(os.path.join(output_dir, folder))
    resolved, inside = resolved_folders[folder], os.path.realpath(output_dir)
    if resolved.startswith(inside + os.sep):
        return None
    return f"which leads through a link out of the directory, to {resolved}"


def record_run_files(output_dir: str, paths):
    """Add `paths` (relative to OUTPUT_DIR) to its record; written only where that changes it."""
    recorded = run_files(output_dir)
    if not set(paths) <= recorded or not os.path.isfile(os.path.join(output_dir, RUN_FILES)):
        write_record(output_dir, recorded | set(paths))


def forget_run_files(output_dir: str, paths):
    """Take `paths`, removed from OUTPUT_DIR, out of its record."""
    write_record(output_dir, run_files(output_dir) - set(paths))


def write_record(output_dir: str, paths: set[str]):
    temporary_path = unlinked(os.path.join(output_dir, f"{RUN_FILES}.tmp"))
    with open(temporary_path, "w") as file:
        json.dump({"paths": sorted(paths)}, file, indent=1)
        file.write("\n")
    os.replace(temporary_path, os.path.join(output_dir, RUN_FILES))


def unlinked(path: str) -> str:
    """`path`, with a link there removed first, to write a file at: a run writes its files into its directory, never
    through a link there into the file it leads to (another run's, a model's in a cache, anyone's). The rename that
    puts a file written beside in place (os.replace) replaces a link too, as a link."""
    if os.path.islink(path):
        os.unlink(path)
    return path


# Earlier versions kept no record: what they wrote is recognised by its content, not by its name alone.
CHECKPOINT_NAME = re.compile(r"\d+(-\d+)?")  # checkpoints/STEP, discarded-checkpoints/STEP-COPY
TEMPORARY_CHECKPOINT_NAME = re.compile(r"\d+\.orbax-checkpoint-tmp.*")
CODE_VERSION_NAME = re.compile(r"[0-9a-f]{12}")
# The results files and the keys each held, whichever version wrote it.
RESULTS_KEYS = {
    "train_results.json": {"train_steps"},
    "eval_results.json": {"step"},
    "all_results.json": {"train_steps", "step"},
}
TRACKERS = {"wandb", "mlflow"}


def recognised_run_files(output_dir: str) -> set[str]:
    """What a run of an earlier version (which kept no record) wrote into OUTPUT_DIR, as far as it can be told from
    the files themselves: Orbax checkpoints (with their metadata) and Orbax's unfinished ones, TensorBoard event files,
    the code versions whose files hash to their folder's name and their list, results files with the keys runs write,
    and copies of code whose bytes the list of code versions names."""
    found = set()

    def listing(folder):
        path = os.path.join(output_dir, folder)
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    for folder in ("checkpoints", "discarded-checkpoints"):
        for name in listing(folder):
            path = os.path.join(output_dir, folder, name)
            is_checkpoint = CHECKPOINT_NAME.fullmatch(name) and os.path.isfile(
                os.path.join(path, "_CHECKPOINT_METADATA")
            )
            if is_checkpoint or (folder == "checkpoints" and TEMPORARY_CHECKPOINT_NAME.fullmatch(name)):
                found.add(f"{folder}/{name}")
    found.update(f"tensorboard/{name}" for name in listing("tensorboard") if name.startswith("events.out.tfevents."))
    code_versions = []
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(output_dir, "code", "versions.json")) as file:
            code_versions = [version["files"] for version in json.load(file)]
        found.add("code/versions.json")
    for name in listing("code"):
        folder = os.path.join(output_dir, "code", name)
        if CODE_VERSION_NAME.fullmatch(name) and os.path.isdir(folder):
            files = [os.path.join(folder, file_name) for file_name in os.listdir(folder)]
            if files and all(os.path.isfile(path) and file_hash(path) == name for path in files):
                found.add(f"code/{name}")
    for files in code_versions:
        for name, digest in files.items():
            path = os.path.join(output_dir, name)
            if os.path.basename(name) == name and os.path.isfile(path) and file_hash(path) == digest:
                found.add(name)
    for name, keys in RESULTS_KEYS.items():
        if keys & set(read_mapping(os.path.join(output_dir, name))):
            found.add(name)
    tracker_runs = read_mapping(os.path.join(output_dir, "tracker_runs.json"))
    if tracker_runs and set(tracker_runs) <= TRACKERS:
        found.add("tracker_runs.json")
    # The folders that hold what was found are the runs' too (removed only once nothing of the user's is in them).
    found.update(path.split("/")[0] + "/" for path in list(found) if "/" in path)
    return found


def read_mapping(path: str) -> dict:
    try:
        with open(path) as file:
            values = json.load(file)
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def file_hash(path: str) -> str:
    """The hash a run names a version of its code by (OUTPUT_DIR/code/HASH)."""
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()[:12]
