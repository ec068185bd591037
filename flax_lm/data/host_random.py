"""Counter-based random numbers on the host: every draw is computed directly from its own number, so the random
choices made for a row of a batch (MLM's masks) depend neither on what was drawn before nor on which process draws."""

import numpy as np


def random_bits(seed: np.uint64, counters: np.ndarray) -> np.ndarray:
    """64 random bits for each counter: output number `counter` of SplitMix64 seeded with `seed` (Steele, Lea
    and Flood, 2014). An output depends on its number alone, so numpy computes any of them directly, all at once."""
    bits = seed + (counters + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)  # wraps around at 2**64, as it should
    bits = (bits ^ (bits >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    bits = (bits ^ (bits >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return bits ^ (bits >> np.uint64(31))


def uniform_from_bits(bits: np.ndarray) -> np.ndarray:
    """Numbers in [0, 1), from the top 53 of the random bits."""
    return (bits >> np.uint64(11)) * 2.0**-53
