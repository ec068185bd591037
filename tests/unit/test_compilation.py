"""The persistent compilation cache's warnings: a lock held by another process is no error to show."""

import warnings

from flax_lm.training.compilation import ignore_lock_timeouts


def test_a_lock_timeout_is_not_shown_and_other_cache_errors_still_are():
    lock = "Error reading persistent compilation cache entry for 'jit_step': Timeout: The file lock '/c/.lockfile'"
    other = "Error reading persistent compilation cache entry for 'jit_step': OSError: disk full"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        ignore_lock_timeouts()
        warnings.warn(lock, UserWarning, stacklevel=1)
        warnings.warn(other, UserWarning, stacklevel=1)
    assert [str(warning.message) for warning in shown] == [other]
