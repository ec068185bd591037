"""Reading texts (local files of several formats, a local dataset directory or a hub dataset; as a dataset or a
stream) and turning them into token ids, in worker processes if asked."""

import glob
import itertools
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from functools import partial

import datasets
import fsspec
import numpy as np
import pyarrow
import pyarrow.compute
import xxhash
from tokenizers import pre_tokenizers

from flax_lm.data.data_files import (
    data_file_paths,
    data_file_patterns,
    files_checksum,
    folder_files,
    folder_holds_text_files,
    is_saved_dataset,
    resolve_data_files,
)
from flax_lm.data.long_texts import LongText, documents_of_text_files, long_text_of, long_text_pieces
from flax_lm.data.pieces import (
    map_in_workers,
    page_out_texts,
    preprocessing,
    read_progress,
    token_trail,
)
from flax_lm.data.source import TextSource
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)


def by_content(dataset, checksum: str):
    """`dataset` with `checksum` (of the bytes it was read from) in its fingerprint. `datasets` fingerprints local
    files by their paths and modification times, so a file rewritten with its old time (cp -p, a build that
    normalises times) would keep the fingerprint; the token cache, named by the fingerprint, and the caches
    `datasets` keeps of the dataset's filters are then those of the bytes read."""
    dataset._fingerprint = xxhash.xxh3_128_hexdigest(f"{dataset._fingerprint} {checksum}".encode())
    return dataset


def content_cache_dir(cache_dir: str | None, checksum: str) -> str:
    """Where `datasets` keeps what it converts of local files of content `checksum` (a folder per content, under
    --cache_dir or its own cache): it finds its conversion by paths and modification times, which a file rewritten
    with its old time keeps, and would read the old content back."""
    return os.path.join(cache_dir or datasets.config.HF_DATASETS_CACHE, "data-files", checksum)


