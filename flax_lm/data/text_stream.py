"""Reading a whole corpus once, as batches of texts with counts of what was read (train_tokenizer.py): local files
(.txt by line, the others by row; named as the training scripts take them), a directory written by `save_to_disk`,
or a dataset of the hub or a local folder, streamed so that a corpus larger than memory works."""

import os
from dataclasses import dataclass

import datasets

from flax_lm.data.data_files import is_saved_dataset, resolve_data_files
from flax_lm.data.source import TextSource
from flax_lm.data.texts import TEXTS_PER_BATCH, text_pieces, without_byte_order_marks
from flax_lm.errors import UsageError, first_line


@dataclass
class ReadCounts:
    """What the reader has read so far."""

    texts: int = 0
    characters: int = 0
    bytes: int = 0
    first_text: str | None = None  # the first with more than whitespace
    missing_texts: int = 0  # rows left out by --skip_missing_texts


def open_text_sources(source: TextSource, split: str = "train"):
    """The datasets to read, each as (description, dataset, column name, number of rows or None): `source`'s
    train_file (its .txt files read by `source.text_builder_options()`, their column always "text") or the `split`
    of its dataset_name.

    Local files are streamed; a directory written by `save_to_disk` is memory-mapped. Either way the text is read
    in batches and never held in memory all at once.
    """
    if source.train_file and source.dataset_name:
        raise UsageError("pass either --train_file or --dataset_name, not both")
    if not source.train_file and not source.dataset_name:
        raise UsageError("no input: pass text files with --train_file or a dataset with --dataset_name")

    if source.train_file:
        sources = []
        for builder, files in resolve_data_files(source.train_file, "train_file").items():
            description = files[0] if len(files) == 1 else f"{len(files)} {builder} files"
            options = source.text_builder_options() if builder == "text" else {}
            try:
                dataset = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **options)
            except (OSError, ValueError) as error:
                raise UsageError(f"cannot read {description}: {first_line(error)}") from None
            # Text files have one column, "text", holding their lines.
            column = "text" if builder == "text" else source.text_column_name
            sources.append((description, dataset, column, None))
        return sources

    name = source.dataset_name
    if os.path.isdir(name) and is_saved_dataset(name):
        try:
            dataset = datasets.load_from_disk(name)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load the saved dataset {name}: {first_line(error)}") from None
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise UsageError(f"--dataset_split {split} is not in {name}; it has: {', '.join(dataset)}")
            dataset = dataset[split]
        return [(name, dataset, source.text_column_name, dataset.num_rows)]

    where = "the local directory" if os.path.isdir(name) else "the dataset"
    try:
        dataset = datasets.load_dataset(name, source.dataset_config_name, split=split, streaming=True)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"cannot load {where} {name} (--dataset_name): {first_line(error)}; check the name and split, "
            "or pass local files with --train_file"
        ) from None
    return [(name, dataset, source.text_column_name, None)]


def counted_text_batches(sources, counts, max_texts=None, max_characters=None, skip_missing_texts=False):
    """Yield lists of up to TEXTS_PER_BATCH non-empty strings from all sources (long texts in text_pieces), updating
    `counts` as it goes, up to `max_texts` texts or `max_characters` characters.

    A row whose text is missing or null is refused, naming the source and the row, or with `skip_missing_texts`
    left out and counted."""
    for description, dataset, column, _ in sources:
        rows = iter(dataset.iter(batch_size=TEXTS_PER_BATCH))
        row = 0
        while True:
            try:
                batch = next(rows)
            except StopIteration:
                break
            except (OSError, ValueError) as error:
                # What the json, csv, parquet and text readers raise for a malformed or undecodable file.
                raise UsageError(f"cannot read {description}: {first_line(error)}") from None
            if column not in batch:
                available = ", ".join(batch) or "none"
                raise UsageError(
                    f"no column '{column}' in {description} (columns there: {available}); "
                    "pass the text column with --text_column_name"
                )
            texts = []
            for text in without_byte_order_marks(batch[column], description):
                row += 1
                if text is None and not skip_missing_texts:
                    raise UsageError(
                        f"row {row} of {description} has no text (its '{column}' is missing or null); "
                        "fix the data, or pass --skip_missing_texts to leave such rows out"
                    )
                if text is None:
                    counts.missing_texts += 1
                    continue
                if text == "":
                    continue
                if not isinstance(text, str):
                    raise UsageError(
                        f"column '{column}' of {description} holds {type(text).__name__} values, not text; "
                        "pass the text column with --text_column_name"
                    )
                if max_characters is not None:
                    text = text[: max_characters - counts.characters]
                # The byte-level pre-tokenizer gives the pieces the words of the whole text, in bounded memory.
                texts.extend(text_pieces(text))
                counts.texts += 1
                counts.characters += len(text)
                counts.bytes += len(text.encode("utf-8"))
                if counts.first_text is None and not text.isspace():
                    counts.first_text = text
                if counts.texts == max_texts or counts.characters == max_characters:
                    yield texts
                    return
            if texts:
                yield texts
