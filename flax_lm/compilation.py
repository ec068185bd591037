"""The persistent compilation cache: the compiled train, eval and sampling steps kept on disk, so that the next run of
the same model, shapes and flags loads them instead of compiling them again."""

import logging
import os

import jax

logger = logging.getLogger(__name__)

# The least recently used programs are removed beyond this size. A limit also makes JAX lock the directory around
# each read and write, so that several processes, of one run or of several runs, can share it.
CACHE_SIZE_LIMIT_BYTES = 4 * 1024**3


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
    if jax.config.jax_compilation_cache_max_size == -1:  # JAX's default: no limit, and no locks
        jax.config.update("jax_compilation_cache_max_size", CACHE_SIZE_LIMIT_BYTES)
