"""How texts are tokenized at scale: a piece of text at a time (memory that does not grow with the corpus), in
worker processes whose results come back in order, with the progress shown."""

import collections
import concurrent.futures
import contextlib
import ctypes
import datetime
import logging
import mmap
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import datasets
import numpy as np
import pyarrow
import pyarrow.compute
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass
class Preprocessing:
    """How texts are tokenized: `piece_characters` of text are read, tokenized and packed at a time
    (--preprocessing_piece_mb), so that memory holds a few pieces per worker process whatever the size of the corpus;
    with --preprocessing_num_workers unset, worker processes start after `seconds_before_workers` of tokenizing here,
    so that a small corpus never waits for them. Neither changes the tokens, so both are held here rather than in
    constants, which the token cache's key (flax_lm.data.cache_key) follows."""

    piece_characters: int = 2**20
    seconds_before_workers: float = 5.0


preprocessing = Preprocessing()


@contextlib.contextmanager
def pieces_of(megabytes: float | None):
    """Texts read in pieces of `megabytes` (None: the default) within the block."""
    held = preprocessing.piece_characters
    preprocessing.piece_characters = max(1, int(megabytes * 2**20)) if megabytes else held
    try:
        yield
    finally:
        preprocessing.piece_characters = held


@dataclass
class ReadProgress:
    """How much text the readers have handed on since `reset`: what the progress of packing shows."""

    characters: int = 0
    texts: int = 0

    def add(self, characters: int, texts: int):
        self.characters += characters
        self.texts += texts

    def reset(self):
        self.characters = self.texts = 0


read_progress = ReadProgress()


class TokenTrail:
    """Where the token stream of the split being packed (token_arrays' arrays, end to end) stands in its texts,
    piece by piece: what a packing run records with each shard it finishes (point_after), so that the run that goes
    on after an interruption starts reading the texts at the piece the shard ends in rather than tokenizing
    everything before it again (flax_lm.data.packed.write_packed_corpus). Only the last few pieces are held, and a
    point is recorded only where the shard's last row is found to be those very tokens (rows cut from the stream,
    as the scripts' pack_blocks cuts them; other rows, examples and lines, are never resumed this way)."""

    held_pieces = 4

    def __init__(self):
        self.begin(None, None)

    def begin(self, split: str | None, start: dict | None):
        """Follow the pieces of `split` from here on; `start`: a point_after an interrupted run recorded, where the
        stream is to start (taken by start_for), or None: from the first piece."""
        self.split, self.start, self.taken, self.cuts = split, start, False, None
        self.pieces = self.tokens = 0  # pieces handed on, and the tokens of the stream up to the end of the last
        # (piece number, where it starts in the stream, its tokens handed on, how many of its first were dropped)
        self.recent = collections.deque(maxlen=self.held_pieces)

    def start_for(self, split: str, cuts: list) -> tuple[int, int]:
        """(pieces to read past without tokenizing them, tokens of the next piece to drop) for the token stream of
        `split` whose pieces are cut by the settings `cuts`: from a recorded point, where it was recorded for the
        same cuts; (0, 0) otherwise."""
        if split != self.split:
            return 0, 0
        self.cuts = cuts
        if self.start is None or self.start.get("cuts") != cuts:
            return 0, 0
        self.taken = True
        self.pieces, self.tokens = self.start["piece"], self.start["piece_start"]
        return self.start["piece"], self.start["skip_tokens"]

    def handed_on(self, split: str, tokens: np.ndarray, skipped: int = 0):
        """Told of each piece's tokens as they are handed on (the first `skipped` of them dropped)."""
        if split == self.split:
            self.recent.append((self.pieces, self.tokens, tokens, skipped))
            self.pieces, self.tokens = self.pieces + 1, self.tokens + skipped + len(tokens)

    def point_after(self, split: str, end: int, last_row: np.ndarray) -> dict | None:
        """Where the stream goes on after its first `end` tokens, whose last ones are `last_row`: the piece they end
        in and the tokens of it before that; None where that piece is no longer held or the row is not those
        tokens."""
        if split != self.split or self.cuts is None or last_row.ndim != 1 or not self.recent or end > self.tokens:
            return None
        _, first, _, skipped = self.recent[0]
        held_from = first + skipped  # where the tokens held start in the stream
        if end - len(last_row) < held_from:
            return None
        held = np.concatenate([tokens for _, _, tokens, _ in self.recent])
        if not np.array_equal(held[end - len(last_row) - held_from : end - held_from], last_row):
            return None
        if end == self.tokens:  # at the end of the last piece handed on: the next one starts there
            return {"piece": self.pieces, "piece_start": end, "skip_tokens": 0, "cuts": self.cuts}
        number, first = [(number, first) for number, first, _, _ in self.recent if first <= end][-1]
        return {"piece": number, "piece_start": first, "skip_tokens": end - first, "cuts": self.cuts}


