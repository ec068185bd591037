"""T5's span corruption (Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", 2020, section 3.1.4): a row of tokens loses about `noise_density` of them, in spans of
`mean_noise_span_length` on average; the input keeps the rest, each dropped span replaced by a sentinel token, and the
target is the dropped spans, each after its sentinel. Both end with EOS:

    tokens   Thank you for inviting me to your party last week .
    input    Thank you <extra_id_0> me to your party <extra_id_1> week . </s>
    target   <extra_id_0> for inviting <extra_id_1> last </s>

The n-th span of a row becomes <extra_id_n> (in a T5 tokenizer, numbered down from the highest id).
How many tokens and spans are dropped depends on the row's length only, so every row of a length corrupts into an
input and a target of fixed lengths (input_and_target_lengths); rows are made of the length whose input is exactly
--max_seq_length long (span_corruption_lengths). Which tokens are dropped is drawn for each row from counters of its
own (flax_lm.data.host_random), so a row is corrupted the same whatever rows are corrupted with it, on any process.
"""

from dataclasses import dataclass

import numpy as np

from flax_lm.data.host_random import random_bits, uniform_from_bits
from flax_lm.errors import UsageError


@dataclass(frozen=True)
class SpanCorruption:
    """How much of a row is dropped, and in what spans: T5's objective has 0.15 and 3."""

    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0

    def noise_counts(self, length: int) -> tuple[int, int]:
        """(tokens dropped, spans they are dropped in) from a row of `length` tokens, rounded as T5 rounds them (to
        the nearest, half to even). Each span of dropped tokens follows a span of kept ones, so there are at most as
        many spans as kept tokens; a row too short for one span gives 0 spans (span_corruption_lengths refuses it)."""
        noise_tokens = round(length * self.noise_density)
        noise_spans = round(noise_tokens / self.mean_noise_span_length)
        return noise_tokens, min(noise_spans, noise_tokens, length - noise_tokens)

    def input_and_target_lengths(self, length: int) -> tuple[int, int]:
        """The lengths of the input and the target that a row of `length` tokens corrupts into: the kept tokens and a
        sentinel for each span, the dropped tokens and a sentinel for each span, each with EOS at its end."""
        noise_tokens, noise_spans = self.noise_counts(length)
        return length - noise_tokens + noise_spans + 1, noise_tokens + noise_spans + 1


def span_corruption_lengths(max_seq_length: int, corruption: SpanCorruption) -> tuple[int, int]:
    """(tokens in a row, target length): the longest row whose input fills `max_seq_length` (T5's
    compute_input_and_target_lengths), and its target's length. A row one token longer adds at most one token to the
    input, so that row's input is exactly `max_seq_length` long. Refuses a length too short for one span."""
    length = max_seq_length
    while corruption.input_and_target_lengths(length + 1)[0] <= max_seq_length:
        length += 1
    if corruption.input_and_target_lengths(length)[0] != max_seq_length or corruption.noise_counts(length)[1] < 1:
        shortest = next(
            row_length
            for row_length in range(2, 10 * max_seq_length + 1000)
            if corruption.noise_counts(row_length)[1] >= 1
        )
        raise UsageError(
            f"--max_seq_length {max_seq_length} is too short for one span of noise at --noise_density "
            f"{corruption.noise_density} and --mean_noise_span_length {corruption.mean_noise_span_length}; raise it "
            f"to at least {corruption.input_and_target_lengths(shortest)[0]}"
        )
    return length, corruption.input_and_target_lengths(length)[1]


def random_segment_lengths(count: int, segments: int, draws: np.ndarray) -> np.ndarray:
    """Lengths (rows, segments), each at least 1 and summing to `count` in every row: a uniformly random way of
    cutting `count` items into `segments` runs, chosen by the draws (rows, count - 1), one for each place between two
    items (the segments - 1 places with the smallest draws are cut)."""
    rows = draws.shape[0]
    cuts = (
        np.sort(np.argpartition(draws, segments - 2, axis=1)[:, : segments - 1], axis=1) + 1 if segments > 1 else None
    )
    ends = np.full((rows, segments), count, np.int64)
    if cuts is not None:
        ends[:, :-1] = cuts
    return np.diff(ends, axis=1, prepend=0)


def random_spans_noise_mask(
    length: int, corruption: SpanCorruption, seed: int | tuple, row_numbers: np.ndarray
) -> np.ndarray:
    """Which tokens of each row of `length` are dropped: bool (rows, length), True for noise. A row alternates spans of
    kept and dropped tokens, starting with kept ones: noise_counts(length) fixes how many of each, the draws where the
    spans are cut. row_numbers: (rows,) each row's number in its global batch, which with the seed fixes its draws.
    """
    noise_tokens, noise_spans = corruption.noise_counts(length)
    seed = np.random.SeedSequence(seed).generate_state(1, np.uint64)[0]
    # Each row has 2 * length counters: the places between its kept tokens, then those between its dropped ones.
    first_counters = np.asarray(row_numbers, np.uint64)[:, None] * np.uint64(2 * length)
    kept_draws = uniform_from_bits(
        random_bits(seed, first_counters + np.arange(length - noise_tokens - 1, dtype=np.uint64))
    )
    noise_draws = uniform_from_bits(
        random_bits(seed, first_counters + np.uint64(length) + np.arange(noise_tokens - 1, dtype=np.uint64))
    )
    kept_lengths = random_segment_lengths(length - noise_tokens, noise_spans, kept_draws)
    noise_lengths = random_segment_lengths(noise_tokens, noise_spans, noise_draws)
    span_lengths = np.stack([kept_lengths, noise_lengths], axis=2).reshape(len(first_counters), -1)
    is_noise = np.tile([False, True], span_lengths.shape[0] * noise_spans)
    return np.repeat(is_noise, span_lengths.ravel()).reshape(-1, length)


def with_sentinels(tokens: np.ndarray, dropped: np.ndarray, sentinel_ids: np.ndarray, eos_token_id: int) -> np.ndarray:
    """The tokens of each row that are not `dropped`, each run of dropped ones replaced by one sentinel (the n-th run
    of a row by sentinel_ids[n]), and EOS at the end: (rows, tokens kept + runs + 1). Every row must keep as many
    tokens and have as many runs as the others (those of random_spans_noise_mask do)."""
    starts = dropped & ~np.pad(dropped, ((0, 0), (1, 0)))[:, :-1]
    sentinels = np.asarray(sentinel_ids, tokens.dtype)[np.maximum(np.cumsum(starts, axis=1) - 1, 0)]
    kept = np.where(starts, sentinels, tokens)[~dropped | starts].reshape(len(tokens), -1)
    return np.concatenate([kept, np.full((len(tokens), 1), eos_token_id, kept.dtype)], axis=1)


def corrupt_spans(
    tokens: np.ndarray,
    corruption: SpanCorruption,
    sentinel_ids: np.ndarray,
    eos_token_id: int,
    seed: int | tuple,
    row_numbers: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of rows of tokens (rows, length), int32: the spans random_spans_noise_mask drops replaced by
    sentinels in the inputs, the kept spans in the targets, the n-th span of each by sentinel_ids[n] (<extra_id_n>):
    at least noise_counts(length)[1] of them."""
    noise = random_spans_noise_mask(tokens.shape[1], corruption, seed, row_numbers)
    tokens = np.asarray(tokens, np.int32)
    return with_sentinels(tokens, noise, sentinel_ids, eos_token_id), with_sentinels(
        tokens, ~noise, sentinel_ids, eos_token_id
    )