def load_data_files(groups: dict[str, list[str]], split: str, source: TextSource, streaming: bool):
    """One dataset of the files of a split, each format read by its own builder. Files of several formats are
    joined, in the order of `groups`, on the text column alone (their other columns need not agree). Read as a
    dataset, keyed by the files' content (by_content); a stream reads them as they are."""
    text_options = source.text_builder_options()
    parts = []
    for builder, files in groups.items():
        checksum = None if streaming else files_checksum(files)
        part = None
        if builder == "text" and not streaming and text_options["sample_by"] == "document":
            part = documents_of_text_files(files)  # each file one text, never read whole into memory
        if part is None:
            part = datasets.load_dataset(
                builder,
                data_files={split: files},
                split=split,
                cache_dir=source.cache_dir if streaming else content_cache_dir(source.cache_dir, checksum),
                streaming=streaming,
                **(text_options if builder == "text" else {}),
            )
        if not streaming:
            part = by_content(part, checksum)
        if len(groups) > 1:
            column = source.text_column_name
            if part.column_names is not None and column not in part.column_names:
                raise UsageError(
                    f"the {builder} files of the {split} data ({', '.join(files)}) have no column '{column}' (they "
                    f"have: {', '.join(part.column_names)}); pass --text_column_name"
                )
            part = part.select_columns([column])
            # CSV reads text as Arrow's large_string, the other builders as string, and Arrow joins neither mix:
            # a dataset is cast; a stream (whose types are known only once read) passes its rows through Python.
            if streaming:
                part = part.map(lambda row: row)
            elif part.features[column] == datasets.Value("large_string"):
                part = part.cast_column(column, datasets.Value("string"))
        parts.append(part)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_text_datasets(source: TextSource, streaming: bool = False, evaluation_only: bool = False) -> dict:
    """The train and validation splits `source` names, as they are (no validation split is held out
    here): `datasets.Dataset`s, or with `streaming` `datasets.IterableDataset`s that read the files (or the hub) as
    they are iterated. Each row is one document. Each split's files are read with the builder of their own format.
    With `evaluation_only`, the validation split alone when there is one: the training files are not even read."""
    text_options = source.text_builder_options()
    try:
        if source.dataset_name is not None:
            name = source.dataset_name
            if os.path.isdir(name) and is_saved_dataset(name):
                raw = datasets.load_from_disk(name)
                if streaming:
                    raw = {"train": raw} if isinstance(raw, datasets.Dataset) else raw
                    raw = {split: dataset.to_iterable_dataset() for split, dataset in raw.items()}
            else:
                holds_text_files = os.path.isdir(name) and folder_holds_text_files(name)
                # A local folder of data files is keyed by its files' content, as --train_file is.
                checksum = None if streaming or not os.path.isdir(name) else files_checksum(folder_files(name))
                raw = datasets.load_dataset(
                    name,
                    source.dataset_config_name,
                    cache_dir=source.cache_dir if checksum is None else content_cache_dir(source.cache_dir, checksum),
                    token=source.token,
                    streaming=streaming,
                    **(text_options if holds_text_files else {}),
                )
                if checksum is not None:
                    raw = (
                        by_content(raw, checksum)
                        if isinstance(raw, datasets.Dataset)
                        else datasets.DatasetDict({split: by_content(part, checksum) for split, part in raw.items()})
                    )
        else:
            raw = {}
            for split, flag in (("train", "train_file"), ("validation", "validation_file")):
                patterns = data_file_patterns(getattr(source, flag))
                if not patterns or (split == "train" and evaluation_only and source.validation_file):
                    continue
                groups = resolve_data_files(patterns, flag)
                try:
                    raw[split] = load_data_files(groups, split, source, streaming)
                except DATA_READ_ERRORS as error:
                    raise unreadable_data_error(error, split, source) from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as error:
        raise UsageError(f"cannot load the dataset: {error}") from None
    except ConnectionError as error:
        raise UsageError(
            f"cannot load --dataset_name {source.dataset_name}: {error}; it is not in the cache (--cache_dir), "
            "so load it once online, or pass local files with --train_file"
        ) from None
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, ValueError) as error:
        if str(error).startswith(("BuilderConfig", "Config name is missing")):  # raised before any file is read
            raise UsageError(
                f"cannot load --dataset_name {source.dataset_name} with --dataset_config_name "
                f"{source.dataset_config_name}: {' '.join(str(error).splitlines()[:2])}; pass one of those "
                "configurations with --dataset_config_name"
            ) from None
        cause = error.__cause__ or error
        raise UsageError(
            f"cannot read the data files ({type(cause).__name__}: {cause}); check their format and encoding"
        ) from None
    if isinstance(raw, (datasets.Dataset, datasets.IterableDataset)):
        raw = {"train": raw}
    used = ("validation",) if evaluation_only and "validation" in raw else ("train", "validation")
    raw = {split: dataset for split, dataset in raw.items() if split in used}
    # Examples (prompt/completion, conversations), and splits of two formats, are told apart, checked and refused
    # where they must be by flax_lm.data.finetune_examples.example_format, row by row as they are encoded.
    if not all(holds_plain_text(dataset, split, source) for split, dataset in raw.items()):
        return raw
    for split, dataset in raw.items():
        columns = dataset.column_names  # None for a stream whose columns are only known once read
        if columns is not None and source.text_column_name not in columns:
            raise UsageError(
                f"the {split} data has no column '{source.text_column_name}' (it has: {', '.join(columns)}); "
                "pass --text_column_name"
            )
    return {split: rows_with_text(dataset, split, source) for split, dataset in raw.items()}


def columns_of(dataset) -> list[str]:
    """The columns of a dataset, or of a stream's first row where the stream does not know them."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset), {}))


def holds_plain_text(dataset, split: str, source: TextSource) -> bool:
    """Whether a split holds plain text: always where `source` reads no examples; otherwise where it has the text
    column and no columns of examples were named (--prompt_column, --completion_column)."""
    if source.examples is None:
        return True
    if source.examples.prompt_column is not None or source.examples.completion_column is not None:
        return False
    try:  # a stream's first row is read here
        return source.text_column_name in columns_of(dataset)
    except DATA_READ_ERRORS as error:
        raise unreadable_data_error(error, split, source) from None


# What the readers of `datasets` raise for a data file they cannot parse (pyarrow's for JSON, as a stream reads it).
DATA_READ_ERRORS = (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, pyarrow.ArrowInvalid)


def unreadable_data_error(error: Exception, split: str, source: TextSource) -> UsageError:
    """The one line for a split whose files a reader refused: where a JSON file is not JSON, its name and line (the
    reader's own message counts rows from the start of the block it was reading, not of the file, and names no
    file); otherwise the reader's message."""
    flag = {"train": "train_file", "validation": "validation_file"}[split]
    json_files = resolve_data_files(getattr(source, flag), flag).get("json", []) if getattr(source, flag) else []
    for path in json_files:
        if problem := first_line_not_json(path):
            return UsageError(f"cannot read the {split} data: {problem}; fix or remove that line")
    cause = error.__cause__ or error
    return UsageError(
        f"cannot read the {split} data ({type(cause).__name__}: {cause}); check the format and encoding of "
        f"{text_source(split, source)}"
    )


