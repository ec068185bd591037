"""Compiling less and sooner: the persistent compilation cache, which keeps the compiled train, eval and sampling steps
on disk so that the next run of the same model, shapes and flags loads them instead of compiling them again; and the
train step compiled on a thread while the run prepares everything else."""

import logging
import os
import threading

import jax

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
