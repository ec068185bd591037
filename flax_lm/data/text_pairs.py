"""Input/target pairs for a sequence-to-sequence model (run_t5_mlm_flax.py on prompt/completion data): each pair
tokenized as transformers tokenizes them for such a model, the input by `tokenizer(text)` and the target by
`tokenizer(text_target=text)` (T5's tokenizer ends both with </s>), and stored as one row of a packed corpus: an array
(2, width) of the input's ids and the target's, each padded with the tokenizer's padding id. JaxSeq's columns
in_text/out_text are read as TRL's prompt/completion (pair_columns)."""

import logging
from collections.abc import Iterator
from functools import partial

import numpy as np

from flax_lm.data.finetune_examples import numbered_batches
from flax_lm.data.source import TextSource
from flax_lm.data.texts import columns_of, map_in_workers, text_source
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)

# Other names of the input and target columns -> TRL's, which flax_lm.data.finetune_examples reads.
PAIR_COLUMN_NAMES = {"in_text": "prompt", "out_text": "completion"}


def pair_columns(dataset):
    """`dataset` with JaxSeq's columns in_text/out_text named prompt/completion, where it has both and neither of
    the others (a stream's columns may be unknown until it is read: then as it is)."""
    columns = columns_of(dataset) or []
    if set(PAIR_COLUMN_NAMES) <= set(columns) and not set(PAIR_COLUMN_NAMES.values()) & set(columns):
        return dataset.rename_columns(PAIR_COLUMN_NAMES)
    return dataset


def encode_pairs(
    tokenizer, width: int, where: str, numbered_batch: tuple[int, list[tuple]]
) -> tuple[np.ndarray, list]:
    """The rows (count, 2, width) of the pairs of one batch whose input and target each fit in `width` tokens, and
    (length, row of the data) of each left out as longer. A pair missing a side is refused, naming its row."""
    first_row, pairs = numbered_batch
    for row, (source_text, target_text) in enumerate(pairs, first_row):
        for side, value in (("prompt", source_text), ("completion", target_text)):
            if not isinstance(value, str):
                other_name = next(name for name, ours in PAIR_COLUMN_NAMES.items() if ours == side)
                raise UsageError(
                    f"row {row} of {where} has no {side} (field '{side}' or '{other_name}': "
                    f"{'missing or null' if value is None else type(value).__name__}); give every row both texts"
                )
    inputs = tokenizer([source for source, _ in pairs])["input_ids"]
    targets = tokenizer(text_target=[target for _, target in pairs])["input_ids"]
    fitting = [index for index in range(len(pairs)) if max(len(inputs[index]), len(targets[index])) <= width]
    too_long = [
        (max(len(inputs[index]), len(targets[index])), first_row + index)
        for index in sorted(set(range(len(pairs))) - set(fitting))
    ]
    rows = np.full((len(fitting), 2, width), tokenizer.pad_token_id, np.int32)
    for row, index in zip(rows, fitting):
        row[0, : len(inputs[index])], row[1, : len(targets[index])] = inputs[index], targets[index]
    return rows, too_long


def pair_rows(
    dataset, split: str, tokenizer, width: int, source: TextSource, num_workers: int | None = None
) -> Iterator[np.ndarray]:
    """The rows of one split of prompt/completion pairs, (count, 2, width), in order, encoded in `num_workers`
    processes (--preprocessing_num_workers). A pair longer than `width` on either side is left out and counted,
    never cut."""
    if tokenizer.pad_token_id is None:
        raise UsageError(f"the tokenizer {tokenizer.name_or_path} has no padding token, which pads the pairs' rows")
    settings = source.examples
    columns = (settings.prompt_column or "prompt", settings.completion_column or "completion")
    encode = partial(encode_pairs, tokenizer, width, text_source(split, source))
    pairs, too_long = 0, []
    for rows, batch_too_long in map_in_workers(encode, numbered_batches(dataset, columns, split), num_workers):
        pairs, too_long = pairs + len(rows), too_long + batch_too_long
        yield rows
    if too_long:
        logger.warning(
            "%s: left out %d pairs longer than %d tokens (the longest %d, the first at row %d); raise "
            "--max_seq_length to keep them",
            split,
            len(too_long),
            width,
            max(too_long)[0],
            min(row for _, row in too_long),
        )
    logger.info("%s: %d pairs, in rows of %d tokens for the input and %d for the target", split, pairs, width, width)