def first_line_not_json(path: str) -> str | None:
    """Where a JSON Lines file (compressed or not) stops being JSON, in words: "line 41 of PATH is not JSON (...)".
    None where every line is, or where the file is one JSON document (an array, say) that parses as a whole."""
    with fsspec.open(path, "rb", compression="infer") as file:
        first_line = True
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except UnicodeDecodeError:
                return f"line {number} of {path} is not UTF-8 text"
            except json.JSONDecodeError as error:
                if first_line:  # maybe one document over many lines rather than JSON Lines
                    return first_document_error(path)
                return f"line {number} of {path} is not JSON ({json_error_in_words(error)})"
            first_line = False
    return None


def first_document_error(path: str) -> str | None:
    """What is wrong with a file read as one JSON document, with its line; None where it parses."""
    with fsspec.open(path, "rb", compression="infer") as file:
        content = file.read()
    try:
        json.loads(content)
    except UnicodeDecodeError:
        return f"{path} is not UTF-8 text"
    except json.JSONDecodeError as error:
        return f"line {error.lineno} of {path} is not JSON ({json_error_in_words(error)})"
    return None


def json_error_in_words(error: json.JSONDecodeError) -> str:
    return f"{error.msg.removesuffix(' at')} at character {error.colno}"  # "Unterminated string starting at ..."


def warn_of_files_in_both_splits(source: TextSource):
    """Warn where --train_file and --validation_file name a file in common (a mixture's sources are checked as the
    mixture file is read)."""
    if source.train_file is None or source.validation_file is None:
        return
    train_files, validation_files = map(data_file_paths, (source.train_file, source.validation_file))
    if shared := sorted(train_files & validation_files):
        logger.warning(
            "--train_file and --validation_file share %s: the evaluation measures how well the model remembers its "
            "training texts, not how it does on new text",
            ", ".join(shared),
        )


def text_source(split: str, source: TextSource) -> str:
    """Where the texts of a split come from, as the user named them, for messages about a row."""
    patterns = data_file_patterns({"train": source.train_file, "validation": source.validation_file}.get(split))
    if not patterns:
        return f"the {split} split of --dataset_name {source.dataset_name}"
    if len(patterns) > 1:
        return f"the files of {' '.join(patterns)} (counted through them in the order read, a format after another)"
    if glob.has_magic(patterns[0]):
        return f"the files of {patterns[0]} (counted through them in sorted order)"
    return patterns[0]


def rows_with_text(dataset, split: str, source: TextSource):
    """The dataset without rows whose text is missing or null: such a row is refused in one line naming its file
    and row, or with --skip_missing_texts left out and counted in the log. A column of other values than strings
    is refused. A stream is checked lazily, batch by batch as it is read."""
    column, skip = source.text_column_name, source.skip_missing_texts

    def not_text(type_name: str) -> UsageError:
        return UsageError(
            f"column '{column}' of {text_source(split, source)} holds {type_name} values, not text; "
            "pass the column of texts with --text_column_name"
        )

    def missing_text(row: int) -> UsageError:
        return UsageError(
            f"row {row + 1} of {text_source(split, source)} has no text (its '{column}' is missing or null); "
            "fix the data, or pass --skip_missing_texts to leave such rows out"
        )

    if isinstance(dataset, datasets.IterableDataset):

        def keep(batch, rows):
            if column not in batch:  # token_arrays names the missing column
                return [True] * len(rows)
            kept = []
            for text, row in zip(batch[column], rows):
                if text is not None and not isinstance(text, str):
                    raise not_text(type(text).__name__)
                if text is None and not skip:
                    raise missing_text(row)
                kept.append(text is not None)
            if not all(kept):
                logger.warning(
                    "%s: left out %d rows without text, the first at row %d of %s",
                    split,
                    kept.count(False),
                    rows[kept.index(False)] + 1,
                    text_source(split, source),
                )
            return kept

        return dataset.filter(keep, with_indices=True, batched=True, batch_size=TEXTS_PER_BATCH)
    column_type = dataset.features[column]
    if getattr(column_type, "dtype", None) not in ("string", "large_string", "string_view", "null"):
        raise not_text(getattr(column_type, "dtype", type(column_type).__name__))
    texts = dataset.data.column(column)
    if texts.null_count == 0:
        return dataset
    missing = texts.is_null().to_numpy(zero_copy_only=False)
    if not skip:
        raise missing_text(int(np.argmax(missing)))
    logger.warning(
        "%s: left out %d of %d rows without text, the first at row %d of %s",
        split,
        int(missing.sum()),
        len(dataset),
        int(np.argmax(missing)) + 1,
        text_source(split, source),
    )
    # Kept in memory (an index of the kept rows): written beside the dataset, it would land in a directory of
    # save_to_disk that is the user's.
    return dataset.filter(
        lambda texts: [text is not None for text in texts],
        input_columns=column,
        batched=True,
        keep_in_memory=True,
        desc=f"Leaving out {split} rows without text",
    )


