"""The data of a run: rows of tokens for each split from whichever route the arguments name (files or a dataset
through the token cache, --packed_data_dir, or a stream packed while training), and the order they are read in."""

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import datasets
import datasets.distributed
import jax
import numpy as np

from flax_lm.data.finetune_examples import data_format, example_framing
from flax_lm.data.mixture import Mixture, read_mixture, source_texts, warn_of_validation_files_trained_on
from flax_lm.data.packed import PACKED_TOKENS_PER_SHARD, cached_blocks, load_packed_corpus
from flax_lm.data.pieces import pieces_of
from flax_lm.data.source import TextSource
from flax_lm.data.texts import check_tokenizer_encodes, warn_of_files_in_both_splits
from flax_lm.devices.mesh import prefetch, process_slice, to_global_batch
from flax_lm.devices.processes import main_process_first
from flax_lm.errors import UsageError, naming_a_full_disk

logger = logging.getLogger(__name__)


def hold_out_blocks(blocks: dict, validation_split_percentage: int, source: str = "") -> dict:
    """{split: examples} with a validation split, for a run that evaluates: without one, the first
    validation_split_percentage percent of the training examples (blocks: by blocks rather than texts, so that a
    corpus of one long document can be split too). The one rule of every data route (files, datasets,
    --packed_data_dir; a stream, whose length is unknown, needs a validation split of its own), applied only where
    the run evaluates (final_rows), so that a run that does not trains on every row whichever the route; the token
    cache keeps the whole split, before any is held out, and so does not depend on it. `source`: whose data it is,
    for the message."""
    if "train" not in blocks or "validation" in blocks:
        return blocks
    if validation_split_percentage == 0:
        raise UsageError(
            f"--do_eval needs evaluation data, and the data{source} has no validation split while "
            "--validation_split_percentage 0 holds none of the training data out: pass --validation_file, or a "
            "percentage"
        )
    train = blocks["train"]
    if len(train) < 2:
        raise UsageError(
            f"the training data{source} makes {len(train)} examples, fewer than 2; there is nothing to hold out for "
            "evaluation: add text, or give a validation file"
        )
    validation_size = max(1, len(train) * validation_split_percentage // 100)
    return {"validation": train[:validation_size], "train": train[validation_size:]}


def stream_share(dataset: datasets.IterableDataset) -> datasets.IterableDataset:
    """This process's share of a stream: whole files (shards) when their number is a multiple of the process
    count, otherwise every process_count-th text. The shares are disjoint and together cover the stream."""
    if jax.process_count() == 1:
        return dataset
    return datasets.distributed.split_dataset_by_node(
        dataset, rank=jax.process_index(), world_size=jax.process_count()
    )


class PassEndedBeforeAnyRow(Exception):
    """A whole pass over a stream's texts was read and no row has come out yet (streaming_train_batches)."""


def streaming_train_batches(
    dataset: datasets.IterableDataset,
    rows_of_texts: Callable[[datasets.IterableDataset], Iterable[np.ndarray]],
    global_batch_size: int,
    seed: int,
    shuffle_buffer_size: int,
    first_batch: int = 0,
) -> Iterator[dict]:
    """This process's rows of each global batch, made on the fly from its share of the stream by the script's
    `rows_of_texts(texts)` (its tokenized_rows: whatever it keeps, drops or frames on the other routes it does here
    too), without end: the function reads the share pass after pass as one stream, each pass shuffled differently, so
    that a block runs on from the end of a pass into the next.

    The shuffle is approximate: texts pass through a buffer of `shuffle_buffer_size` (and the order of the
    files is shuffled). The batches depend only on the data, these arguments and the process count, so a
    resumed run starting at `first_batch` re-reads (and re-tokenizes) the batches before it and goes on
    with the very batches the interrupted run would have seen.
    """
    local_batch_size = len(range(global_batch_size)[process_slice(global_batch_size)])
    share = stream_share(dataset)
    if shuffle_buffer_size > 0:
        share = share.shuffle(seed=seed, buffer_size=shuffle_buffer_size)

    progress = {"rows": 0, "first_pass_checked": False}

    def every_pass():
        for epoch in itertools.count():
            if shuffle_buffer_size > 0:
                share.set_epoch(epoch)  # reshuffles the files and the buffer
            empty = True
            for text in share:
                empty = False
                yield text
            if empty:
                raise UsageError(
                    f"process {jax.process_index()}'s share of the training stream holds no text (a .txt file is one "
                    "text unless --text_sample_by says otherwise): give at least as many texts as processes"
                )
            if not progress["first_pass_checked"] and progress["rows"] == 0:
                raise PassEndedBeforeAnyRow

    def all_rows():
        while True:
            passes = datasets.IterableDataset.from_generator(every_pass, features=share.features)
            try:
                for row_array in rows_of_texts(passes):
                    progress["rows"] += len(row_array)
                    yield row_array
            except PassEndedBeforeAnyRow:
                # Rows come out some batches of texts after their texts were read, so none yet may be a lag; texts
                # the script drops (a filter in tokenized_rows) would be read pass after pass, forever. Whether one
                # pass on its own makes a row tells which; with none made yet, the stream starts again as it was.
                if not any(len(rows) for rows in rows_of_texts(share)):
                    raise UsageError(
                        f"process {jax.process_index()}'s share of the training stream makes no row: the script's "
                        "tokenized_rows keeps none of its texts (a filter that drops every document?), or they hold "
                        "fewer tokens than one block"
                    ) from None
                progress["first_pass_checked"] = True

    rows, batch_number = None, 0
    for row_array in all_rows():
        rows = row_array if rows is None else np.concatenate([rows, row_array])
        while len(rows) >= local_batch_size:
            if batch_number >= first_batch:
                yield {"input_ids": rows[:local_batch_size]}
            rows, batch_number = rows[local_batch_size:], batch_number + 1


def first_blocks(row_arrays: Iterable[np.ndarray], row_length: int, count: int | None) -> np.ndarray:
    """The first `count` rows of a stream's row arrays (all of them when `count` is None), read into memory."""
    blocks, total = [np.zeros((0, row_length), np.int32)], 0
    for block_array in row_arrays:
        blocks.append(block_array)
        total += len(block_array)
        if count is not None and total >= count:
            break
    return np.concatenate(blocks)[:count]


@dataclass(frozen=True)
class TextsToRows:
    """How a script's texts become its rows, carried together through every data route (files and datasets through
    the token cache, --packed_data_dir, a stream, a mixture's sources): its reader of texts, its rows functions (its
    own settings bound, functools.partial), the tokenizer, the row length, the flag that sets it (for messages), and
    how its rows of plain text are framed."""

    read_texts: Callable  # (source, streaming=False, evaluation_only=False) -> {split: dataset}
    tokenized_rows: Callable  # (dataset, split, tokenizer, row_length, source) -> arrays of rows
    tokenizer: Any
    row_length: int
    length_flag: str  # the flag that sets the length: --block_size

    # (dataset, split, tokenizer, row_length, source, example_format) -> arrays of rows of examples (prompt/completion
    # pairs, conversations: flax_lm.data.finetune_examples): what run_clm_flax.py trains on where the data are
    # examples; None elsewhere.
    example_rows: Callable | None = None
    framing: str = "grouped"  # rows of plain text: texts joined and cut into blocks, or "line_by_line"
    # The length that shapes the rows of examples where it is not row_length (run_t5_mlm_flax.py's pairs: padded to
    # --max_seq_length, while its rows of text are longer): the token cache is keyed by the length of its rows.
    example_row_length: int | None = None

    def length_of(self, example_format: str | None) -> int:
        """The length that shapes the rows of data in `example_format` (None: plain text)."""
        if example_format and self.example_row_length is not None:
            return self.example_row_length
        return self.row_length

    def read(self, source: TextSource, streaming=False, evaluation_only=False, streaming_alone=False) -> tuple:
        """The texts of each split that the script's read_texts reads from `source`, and the format of their examples
        (None: plain text), refused where the tokenizer encodes them into nothing. `streaming_alone`: read as a
        stream to be tokenized while training."""
        texts = self.read_texts(source, streaming=streaming, evaluation_only=evaluation_only)
        example_format = data_format(texts, source, streaming_alone)
        check_tokenizer_encodes(self.tokenizer, texts, source)
        return texts, example_format

    def row_function(self, example_format: str | None) -> Callable:
        """The script's function that makes rows of data in `example_format`: of examples, or of plain text."""
        return partial(self.example_rows, example_format=example_format) if example_format else self.tokenized_rows

    def framing_of(self, example_format: str | None, source: TextSource) -> str:
        """How the rows of data in `example_format` are made, as a packed corpus records it."""
        return example_framing(example_format, source.examples) if example_format else self.framing

    def rows_of(self, dataset, split: str, source: TextSource, example_format: str | None):
        return self.row_function(example_format)(
            dataset, split, self.tokenizer, self.length_of(example_format), source
        )


@dataclass(frozen=True)
class DataRoute:
    """Which route a run's rows take from the texts of `source`, and what the run keeps of them: the data flags of the
    same names, and whether the run trains and evaluates (--do_train, --do_eval)."""

    source: TextSource
    do_train: bool = True
    do_eval: bool = True
    data_mixture: str | None = None
    packed_data_dir: str | None = None
    streaming: bool = False
    validation_split_percentage: int = 5
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    overwrite_cache: bool = False
    packed_tokens_per_shard: int = PACKED_TOKENS_PER_SHARD
    preprocessing_piece_mb: float = 1.0

    def names_data(self) -> bool:
        """Whether the route names data to train or evaluate on."""
        source = self.source
        return any(
            (source.train_file, source.validation_file, source.dataset_name, self.data_mixture, self.packed_data_dir)
        )


class LoadedData(NamedTuple):
    rows: dict  # {split: array-like (rows, row_length)}; a mixture's validation rows by source
    train_stream: Any  # with --streaming alone, the training texts as a stream, else None
    example_format: str | None  # the format of the examples the rows are made of; None for plain text


def load_streams(route: DataRoute, texts_to_rows: TextsToRows) -> tuple[dict, Any, str | None]:
    """For --streaming without --packed_data_dir: the training stream, tokenized and packed while training, and
    {"validation": the first rows of the validation stream}, read once so that every evaluation (on every process)
    sees the same rows; and the format of the data's examples."""
    streams, example_format = texts_to_rows.read(route.source, streaming=True, streaming_alone=True)
    train_stream = streams.get("train") if route.do_train else None  # load_data refuses a missing one
    if not route.do_eval:
        return {}, train_stream, example_format
    if "validation" not in streams:
        raise UsageError(
            "--streaming --do_eval needs --validation_file or a dataset with a validation split: a stream has no "
            "length to hold a percentage out from"
        )
    row_arrays = texts_to_rows.rows_of(streams["validation"], "validation", route.source, example_format)
    validation = first_blocks(row_arrays, texts_to_rows.row_length, route.max_eval_samples)
    logger.info("validation: the first %d rows of the stream", len(validation))
    return {"validation": validation}, train_stream, example_format


def load_data(route: DataRoute, texts_to_rows: TextsToRows) -> LoadedData:
    """The rows of each split, {split: array-like (rows, row_length)}, as the script's texts_to_rows makes them from
    its texts: blocks, or lines with run_mlm_flax.py --line_by_line; with --streaming the training rows come from a
    stream, returned beside them. Every process holds all rows (memory-mapped) and reads only its rows of each batch.
    A route that names no data gives no rows (run_clm_flax.py --eval_tasks evaluates without)."""
    if not route.names_data():
        return LoadedData({}, None, None)
    with pieces_of(route.preprocessing_piece_mb):
        return load_rows(route, texts_to_rows)


def load_rows(route: DataRoute, texts_to_rows: TextsToRows) -> LoadedData:
    """load_data's rows, from whichever route the arguments name."""
    train_stream = None
    if route.data_mixture:
        return load_mixture(route, texts_to_rows)
    warn_of_files_in_both_splits(route.source)
    if route.packed_data_dir:
        with naming_a_full_disk("--packed_data_dir", route.packed_data_dir):
            rows, example_format = load_packed_corpus(
                route.packed_data_dir,
                route.source,
                texts_to_rows,
                route.streaming,
                route.overwrite_cache,
                route.packed_tokens_per_shard,
            )
        if not (route.do_train or route.do_eval):
            return LoadedData(rows, None, example_format)
    elif route.streaming:
        rows, train_stream, example_format = load_streams(route, texts_to_rows)
    else:
        rows, example_format = cached_rows(route, texts_to_rows)
    rows = final_rows(rows, route, texts_to_rows, example_format)
    if route.do_train and "train" not in rows and train_stream is None:
        raise UsageError("--do_train needs training data, and the data has no train split")
    if route.do_eval and "validation" not in rows:
        raise UsageError("--do_eval needs evaluation data: pass --validation_file or train data to split")
    return LoadedData(rows, train_stream, example_format)


def cached_rows(route: DataRoute, texts_to_rows: TextsToRows) -> tuple[dict, str | None]:
    """The rows of each split of the data files or dataset, from the token cache (packed there first if missing), and
    the format of their examples."""
    # Process 0 packs what the cache lacks; then the others find it there (or, on a cache of their own, pack it).
    cache_dir = route.source.cache_dir or datasets.config.HF_DATASETS_CACHE  # never a user's data directory
    with main_process_first("data prepared"), naming_a_full_disk("--cache_dir", cache_dir):
        evaluation_only = route.do_eval and not route.do_train
        texts, example_format = texts_to_rows.read(route.source, evaluation_only=evaluation_only)
        rows = {
            split: cached_blocks(
                dataset,
                split,
                texts_to_rows.row_function(example_format),
                texts_to_rows.tokenizer,
                texts_to_rows.length_of(example_format),
                cache_dir,
                route.source,
                framing=texts_to_rows.framing_of(example_format, route.source),
                overwrite=route.overwrite_cache,
                tokens_per_shard=route.packed_tokens_per_shard,
            )
            for split, dataset in texts.items()
        }
        return rows, example_format


def final_rows(
    rows: dict, route: DataRoute, texts_to_rows: TextsToRows, example_format, source_name: str = ""
) -> dict:
    """The rows of each split as a run uses them: a validation split held out where there is none and the run
    evaluates, cut to --max_train_samples and --max_eval_samples; refused where empty. `source_name`: whose data it
    is, for the message."""
    if route.do_eval:
        rows = hold_out_blocks(rows, route.validation_split_percentage, source_name)
    if route.max_train_samples is not None and "train" in rows:
        rows["train"] = rows["train"][: route.max_train_samples]
    if route.max_eval_samples is not None and "validation" in rows:
        rows["validation"] = rows["validation"][: route.max_eval_samples]
    for split, split_rows in rows.items():
        if len(split_rows) == 0 and example_format:
            raise UsageError(
                f"the {split} data{source_name} hold no example to train on (the log says which were left out)"
            )
        if len(split_rows) == 0:
            raise UsageError(
                f"the {split} data{source_name} has no non-empty lines"
                if texts_to_rows.framing == "line_by_line"
                else f"the {split} data{source_name} has fewer tokens than one block of {texts_to_rows.row_length}, "
                f"which {texts_to_rows.length_flag} sets; add text or lower it"
            )
    return rows


def load_mixture(route: DataRoute, texts_to_rows: TextsToRows) -> LoadedData:
    """The data of --data_mixture: {"train": a Mixture of the sources with training files, "validation": {source
    name: rows}}, each source's rows made as those of --train_file and --validation_file are (a source without
    validation files has some of its training rows held out)."""
    train_sources, validation = [], {}
    sources = read_mixture(route.data_mixture)
    warn_of_validation_files_trained_on(sources, f"--data_mixture {route.data_mixture}")
    for source in sources:
        source_route = dataclasses.replace(route, source=source_texts(route.source, source), data_mixture=None)
        logger.info("Mixture source %s", source.name)
        try:
            rows, example_format = cached_rows(source_route, texts_to_rows)
        except UsageError as error:  # the message names the files; say whose they are
            raise UsageError(f"--data_mixture {route.data_mixture}, source '{source.name}': {error}") from None
        rows = final_rows(rows, source_route, texts_to_rows, example_format, f" of source '{source.name}'")
        if "train" in rows and route.do_train:
            train_sources.append((source, rows["train"]))
        if "validation" in rows:
            validation[source.name] = rows["validation"]
    mixture_rows = {"validation": validation} if route.do_eval else {}
    if train_sources:
        names, weights = [source.name for source, _ in train_sources], [source.weight for source, _ in train_sources]
        # Padded lines, and examples (padded, or packed with room to spare), are rows rather than tokens.
        rows_are_tokens = texts_to_rows.framing != "line_by_line" and not example_format
        mixture_rows["train"] = Mixture(names, weights, [rows for _, rows in train_sources], rows_are_tokens)
    return LoadedData(mixture_rows, None, example_format)


def count_steps(
    do_train: bool, max_steps: int, num_train_epochs: float, train_rows, train_batch_size: int, length_flag: str
) -> tuple[int | None, int]:
    """Steps per epoch (None without training data of known length) and the run's last step, from --do_train,
    --max_steps and --num_train_epochs; `length_flag` sets the sequence length (--block_size), for the message where
    the data is too small."""
    if not do_train:
        return None, 1
    if train_rows is None:  # a stream
        return None, max_steps
    steps_per_epoch = len(train_rows) // train_batch_size
    if steps_per_epoch == 0:
        raise UsageError(
            f"the training data makes {len(train_rows)} sequences, fewer than one global batch of "
            f"{train_batch_size}; add data or lower --per_device_train_batch_size or {length_flag}"
        )
    if max_steps > 0:
        return steps_per_epoch, max_steps
    return steps_per_epoch, max(1, int(num_train_epochs * steps_per_epoch))


def epoch_batch_indices(
    count: int, global_batch_size: int, seed: int, epoch: int, first_batch: int = 0
) -> Iterator[tuple[int, np.ndarray]]:
    """(batch number, the indices of its rows) of each global batch of one epoch over `count` rows, from batch
    `first_batch` on, in an order fixed by seed and epoch (so a resumed run continues with the very batches it would
    have seen); the rows left over after the last full batch differ from epoch to epoch, so all data is seen. Each
    batch's indices are sorted (for reading memory-mapped rows in order) before a process takes its share, so that the
    global batch, row for row, does not depend on the number of processes."""
    order = np.random.default_rng([seed, epoch]).permutation(count)
    for step in range(first_batch, count // global_batch_size):
        yield step, np.sort(order[step * global_batch_size : (step + 1) * global_batch_size])


def epochs_of_batches(batches_of_epoch, first_step: int, steps_per_epoch: int):
    """The batches from the step after `first_step` on, epoch after epoch; `batches_of_epoch(epoch, first_batch)`."""
    epoch, first_batch = divmod(first_step, steps_per_epoch)
    while True:
        yield from batches_of_epoch(epoch, first_batch)
        epoch, first_batch = epoch + 1, 0


def stream_position(first_step: int, global_batch_size: int, seed: int, ignore_data_skip: bool) -> tuple[int, int]:
    """Where a stream resumes: the batch to start at and the shuffling seed (--seed, --ignore_data_skip)."""
    if first_step and ignore_data_skip:
        logger.warning(
            "--ignore_data_skip: the stream starts afresh, shuffled anew; the data differs from the interrupted run's"
        )
        return 0, seed + first_step
    if first_step:
        logger.warning(
            "Re-reading and re-tokenizing the %d blocks each process trained on before step %d, to continue with the "
            "batches the interrupted run would have seen (--ignore_data_skip starts the stream afresh instead)",
            first_step * global_batch_size // jax.process_count(),
            first_step,
        )
    return first_step, seed


def call_batches(
    batches_and_tokens: Iterator[tuple[dict, int]],
    accumulation_steps: int,
    calls: Iterable[int],
    steps_per_call: int,
    sharding,
):
    """The global batches of each compiled call (`calls`: how many steps each runs), each split into
    `accumulation_steps` micro-batches and stacked into arrays of (steps_per_call, micro-batch, rows, ...) split by
    `sharding`, with the token count of each step; read ahead on a thread. Past a call's last step the arrays hold
    copies of its last batch, which the call never reads, so that every call has the same shapes and runs the same
    compiled code."""

    def stacked():
        for steps in calls:
            batches, tokens = zip(*itertools.islice(batches_and_tokens, steps))
            filled = batches + (batches[-1],) * (steps_per_call - steps)
            stacked = {name: np.stack([batch[name] for batch in filled]) for name in batches[0]}
            micro_batches = {
                name: values.reshape(steps_per_call, accumulation_steps, -1, *values.shape[2:])
                for name, values in stacked.items()
            }
            yield to_global_batch(micro_batches, sharding), list(tokens)

    return prefetch(stacked())


def call_batch_shapes(global_batch: dict, accumulation_steps: int, steps_per_call: int, sharding) -> dict:
    """Shape, dtype and sharding of what call_batches yields for global batches like `global_batch` (arrays, or
    jax.ShapeDtypeStruct, of (rows, ...)) split into `accumulation_steps` micro-batches: what the train step is
    compiled for, before any batch exists."""
    return {
        name: jax.ShapeDtypeStruct(
            (steps_per_call, accumulation_steps, values.shape[0] // accumulation_steps, *values.shape[1:]),
            values.dtype,
            sharding=sharding,
        )
        for name, values in global_batch.items()
    }