token_trail = TokenTrail()


def page_out_texts(table: pyarrow.Table):
    """Let the kernel take back the pages of memory-mapped Arrow files that hold the texts of `table`, read once
    and not needed again: resident pages of a mapped file count to the process's memory, which would otherwise grow
    by the size of the corpus as it is read. The whole pages inside the texts' bytes only (a page shared with the
    next texts stays); the data stay in the file. Linux's MADV_PAGEOUT; elsewhere nothing is done."""
    if libc_madvise is None:
        return
    for column in table.itercolumns():
        if not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type)):
            continue
        for chunk in column.chunks:
            data = chunk.buffers()[2]
            if data is None or len(chunk) == 0:
                continue
            width = np.int64 if pyarrow.types.is_large_string(chunk.type) else np.int32
            offsets = np.frombuffer(chunk.buffers()[1], width)
            first, last = int(offsets[chunk.offset]), int(offsets[chunk.offset + len(chunk)])
            page_out_bytes(data.address + first, data.address + last)


def page_out_bytes(first: int, last: int):
    """Let the kernel take back the whole pages of memory between the addresses `first` and `last` (Linux's
    MADV_PAGEOUT; elsewhere nothing is done): see page_out_texts."""
    start = -(-first // mmap.PAGESIZE) * mmap.PAGESIZE
    end = last // mmap.PAGESIZE * mmap.PAGESIZE
    if libc_madvise is not None and end > start:
        libc_madvise(start, end - start, MADV_PAGEOUT)


# Linux's value (5.4 on), which Python's mmap module names only from 3.13.
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform == "linux" else None)


def find_madvise():
    """libc's madvise where the kernel has MADV_PAGEOUT, else None (an older kernel refuses it: nothing is done)."""
    if MADV_PAGEOUT is None:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


libc_madvise = find_madvise()


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_in_workers(function, items: Iterable, num_workers: int | None) -> Iterator:
    """function(item) for each item, in order: here with num_workers 1, or in that many worker processes, a few
    items per worker in flight; with None (the default), as many as there are cores, started only after
    Preprocessing.seconds_before_workers of work here. The order of results never depends on the number of
    workers. The workers are spawned, not forked: JAX's runtime is multithreaded, and a forked copy of it can
    deadlock."""
    items = iter(items)
    if num_workers is None:
        num_workers, started = available_cores(), time.monotonic()
        if num_workers > 1:  # here until the work has lasted long enough to be worth starting the workers

            def long_enough() -> bool:
                return time.monotonic() - started > preprocessing.seconds_before_workers

            if not (yield from map_here(function, items, long_enough)):
                return  # every item done here
    if num_workers < 2:
        yield from map_here(function, items)
        return
    context = multiprocessing.get_context("spawn")
    with script_left_unimported(function):
        pool = context.Pool(num_workers, initializer=set_worker_function, initargs=(function,))
    with pool:
        in_flight = collections.deque()
        for item in items:
            in_flight.append(pool.apply_async(call_worker_function, (item,)))
            if len(in_flight) > 2 * num_workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def map_here(function, items: Iterator, enough=lambda: False) -> Iterator:
    """function(item) for each item, in order, in this process, until `enough()` is true (the items left are not
    read; the generator then returns True): each call runs on a thread of its own while the next item is read and
    the result before it is used, so that the reading, packing and writing around the tokenizer overlap its encoding
    (the tokenizers library lets go of the interpreter while it encodes, on threads of its own)."""
    stopped = False
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode") as thread:
        running = None
        for item in items:
            following = thread.submit(function, item)
            if running is not None:
                yield running.result()
            running = following
            if enough():
                stopped = True
                break
        if running is not None:
            yield running.result()
    return stopped