def check_tokenizer_encodes(tokenizer, text_datasets: dict, source: TextSource):
    """Refuse a tokenizer that turns the first texts of the data into nothing, or into unknown tokens only: a model
    trained on that learns nothing of the texts while its loss looks like training. Reading a stream starts here, so
    files it cannot read are refused here too."""
    text_column = source.text_column_name
    for split, dataset in text_datasets.items():
        try:
            first_texts = text_starts(dataset, text_column)
        except DATA_READ_ERRORS as error:
            raise unreadable_data_error(error, split, source) from None
        texts = [text for text in first_texts if text and not text.isspace()]
        if not texts:
            continue
        ids = [
            token
            for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            for token in encoding.ids
        ]
        if not ids or set(ids) == {tokenizer.unk_token_id}:
            outcome = "no tokens" if not ids else f"only the unknown token {tokenizer.unk_token}"
            raise UsageError(
                f"the tokenizer {tokenizer.name_or_path} cannot encode the {split} data: its first {len(texts)} "
                f"texts give {outcome}; pass a tokenizer trained on such text (train_tokenizer.py makes one)"
            )


def text_starts(dataset, text_column: str) -> list:
    """The first 1,000 characters of each of the first 100 texts. The start of each text is enough: a .txt file read
    as one document may be gigabytes long, and every run waits for this (1,000 characters of 100 files of Python
    encode in 0.02 s; 10,000 took 0.17 s). Of a dataset, cut in Arrow, so that only the starts become Python
    strings, never 100 whole documents."""
    if isinstance(dataset, datasets.Dataset) and text_column in dataset.column_names:
        column = dataset.select_columns([text_column]).with_format("arrow")[:100].column(text_column)
        if pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type):
            return pyarrow.compute.utf8_slice_codeunits(column, 0, 1_000).to_pylist()
    first_texts = next(dataset.iter(batch_size=100), {}).get(text_column, [])
    return [text[:1_000] if isinstance(text, str) else text for text in first_texts]


TEXTS_PER_BATCH = 1000


BYTE_ORDER_MARK = "\ufeff"


def without_byte_order_marks(texts: list, where: str) -> list:
    """The texts with the byte-order mark (U+FEFF) that starts a file saved as "UTF-8 with BOM" taken off: it names
    the encoding and is no part of the text (the text reader keeps it). Each one dropped is noted in the log."""

    def marked(text) -> bool:
        return isinstance(text, (str, LongText)) and text.startswith(BYTE_ORDER_MARK)

    if not (count := sum(map(marked, texts))):
        return texts
    logger.info("%s: dropped the byte-order mark (U+FEFF) at the start of %d text(s)", where, count)
    return [
        (text.after(BYTE_ORDER_MARK) if isinstance(text, LongText) else text[1:]) if marked(text) else text
        for text in texts
    ]


def stream_batches(stream, columns) -> Iterator[dict]:
    """The rows of a stream as {column: values}, TEXTS_PER_BATCH rows or a piece (Preprocessing) of `columns`' text at
    a time, whichever comes first: a stream of a few long documents, read pass after pass without end
    (flax_lm.data.loading.streaming_train_batches), is then tokenized a pass or so at a time, not a thousand
    documents at once."""

    def batch(rows: list[dict]) -> dict:  # a column some rows lack holds None there, as `datasets` batches it
        read_progress.add(characters, len(rows))
        return {name: [row.get(name) for row in rows] for name in dict.fromkeys(itertools.chain(*rows))}

    rows, characters = [], 0
    for row in stream:
        rows.append(row)
        characters += sum(len(row[column]) for column in columns if isinstance(row.get(column), str))
        if len(rows) == TEXTS_PER_BATCH or characters >= preprocessing.piece_characters:
            yield batch(rows)
            rows, characters = [], 0
    if rows:
        yield batch(rows)


