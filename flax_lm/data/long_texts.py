"""A text too long to be made one string (a .txt file read as one document may be larger than memory): its UTF-8
bytes in an Arrow buffer, memory-mapped, decoded a stretch at a time, and cut into the pieces to encode as the whole
string would be cut, without ever holding more than a few pieces of it; and .txt files read as one document each
without reading them into memory."""

import codecs
import os
from collections.abc import Callable, Iterator

import datasets
import numpy as np
import pyarrow
import pyarrow.compute
import xxhash

from flax_lm.data.pieces import page_out_bytes, read_progress

# A long text is decoded this many bytes at a time.
STRETCH_BYTES = 2**20


class LongText:
    """The text in bytes `start` to `stop` of `data` (a buffer of an Arrow string column, memory-mapped from a
    dataset's file or from the text file itself), `characters` long. Read only through `stretches`, which hands the
    pages read back to the kernel as it goes (a mapped file's stay in the file; memory of a table built in memory is
    untouched where there is no swap)."""

    def __init__(self, data: pyarrow.Buffer, start: int, stop: int, characters: int):
        self.data, self.start, self.stop, self.characters = data, start, stop, characters

    def __len__(self) -> int:
        return self.characters

    def startswith(self, prefix: str) -> bool:
        encoded = prefix.encode()
        return self.data.slice(self.start, min(len(encoded), self.stop - self.start)).to_pybytes() == encoded

    def after(self, prefix: str) -> "LongText":
        """The text with `prefix`, which it starts with, left out."""
        start = self.start + len(prefix.encode())
        return LongText(self.data, start, self.stop, self.characters - len(prefix))

    def stretches(self) -> Iterator[str]:
        """The text in order, STRETCH_BYTES of it at a time (a character is never split), each counted in the
        progress of packing as it is read."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        view = memoryview(self.data)
        for first in range(self.start, self.stop, STRETCH_BYTES):
            last = min(first + STRETCH_BYTES, self.stop)
            read_progress.add(last - first, 0)
            yield decoder.decode(view[first:last], final=last == self.stop)
            page_out_bytes(self.data.address + first, self.data.address + last)

    def whole(self) -> str:
        """The text as one string: for a tokenizer that must encode it whole."""
        return "".join(self.stretches())


def long_text_of(column: pyarrow.Array) -> LongText | None:
    """The one text of a string column of one row, as a LongText; None where it is not a text (null, another
    type)."""
    if isinstance(column, pyarrow.ChunkedArray):
        chunks = [chunk for chunk in column.chunks if len(chunk)]
        if len(chunks) != 1:
            return None
        column = chunks[0]
    if (
        not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type))
        or column.null_count  # (column[0] would copy the text into a scalar)
    ):
        return None
    _, offsets, data = column.buffers()
    width = 8 if pyarrow.types.is_large_string(column.type) else 4
    start, stop = (
        int.from_bytes(offsets.slice((column.offset + number) * width, width).to_pybytes(), "little", signed=True)
        for number in (0, 1)
    )
    characters = pyarrow.compute.utf8_length(column)[0].as_py()
    return LongText(data, start, stop, characters)


def documents_of_text_files(files: list[str]) -> datasets.Dataset | None:
    """A dataset of one row for each of the .txt `files`, its whole text, read without reading the files: each row's
    text is its file, memory-mapped (read a stretch at a time when it is tokenized: LongText), so that a file larger
    than memory packs. The text `datasets`' text reader would read, where the files are local, uncompressed UTF-8
    without carriage returns (which that reader turns into line feeds) and under 2 GiB each; None where one is not
    (that reader reads them then, each whole, and refuses one that is not UTF-8)."""
    texts = []
    for path in files:
        if not (os.path.isfile(path) and path.lower().endswith((".txt", ".text"))):
            return None
        size = os.path.getsize(path)
        if size >= 2**31:
            return None
        if size == 0:
            texts.append(pyarrow.array([""]))
            continue
        with pyarrow.memory_map(path) as file:  # the mapping outlives the file, closed here
            data = file.read_buffer()
        text = pyarrow.StringArray.from_buffers(1, pyarrow.py_buffer(np.array([0, size], np.int32).tobytes()), data)
        try:
            text.validate(full=True)  # UTF-8
        except pyarrow.ArrowInvalid:
            return None
        if pyarrow.compute.match_substring(text, "\r")[0].as_py():
            return None
        page_out_bytes(data.address, data.address + size)  # read through once for the checks
        texts.append(text)
    table = pyarrow.table({"text": pyarrow.chunked_array(texts, pyarrow.string())})
    name = xxhash.xxh3_128_hexdigest(" ".join(["text documents", *map(os.path.abspath, files)]).encode())
    return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=name)


def long_text_pieces(
    stretches: Iterator[str],
    piece_characters: int,
    text_piece_characters: int,
    next_cut: Callable[[str, int], int | None],
) -> Iterator[tuple[str, bool, bool]]:
    """The pieces flax_lm.data.texts.document_pieces cuts a long text into, (text, whether it continues the piece
    before, whether the next continues it), from the text's `stretches` read as they are needed: text pieces cut at
    `next_cut(text, start)` (which looks no further than 2 x `text_piece_characters` past `start`, unless the text
    has no cut that near), joined until they make `piece_characters`. Held at a time: the piece being made and the
    stretch of text the next cut is looked for in."""
    window, offset, ended = "", 0, False  # the text read and held: from position `offset` of the whole

    def read_to(end: int):
        nonlocal window, ended
        parts, length = [window], offset + len(window)
        while length < end and not ended:
            stretch = next(stretches, None)
            if stretch is None:
                ended = True
            else:
                parts.append(stretch)
                length += len(stretch)
        window = "".join(parts)

    start = group_start = 0
    started = False
    while True:
        read_to(start + text_piece_characters + 1)
        if offset + len(window) - start <= text_piece_characters:
            break  # the rest is the last text piece
        reach = start + 2 * text_piece_characters + 1
        while True:  # the cut, looked for in the text read so far; no cut found there and more to read: read more
            read_to(reach)
            cut = next_cut(window, start - offset)
            if cut is not None or ended:
                break
            reach = offset + 2 * len(window)
        if cut is None:
            break
        cut += offset
        if start - group_start >= piece_characters:
            yield window[group_start - offset : start - offset], started, True
            window, offset, group_start, started = window[start - offset :], start, start, True
        start = cut
    if start - group_start >= piece_characters:
        yield window[group_start - offset : start - offset], started, True
        window, offset, group_start, started = window[start - offset :], start, start, True
    read_to(float("inf"))
    yield window[group_start - offset :], started, False
