"""The check of a directory a tool will write into, made before any work rather than at the first save."""

import os
import tempfile

from flax_lm.errors import UsageError


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