def column_batches(
    dataset, columns, split: str, column_flag: str | None = None, long_texts: bool = False
) -> Iterator[dict]:
    """The rows of a dataset or a stream in order, as {column: values}, TEXTS_PER_BATCH rows or a piece of text
    (Preprocessing, --preprocessing_piece_mb) at a time, whichever comes first; a row larger than a piece alone.
    Of `columns` only where a dataset can leave the others unread. A file the reader cannot parse, or a missing
    column (with the flag that names it, `column_flag`), ends the command in one line. With `long_texts`, a
    dataset's text longer than a piece comes as a LongText, read a stretch at a time, rather than as one string."""
    if isinstance(dataset, datasets.Dataset):
        batches = dataset_batches(dataset, columns, long_texts)
    else:
        batches = stream_batches(dataset, columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except DATA_READ_ERRORS as error:
            cause = error.__cause__ or error
            # Arrow counts its row from the start of the block it was reading, which no user could find.
            message = re.sub(r"\s*in row \d+$", "", str(cause))
            raise UsageError(
                f"cannot read the {split} data ({type(cause).__name__}: {message}); check the format and encoding "
                "of its files"
            ) from None
        if missing := [column for column in columns if column not in batch]:
            fix = f"; pass {column_flag}" if column_flag else ""
            raise UsageError(f"the {split} data has no column '{missing[0]}' (it has: {', '.join(batch)}){fix}")
        yield batch


def dataset_batches(dataset: datasets.Dataset, columns, long_texts: bool = False) -> Iterator[dict]:
    """The rows of a dataset as {column: values}, read as Arrow (memory-mapped, nothing copied) TEXTS_PER_BATCH rows
    at a time and made Python values a piece at a time: so a batch of long documents is never in memory whole. The
    other columns are not even read. With `long_texts`, a text of more characters than a piece, alone in its batch,
    comes as a LongText: never one string."""
    selected = dataset.select_columns(list(columns))
    tables = selected.with_format("arrow").iter(batch_size=TEXTS_PER_BATCH)
    for table in tables:
        sizes = np.zeros(table.num_rows, np.int64)
        for column in table.itercolumns():
            if pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type):
                sizes += pyarrow.compute.binary_length(column).fill_null(0).to_numpy()
        start = 0
        while start < table.num_rows:
            stop = start + max(
                1, int(np.searchsorted(np.cumsum(sizes[start:]), preprocessing.piece_characters, "right"))
            )
            piece = table.slice(start, stop - start)
            long_text = None
            if (
                long_texts
                and len(columns) == 1
                and stop - start == 1
                and sizes[start] > preprocessing.piece_characters
            ):
                long_text = long_text_of(piece.column(0))
            if long_text is not None and len(long_text) > preprocessing.piece_characters:
                read_progress.add(0, 1)  # its bytes as they are read (LongText.stretches)
                yield {columns[0]: [long_text]}
            else:  # decoded as datasets' Python format does: rows of differing structure are kept as Json (messages)
                read_progress.add(int(sizes[start:stop].sum()), stop - start)
                yield selected.features.decode_batch(piece.to_pydict())
            page_out_texts(piece)  # a mapped file's pages (a table built in memory: nothing, without swap)
            start = stop


def text_batches(dataset, text_column: str, split: str, long_texts: bool = False) -> Iterator[list]:
    """The texts of a dataset or a stream, TEXTS_PER_BATCH at a time, in order (byte-order marks dropped); with
    `long_texts`, a text longer than a piece of a dataset as a LongText (column_batches)."""
    for batch in column_batches(dataset, [text_column], split, "--text_column_name", long_texts):
        yield without_byte_order_marks(batch[text_column], split)


# A long text (a .txt file read as one document) is encoded in pieces of about this many characters, this many
# pieces at a time: encoding holds ~300 bytes of memory per token until it returns, and one text uses one core.
TEXT_PIECE_CHARACTERS = 2**18


