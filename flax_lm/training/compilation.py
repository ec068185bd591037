"""Compiling less and sooner: the persistent compilation cache, which keeps the compiled train, eval and sampling steps
on disk so that the next run of the same model, shapes and flags loads them instead of compiling them again; and the
train step compiled on a thread while the run prepares everything else."""

import contextlib
import logging
import os
import threading
import warnings

import jax
import xxhash

# JAX's persistent cache has no public way to wrap its entries (see KeyedEntries): its private module it is.
from jax._src import compilation_cache as jax_compilation_cache
from jax._src.compilation_cache_interface import CacheInterface

logger = logging.getLogger(__name__)

# The least recently used programs are removed beyond this size. A limit also makes JAX lock the directory around
# each read and write, so that several processes, of one run or of several runs, can share it.
CACHE_SIZE_LIMIT_BYTES = 4 * 1024**3
MIN_COMPILE_SECONDS_KEPT = 0.1


def default_compilation_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flax_lm", "compilation")


def use_compilation_cache(directory: str | None):
    """Keep compiled programs in `directory`; without one, in JAX_COMPILATION_CACHE_DIR where that is set, else in
    default_compilation_cache_dir(); "none" compiles afresh. Call it before anything is compiled: JAX decides at the
    first compilation whether the process uses the cache."""
    if directory == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    directory = directory or jax.config.jax_compilation_cache_dir or default_compilation_cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:  # a read-only home directory, for one: runs go on, compiling as before
        logger.warning("No compilation cache: %s cannot be created (%s)", directory, error.strerror)
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX keeps only programs that took a second or more to compile; a small model's weight initialisation, eval
        # step and sampling steps each take less, and loading them is still faster than compiling them.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS_KEPT)
    if jax.config.jax_compilation_cache_max_size == -1:  # JAX's default: no limit, and no locks
        jax.config.update("jax_compilation_cache_max_size", CACHE_SIZE_LIMIT_BYTES)
    keep_entries_keyed()
    ignore_lock_timeouts()


def ignore_lock_timeouts():
    """Leave out JAX's warning that another process held the cache's lock too long to read or write an entry: it
    compiles the program instead, which the run only sees as time, and the warning reads like an error."""
    warnings.filterwarnings(
        "ignore", message=r"Error (reading|writing) persistent compilation cache entry for .*: Timeout: The file lock"
    )


class KeyedEntries(CacheInterface):
    """JAX's file cache of compiled programs, each entry led by a line naming its key (a hash of the program and the
    compiler's settings, which names the file) and the checksum of the rest. JAX trusts the file's name alone: an
    entry swapped with another's or copied over it loads another program, which fails on every run until the cache is
    cleared (an AssertionError where the outputs differ) or, with the same shapes, computes the other program. An
    entry whose line names another key or checksum, or that has none (written by JAX alone, or before this), is
    removed and its program compiled and stored again, as JAX compiles again where it cannot read an entry (but leaves
    it, to fail again the next time)."""

    MARK = b"flax_lm compiled program"

    def __init__(self, files: CacheInterface):
        self.files = files

    @property
    def _path(self):  # JAX's messages name the cache by it
        return self.files._path

    def header(self, key: str, value: bytes) -> bytes:
        return b" ".join([self.MARK, key.encode(), xxhash.xxh3_128_hexdigest(value).encode()]) + b"\n"

    def get(self, key: str) -> bytes | None:
        entry = self.files.get(key)
        if entry is None:
            return None
        header, _, value = entry.partition(b"\n")
        if header + b"\n" == self.header(key, value):
            return value
        path = os.path.join(str(self.files._path), f"{key}-cache")
        if not header.startswith(self.MARK):
            logger.info("Compilation cache: compiling %s again, to store it with its key", path)
        elif header.split()[3:4] != [key.encode()]:
            logger.warning("Compilation cache: %s holds the program of another entry; compiling its own again", path)
        else:
            logger.warning("Compilation cache: %s changed since it was written; compiling it again", path)
        with contextlib.suppress(FileNotFoundError):  # so that the program compiled now takes its place
            os.remove(path)
        return None

    def put(self, key: str, value: bytes):
        self.files.put(key, self.header(key, value) + value)


def keep_entries_keyed():
    """Make JAX's persistent cache a KeyedEntries, now if it is open and whenever it is opened again."""
    open_files = jax_compilation_cache.get_file_cache
    if getattr(open_files, "keyed", False):
        return

    def open_keyed_files(path):
        opened = open_files(path)
        return None if opened is None else (KeyedEntries(opened[0]), opened[1])

    open_keyed_files.keyed = True
    jax_compilation_cache.get_file_cache = open_keyed_files
    cache = jax_compilation_cache._cache
    if cache is not None and not isinstance(cache, KeyedEntries):
        jax_compilation_cache._cache = KeyedEntries(cache)


def compile_in_background(jitted, *abstract_args) -> threading.Thread:
    """Start compiling `jitted` for arguments of these shapes, dtypes and shardings (jax.ShapeDtypeStruct) on a thread,
    and return at once, so that the caller's own work (initialising the weights, say) overlaps. JAX keeps the program:
    a call with arguments of these shapes runs it, and one made while it is still compiling waits for it."""

    def compile_program():
        try:
            jitted.lower(*abstract_args).compile()
        except Exception:  # the first call compiles again, and raises the error where the caller sees it
            pass

    thread = threading.Thread(target=compile_program, name="compile-ahead")
    thread.start()
    return thread
