"""T5's span corruption (flax_lm.data.span_corruption): the lengths that fill --max_seq_length, the random spans, and
the inputs and targets with their sentinels."""

import numpy as np
import pytest

from flax_lm.data.span_corruption import (
    SpanCorruption,
    corrupt_spans,
    random_spans_noise_mask,
    span_corruption_lengths,
)
from flax_lm.errors import UsageError

T5 = SpanCorruption(noise_density=0.15, mean_noise_span_length=3.0)
SENTINELS = np.arange(31999, 31999 - 100, -1)  # <extra_id_0>, <extra_id_1>, ... as T5's vocabulary numbers them


@pytest.mark.parametrize("max_seq_length", [10, 11, 64, 127, 128, 512, 568])
def test_rows_of_the_computed_length_corrupt_into_inputs_that_fill_max_seq_length(max_seq_length):
    length, target_length = span_corruption_lengths(max_seq_length, T5)
    assert T5.input_and_target_lengths(length) == (max_seq_length, target_length)
    assert T5.input_and_target_lengths(length + 1)[0] > max_seq_length  # the longest such row
    tokens = np.arange(100, 100 + 3 * length, dtype=np.int32).reshape(3, length)
    inputs, targets = corrupt_spans(tokens, T5, SENTINELS, 1, 0, np.arange(3))
    assert inputs.shape == (3, max_seq_length) and targets.shape == (3, target_length)


def test_the_lengths_are_t5s_for_its_usual_settings():
    # T5's compute_input_and_target_lengths: 512 input tokens come from rows of 568, with targets of 114.
    assert span_corruption_lengths(512, T5) == (568, 114)
    # 141 tokens: 21 dropped (141 x 0.15, rounded) in 7 spans, so 141 - 21 + 7 + EOS = 128 and 21 + 7 + EOS = 29.
    assert span_corruption_lengths(128, T5) == (141, 29)


def test_a_max_seq_length_too_short_for_one_span_is_refused_naming_the_shortest():
    with pytest.raises(UsageError, match=r"--max_seq_length 5 is too short for one span .* at least 10$"):
        span_corruption_lengths(5, T5)


def test_the_mask_drops_the_noise_density_in_spans_of_the_mean_length_on_average():
    length, rows = 568, 400
    mask = random_spans_noise_mask(length, T5, 7, np.arange(rows))
    noise_tokens, noise_spans = T5.noise_counts(length)
    assert (mask.sum(axis=1) == noise_tokens).all()
    assert abs(noise_tokens / length - 0.15) < 0.002
    starts = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]
    assert (starts.sum(axis=1) == noise_spans).all()
    assert not mask[:, 0].any()  # a row starts with kept tokens
    assert mask.sum() / starts.sum() == pytest.approx(3.0, abs=0.05)
    # The spans fall everywhere in a row, and are not all of one length.
    assert mask.mean(axis=0)[length // 10 :].min() > 0.05
    span_lengths = np.diff(np.flatnonzero(np.diff(np.pad(mask[0].astype(int), 1))))[::2]
    assert len(set(span_lengths.tolist())) > 1


def test_the_mask_of_a_row_depends_on_the_seed_and_its_number_only():
    first = random_spans_noise_mask(100, T5, (3, 0, 5), np.arange(8))
    assert (first == random_spans_noise_mask(100, T5, (3, 0, 5), np.arange(8))).all()
    assert (first[5:] == random_spans_noise_mask(100, T5, (3, 0, 5), np.arange(5, 8))).all()  # on another process
    assert (first != random_spans_noise_mask(100, T5, (3, 0, 6), np.arange(8))).any()
    assert (first[0] != first[1]).any()


def test_every_token_is_in_the_input_or_the_target_once_after_sentinels_numbered_in_order():
    length, first_sentinel, eos = 200, SENTINELS[0], 1
    tokens = np.arange(100, 100 + 4 * length, dtype=np.int32).reshape(4, length)
    inputs, targets = corrupt_spans(tokens, T5, SENTINELS, eos, 11, np.arange(4))
    _, noise_spans = T5.noise_counts(length)
    sentinels = SENTINELS[:noise_spans]
    for row, row_input, row_target in zip(tokens, inputs, targets):
        assert row_input[-1] == eos and row_target[-1] == eos
        input_sentinels = row_input[row_input > first_sentinel - 100]
        target_sentinels = row_target[row_target > first_sentinel - 100]
        assert (input_sentinels == sentinels).all() and (target_sentinels == sentinels).all()
        assert row_target[0] == first_sentinel
        kept, dropped = row_input[row_input < 10000][:-1], row_target[row_target < 10000][:-1]
        assert sorted(np.concatenate([kept, dropped]).tolist()) == row.tolist()
        # Putting each sentinel's span back where the input has the sentinel gives the row back.
        spans = np.split(row_target[:-1], np.flatnonzero(row_target[:-1] > 10000))[1:]
        restored = []
        for token in row_input[:-1]:
            restored.extend(spans[first_sentinel - token][1:] if token > 10000 else [token])
        assert restored == row.tolist()
