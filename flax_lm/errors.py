"""A Python exception for the mistakes a user can fix, the check of a directory a command will write into (made before
any work rather than at the first save), and the one place that turns the mistakes into a line on stderr."""

import contextlib
import errno
import os
import re
import sys
import tempfile


class UsageError(Exception):
    """A problem the user must fix (an argument, a file, a diverged run): reported as one line, no traceback."""


def first_line(error: Exception, limit: int = 300) -> str:
    """The first line of `error`'s message (at most `limit` characters; its type's name where it has none), for a
    refusal in one line: the libraries' messages run over many lines, with their own advice below."""
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else type(error).__name__


def check_writable_directory(path: str, flag: str):
    """Refuse a directory (given by --`flag`) that is a file or cannot be created and written into. Writing a file is
    the test: os.access says yes to root on a read-only filesystem."""
    existing = os.path.abspath(path)  # the nearest directory that exists
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--{flag} {path}: {existing} is a file; pass a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise UsageError(
            f"--{flag} {path} cannot be written ({error.strerror} in {existing}); pass a directory you can write to"
        ) from None


@contextlib.contextmanager
def naming_a_full_disk(flag: str, directory: str):
    """Within it, a disk that fills up ends the command in one line naming the directory being written (the
    --`flag` the user can change), where the error itself names no file."""
    try:
        yield
    except Exception as error:
        if not is_full_disk(error):
            raise
        raise UsageError(
            f"the disk of {flag} {directory} is full; free some space there or pass another {flag}"
        ) from None


def is_full_disk(error: Exception) -> bool:
    """Whether `error` is a disk that filled up: an OSError, or a library's own error quoting the system's (safetensors
    and TensorStore, Orbax's storage, raise such)."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error)


def user_error_message(error: Exception) -> str | None:
    """The line the command prints for an error the user can fix: a UsageError, or a library's error for a hub it
    cannot reach or a file it cannot read. None for any other error, a bug, which keeps its traceback."""
    first_line = str(error).strip().split("\n")[0]
    if isinstance(error, UsageError):
        return str(error)
    if isinstance(error, ConnectionError) and error.errno is None:  # datasets and huggingface_hub, not a socket
        return (
            f"{first_line}; without a network (or with HF_HUB_OFFLINE=1) only what is in the cache can be loaded: "
            "pass local files or directories, or run once online"
        )
    if is_full_disk(error):
        # A library's error names the file in quotes, if at all.
        path = getattr(error, "filename", None) or next(iter(re.findall(r'"(/[^"]+)"', str(error))), None)
        where = f" writing {path}" if path else ""
        return (
            f"the disk is full{where}; free some space, or pass a --cache_dir or --output_dir on a disk that has it "
            "(a run killed by this resumes with --resume_from_checkpoint)"
        )
    # Looked up only where the library was loaded: a tool that never imports it cannot have raised its errors.
    datasets, safetensors = sys.modules.get("datasets"), sys.modules.get("safetensors")
    if datasets is not None and isinstance(error, datasets.exceptions.DatasetNotFoundError):
        return f"{first_line}; check --dataset_name"
    if safetensors is not None and isinstance(error, safetensors.SafetensorError):
        return f"a safetensors file cannot be read ({first_line}); save it again"
    return None


def without_echoes_of_a_failed_write(report_unraisable):
    """sys.unraisablehook, but silent for what a checkpoint failing on a full disk leaves behind: the errors of
    TensorStore's writes still under way, and its callbacks into the asyncio loop that Orbax closed on the failure
    ("Event loop is closed"), each a traceback that says nothing the command's last line does not."""

    def report(unraisable):
        error = unraisable.exc_value
        if not (is_full_disk(error) or (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")):
            report_unraisable(unraisable)

    return report


def call_with_one_line_errors(main):
    """Run a script's main(): a mistake the user can fix ends in one line on stderr and exit status 2, not a
    traceback; any other error (a bug) keeps its traceback."""
    sys.unraisablehook = without_echoes_of_a_failed_write(sys.unraisablehook)
    try:
        main()
    except Exception as error:
        message = user_error_message(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