TEXT_PIECES_AT_ONCE = 16


# Where a line that ends in a visible character is followed by one that starts with one; in a text without such
# line breaks (one long line), where a word follows a visible character and one space.
LINE_START = re.compile(r"(?<=\S\n)(?=\S)")
WORD_START = re.compile(r"(?<=\S)(?= \S)")


def next_cut(text: str, start: int) -> int | None:
    """Where the piece of `text` from `start` ends: at the first line start of the stretch of TEXT_PIECE_CHARACTERS
    after the piece's own, else at the first word start there, else at the next word start at all (a text with no
    space for that long); None where the rest of the text has none."""
    after, before = start + TEXT_PIECE_CHARACTERS, start + 2 * TEXT_PIECE_CHARACTERS
    cut = LINE_START.search(text, after, before) or WORD_START.search(text, after, before)
    cut = cut or WORD_START.search(text, before)
    return None if cut is None else cut.start()


def text_pieces(text: str) -> list[str]:
    """`text` cut at next_cut into pieces of about TEXT_PIECE_CHARACTERS or more (itself, when shorter)."""
    return list(lazy_text_pieces(text))


def lazy_text_pieces(text: str) -> Iterator[str]:
    """The pieces of text_pieces, one at a time: a long document is never copied whole."""
    start = 0
    while len(text) - start > TEXT_PIECE_CHARACTERS:
        cut = next_cut(text, start)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def cuts_at_line_starts_keep_the_tokens(backend) -> bool:
    """Whether encoding a text in pieces cut at LINE_START or WORD_START gives the tokens of the whole text: so for
    the byte-level pre-tokenizer of GPT-2 and RoBERTa (no piece it makes spans such a line break, or a space between
    a visible character and a word, which starts a piece of its own) with no normalizer and no prefix space; not
    assumed for any other tokenizer."""
    settings = json.loads(backend.to_str())
    pre_tokenizer = settings.get("pre_tokenizer") or {}
    return (
        settings.get("normalizer") is None
        and pre_tokenizer.get("type") == "ByteLevel"
        and pre_tokenizer.get("use_regex", True)
        and not pre_tokenizer.get("add_prefix_space", False)
    )


def encode_texts(backend, texts: list[str], cut_long_texts: bool) -> list[list[int]]:
    """The token ids of each text, without special tokens; long texts in pieces when `cut_long_texts`."""
    if not cut_long_texts or all(len(text) <= TEXT_PIECE_CHARACTERS for text in texts):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    token_lists = []
    for text in texts:
        pieces = text_pieces(text)
        ids = []
        for first in range(0, len(pieces), TEXT_PIECES_AT_ONCE):
            group = pieces[first : first + TEXT_PIECES_AT_ONCE]
            for encoding in backend.encode_batch_fast(group, add_special_tokens=False):
                ids.extend(encoding.ids)
        token_lists.append(ids)
    return token_lists


def encode_documents(backend, around: tuple, cut_long_texts: bool, piece: tuple) -> np.ndarray:
    """The tokens of a piece of texts (document_pieces), each between the ids `around` it (before, after), end to end:
    one flat int32 array. Where the piece starts inside a document, its first text has no ids before it; where it
    ends inside one, its last has none after."""
    texts, starts_inside, ends_inside = piece
    (before, after), last = around, len(texts) - 1
    token_lists = [
        (before if number or not starts_inside else []) + ids + (after if number < last or not ends_inside else [])
        for number, ids in enumerate(encode_texts(backend, texts, cut_long_texts))
    ]
    return np.fromiter(itertools.chain.from_iterable(token_lists), np.int32, sum(map(len, token_lists)))