@contextlib.contextmanager
def script_left_unimported(function):
    """Within the block, processes are spawned without importing the running script (which `multiprocessing` does,
    to find what it sends them): the script's imports (JAX, Flax, transformers) would cost each worker seconds and
    hundreds of megabytes. Not where `function` is the script's own (run_mlm_flax.py's encode_lines): its workers need
    it."""
    main = sys.modules["__main__"]
    inner = function.func if isinstance(function, partial) else function
    if getattr(inner, "__module__", "__main__") == "__main__":
        yield
        return
    held = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
    main.__spec__ = None
    vars(main).pop("__file__", None)
    try:
        yield
    finally:
        vars(main).update(held)


def set_worker_function(function):
    """Runs once in each worker process: the function (the tokenizer with it) is sent once, not with every item.
    Each worker encodes on one thread: the workers are the parallelism, one a core."""
    global worker_function
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    worker_function = function


def call_worker_function(item):
    return worker_function(item)


# Without a terminal for the progress bar (a batch job's log), packing logs its progress this often instead.
PROGRESS_LOG_SECONDS = 60


def text_megabytes(dataset, column: str) -> float | None:
    """The megabytes of text in `column` of a dataset, read from the Arrow offsets alone (the texts stay unread);
    None for a stream, or data without that column (examples), whose size is not known before reading it."""
    if not isinstance(dataset, datasets.Dataset) or column not in (dataset.column_names or []):
        return None
    lengths = pyarrow.compute.binary_length(dataset.data.column(column))
    return (pyarrow.compute.sum(lengths).as_py() or 0) / 1e6


class PackingProgress:
    """The progress of packing one split, on a bar (tqdm) or, without a terminal, in the log every
    PROGRESS_LOG_SECONDS: megabytes of text read (of how many, when known) and their rate, texts, rows written and
    the time left."""

    def __init__(self, split: str, total_megabytes: float | None):
        self.split, self.total = split, total_megabytes
        self.rows = 0
        self.started = self.logged = time.monotonic()
        read_progress.reset()
        shape = "{l_bar}{bar}| {n:.1f}/{total_fmt} MB [{elapsed}<{remaining}, " if total_megabytes else "{desc}: "
        shape += "{n:.1f} MB [{elapsed}, " if not total_megabytes else ""
        self.bar = tqdm(desc=f"Packing {split}", total=total_megabytes, unit=" MB", disable=None)
        self.bar.bar_format = shape + "{rate_fmt}{postfix}]"

    def update(self, rows: int):
        self.rows += rows
        megabytes = read_progress.characters / 1e6
        self.bar.set_postfix_str(f"{read_progress.texts:,} texts, {self.rows:,} rows", refresh=False)
        self.bar.update(megabytes - self.bar.n)
        if self.bar.disable and time.monotonic() - self.logged >= PROGRESS_LOG_SECONDS:
            self.logged = time.monotonic()
            logger.info("%s", self.line())

    def line(self) -> str:
        megabytes, seconds = read_progress.characters / 1e6, time.monotonic() - self.started
        rate = megabytes / max(seconds, 1e-9)
        read = f"{megabytes:,.1f} of {self.total:,.1f} MB" if self.total else f"{megabytes:,.1f} MB"
        left = ""
        if self.total and rate > 0:
            left = f", about {datetime.timedelta(seconds=round((self.total - megabytes) / rate))} left"
        return (
            f"Packing {self.split}: {read} of text read ({rate:.2f} MB/s), {read_progress.texts:,} texts, "
            f"{self.rows:,} rows written{left}"
        )

    def close(self):
        self.bar.close()
        megabytes, seconds = read_progress.characters / 1e6, time.monotonic() - self.started
        logger.info(
            "Packed %s: %s MB of text (%.2f MB/s), %s texts, %s rows in %s",
            self.split,
            f"{megabytes:,.1f}",
            megabytes / max(seconds, 1e-9),
            f"{read_progress.texts:,}",
            f"{self.rows:,}",
            datetime.timedelta(seconds=round(seconds)),
        )
