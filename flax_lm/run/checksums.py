"""Checksums of the files a run writes and reads again later (packed token shards, training checkpoints): taken when
the files are written and compared when they are read, so that bytes changed on disk since (a failing disk, a copy
gone wrong, a stray write of the same size) are found before anything is trained on them.

The hash is xxHash's XXH3 (128 bits): an accidental change escapes it with a chance of 2**-128, and it reads a file
from the page cache at 0.13 s per GB on a 2-core CPU where SHA-256 takes 0.65 s (reading alone takes 0.10 s). It is
no defence against someone who changes the files on purpose."""

import json
import os

import xxhash

# Read in pieces of this size (larger ones hash no faster): memory stays small whatever the file's size.
READ_BYTES = 1 << 18


def file_checksum(path: str) -> str:
    """The XXH3-128 checksum of a file's bytes, in hexadecimal."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while size := file.readinto(buffer):
            hasher.update(view[:size])
    return hasher.hexdigest()


# In a training checkpoint's directory: the checksums of its items' files, by their paths there.
CHECKPOINT_CHECKSUMS = "checksums.json"


def write_checkpoint_checksums(directory: str):
    """Write CHECKPOINT_CHECKSUMS into the checkpoint `directory`: the checksum of every file of its items (the
    subdirectories: the state, the progress record). The files Orbax keeps beside them, its step metadata and commit
    marker, it rewrites as it commits the checkpoint, after this; they hold no part of the state."""
    checksums = {path: file_checksum(os.path.join(directory, path)) for path in item_files(directory)}
    temporary_path = os.path.join(directory, f"{CHECKPOINT_CHECKSUMS}.tmp")
    with open(temporary_path, "w") as file:
        json.dump(dict(sorted(checksums.items())), file, indent=0)
    os.replace(temporary_path, os.path.join(directory, CHECKPOINT_CHECKSUMS))


# The progress record of a training checkpoint (Orbax's JSON item "progress") and its key that says the checkpoint
# was saved with CHECKPOINT_CHECKSUMS: without the list, such a checkpoint cannot be told from a damaged one.
PROGRESS_RECORD = os.path.join("progress", "metadata")
SAVED_WITH_CHECKSUMS = "checksums"


def item_files(directory: str) -> list[str]:
    """The files of the checkpoint `directory`'s items (its subdirectories), by their paths there."""
    files = []
    for item in (entry.path for entry in os.scandir(directory) if entry.is_dir()):
        for root, _, names in os.walk(item):
            files += [os.path.relpath(os.path.join(root, name), directory) for name in names]
    return files


def checkpoint_checksum_problem(directory: str) -> str | None:
    """What differs in `directory` from its CHECKPOINT_CHECKSUMS, in words: the list missing where the progress record
    says the checkpoint was saved with one, a file missing, a file of an item that the list leaves out, or the first
    file whose bytes changed. None where every file is as written, or where there is no list and the record does not
    promise one (a checkpoint written before checksums were kept; checkpoint_has_checksums tells)."""
    try:
        with open(os.path.join(directory, CHECKPOINT_CHECKSUMS)) as file:
            checksums = json.load(file)
    except FileNotFoundError:
        if saved_with_checksums(directory):
            return f"its {CHECKPOINT_CHECKSUMS} is missing, though its progress record says it was saved with one"
        return None
    except (OSError, ValueError) as error:
        return f"its {CHECKPOINT_CHECKSUMS} is unreadable ({error})"
    if not isinstance(checksums, dict):
        return f"its {CHECKPOINT_CHECKSUMS} is not a mapping of files to checksums"
    if missing := [path for path in checksums if not os.path.isfile(os.path.join(directory, path))]:
        return f"its file {missing[0]} is missing"
    # A list with a file taken out would leave that file unchecked.
    if unlisted := sorted(set(item_files(directory)) - set(checksums)):
        return f"its file {unlisted[0]} is not in its {CHECKPOINT_CHECKSUMS} (the list was edited or cut short)"
    for relative_path, expected in checksums.items():
        if file_checksum(os.path.join(directory, relative_path)) != expected:
            return f"its file {relative_path} differs from the checksum taken when it was written"
    return None


def saved_with_checksums(directory: str) -> bool:
    """Whether the progress record of the checkpoint `directory` says it was saved with CHECKPOINT_CHECKSUMS (False
    where the record cannot be read: restoring it finds that)."""
    try:
        with open(os.path.join(directory, PROGRESS_RECORD)) as file:
            return bool(json.load(file).get(SAVED_WITH_CHECKSUMS))
    except (OSError, ValueError, AttributeError):
        return False


def checkpoint_has_checksums(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, CHECKPOINT_CHECKSUMS))