def document_pieces(batches: Iterable[list], cut_long_texts: bool) -> Iterator[tuple[list[str], bool, bool]]:
    """The texts of `batches` (column_batches: a piece or less of text each, or one longer text, maybe a LongText) as
    pieces to encode apart: (texts, whether the first continues a document of the piece before, whether the last goes
    on in the next). A text longer than a piece is cut where text_pieces cuts it into pieces of about a piece
    (Preprocessing), where cutting keeps the tokens (`cut_long_texts`); otherwise it is encoded whole. A LongText is
    cut the same, read as it is cut (long_text_pieces)."""
    for texts in batches:
        if not (cut_long_texts and len(texts) == 1 and len(texts[0]) > preprocessing.piece_characters):
            yield [text.whole() if isinstance(text, LongText) else text for text in texts], False, False
            continue
        if isinstance(texts[0], LongText):
            stretches = texts[0].stretches()
            pieces = long_text_pieces(stretches, preprocessing.piece_characters, TEXT_PIECE_CHARACTERS, next_cut)
            yield from (([text], started, goes_on) for text, started, goes_on in pieces)
            continue
        group, size, started = [], 0, False  # text pieces of the document that make one piece to encode
        for text_piece in lazy_text_pieces(texts[0]):
            if size >= preprocessing.piece_characters:
                yield ["".join(group)], started, True
                group, size, started = [], 0, True
            group.append(text_piece)
            size += len(text_piece)
        yield ["".join(group)], started, False


def ids_around_documents(tokenizer) -> tuple[list[int], list[int]]:
    """The ids before and after the tokens of each document: the special tokens the tokenizer puts around one text
    (a Llama tokenizer's BOS before it, as Llama models were trained; a GPT-2 tokenizer's none), and its end-of-text
    token after it where the tokenizer puts none there."""
    backend = tokenizer.backend_tokenizer
    plain = backend.encode("x", add_special_tokens=False).ids
    framed = backend.encode("x", add_special_tokens=True).ids
    starts = [index for index in range(len(framed) - len(plain) + 1) if framed[index : index + len(plain)] == plain]
    before, after = (framed[: starts[0]], framed[starts[0] + len(plain) :]) if starts else ([], [])
    if not after or after[-1] != tokenizer.eos_token_id:
        after = after + [tokenizer.eos_token_id]
    return before, after


def token_arrays(
    dataset, tokenizer, text_column, num_workers=None, split="train", around=None
) -> Iterator[np.ndarray]:
    """The tokens of every text of `dataset` (a `datasets.Dataset` or a stream), each text (a document) between the
    ids `around` it (before, after; by default nothing before and EOS after), as flat int32 arrays of a piece of text
    each (--preprocessing_piece_mb; document_pieces), in the dataset's order, tokenized in `num_workers` processes
    (map_in_workers). Only a few pieces are in memory at a time, and the arrays are the same for any number of
    workers. Where a packing run interrupted goes on (TokenTrail), the stream starts at the recorded point, the pieces
    before it read but not tokenized."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise UsageError("the tokenizer has no end-of-text token; set eos_token in its tokenizer_config.json")
    # The Rust tokenizer directly: the transformers wrapper would also build attention masks and warn
    # about texts longer than model_max_length, which is expected here since texts get packed.
    backend = tokenizer.backend_tokenizer
    around = around or ([], [eos_id])
    cut_long_texts = cuts_at_line_starts_keep_the_tokens(backend)
    encode = partial(encode_documents, backend, around, cut_long_texts)
    work = document_pieces(text_batches(dataset, text_column, split, long_texts=True), cut_long_texts)
    cuts = [preprocessing.piece_characters, TEXT_PIECE_CHARACTERS, TEXTS_PER_BATCH, cut_long_texts]
    first_piece, skipped = token_trail.start_for(split, cuts)  # where a packing run interrupted goes on
    for tokens in map_in_workers(encode, itertools.islice(work, first_piece, None), num_workers):
        tokens = tokens[skipped:]
        token_trail.handed_on(split, tokens, skipped)
        yield tokens
        skipped = 0


def token_byte_counts(tokenizer, vocab_size: int) -> np.ndarray | None:
    """The UTF-8 bytes of text each id stands for, float32 (vocab_size,), or None where that is not fixed.

    Byte-level BPE tokens are fixed byte strings, one character of the byte alphabet per byte; special tokens
    (EOS) stand for no text. Other tokenizers (WordPiece, SentencePiece) add or drop spaces when decoding, so
    their tokens have no fixed byte count.
    """
    backend = tokenizer.backend_tokenizer
    if (json.loads(backend.to_str()).get("decoder") or {}).get("type") != "ByteLevel":
        return None
    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    counts = np.zeros(vocab_size, np.float32)
    for token, token_id in backend.get_vocab(with_added_tokens=False).items():
        if not set(token) <= byte_alphabet:
            return None
        counts[token_id] = len(token)
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token_id < vocab_size:
            counts[token_id] = 0 if token.special else len(token.content.encode("utf-8"))
    return counts
