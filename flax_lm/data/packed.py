"""Packed corpora: token rows stored as memory-mappable shards with an index, so that every process reads only the
rows it needs. The token cache under --cache_dir and --packed_data_dir are both packed corpora."""

import contextlib
import copy
import functools
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import time
from collections.abc import Iterable

import datasets
import jax
import numpy as np

from flax_lm.data.cache_key import function_code_fingerprint
from flax_lm.data.chat import chat_template_of
from flax_lm.data.data_files import data_file_patterns
from flax_lm.data.finetune_examples import recorded_example_format
from flax_lm.data.pieces import PackingProgress, text_megabytes, token_trail
from flax_lm.data.source import TextSource
from flax_lm.devices.processes import main_process_first
from flax_lm.errors import UsageError, check_writable_directory
from flax_lm.run.checksums import file_checksum

logger = logging.getLogger(__name__)


# A packed corpus is a directory of token rows (blocks of grouped texts, or lines padded with the pad token): for
# each split, .npy shards of shape (rows, block_size) named SPLIT-00000.npy, SPLIT-00001.npy, ..., and an
# index.json describing them (with each shard's checksum, compared when a run first opens it), written last: a
# directory without index.json is an unfinished one, never read.
# Ids are stored as uint16 when the vocabulary fits (half the disk of int32) and always read as int32.
PACKED_INDEX_FILE = "index.json"


PACKED_FORMAT_VERSION = 2  # 2: a .txt file is one document unless --text_sample_by says otherwise


# Shards of a packed corpus hold this many tokens (512 MiB as uint16); the last shard of a split may hold fewer.
PACKED_TOKENS_PER_SHARD = 2**28


def packed_dtype(tokenizer) -> np.dtype:
    """uint16 when every id of the tokenizer fits in it, int32 otherwise."""
    largest_id = max(len(tokenizer), tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)) - 1
    return np.dtype(np.uint16) if largest_id <= np.iinfo(np.uint16).max else np.dtype(np.int32)


def fingerprint(value) -> str:
    """A short hash of a JSON value: the names of cached corpora, and the tokenizer a packed corpus records."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def tokenizer_fingerprint(tokenizer) -> str:
    """A fingerprint of everything in the tokenizer that changes the ids (vocabulary, merges, normalisation, special
    tokens, the chat template conversations are rendered with), whatever files it was saved in: what a packed corpus
    and a training checkpoint record of it."""
    settings = json.loads(tokenizer.backend_tokenizer.to_str())
    for transient in ("truncation", "padding"):  # set by calls to the transformers wrapper, not part of the ids
        settings.pop(transient, None)
    tokenizer_settings = {
        "tokenizer": settings,
        "eos_token_id": tokenizer.eos_token_id,
        "encode_special_tokens": tokenizer.backend_tokenizer.encode_special_tokens,
    }
    if (chat_template := chat_template_of(tokenizer)) is not None:  # absent, the fingerprint is as it always was
        tokenizer_settings["chat_template"] = chat_template
    return fingerprint(tokenizer_settings)


def packed_description(tokenizer, block_size: int, framing: str, source: dict) -> dict:
    """What a packed corpus holds, recorded in its index: the block size, how texts became rows (grouped, or
    line_by_line, or examples), the data it was packed from and the tokenizer's fingerprint."""
    return {
        "block_size": block_size,
        "framing": framing,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "source": source,
    }


def release_written_pages(shard: np.memmap):
    """Let go of the pages filled in the shard's memory map: the kernel keeps them, written or still to write, as
    the file's cache (the mapping is shared: nothing written is lost), but they no longer count to the process's
    memory (up to a shard, 512 MiB by default). Not written out here: that would wait for the disk at every array."""
    with contextlib.suppress(AttributeError, OSError):  # madvise: Linux and macOS
        shard._mmap.madvise(mmap.MADV_DONTNEED)


def write_packed_split(
    blocks: Iterable[np.ndarray],
    directory: str,
    split: str,
    dtype,
    blocks_per_shard: int,
    finished: list[dict] = (),
    on_shard=None,
    resume_point: dict | None = None,
) -> dict:
    """Write the block arrays of one split (count, block_size), or (count, ..., block_size) for rows of several
    arrays (examples: token ids and loss weights), as shards of `blocks_per_shard` blocks (the last one may be
    shorter) and return the split's entry of the index. `finished`: the entries of shards an interrupted run
    wrote already, whose blocks (the first of `blocks`) are skipped rather than written again, or, where
    `resume_point` (recorded with the last of them) is where `blocks` start (the rows of token_arrays' stream: see
    TokenTrail), not even made; `on_shard(entry, point)` is told of each shard as it is finished, with where the
    rows after it start in the texts (TokenTrail.point_after; None where not known).

    Memory stays bounded whatever the corpus size: each shard is filled through a memory map of its file
    and written under a temporary name, then renamed. No shard is written for an empty split.
    """
    dtype = np.dtype(dtype)
    largest = np.iinfo(dtype).max
    shards, shard, filled, row_shape = list(finished), None, 0, None
    num_blocks = skip = sum(entry["num_blocks"] for entry in shards)

    def finish_shard():
        name = f"{split}-{len(shards):05d}.npy"
        point = token_trail.point_after(split, num_blocks * shard[0].size, np.asarray(shard[filled - 1]))
        if filled == len(shard):
            shard.flush()
            written_path = shard.filename
        else:  # the last shard, shorter: copied into a file of its own size
            written_path = os.path.join(directory, f"{name}.{os.getpid()}.end.tmp.npy")
            np.save(written_path, shard[:filled], allow_pickle=False)
            os.remove(shard.filename)
        os.replace(written_path, os.path.join(directory, name))
        checksum = file_checksum(os.path.join(directory, name))
        shards.append({"file": name, "num_blocks": filled, "checksum": checksum})
        if on_shard is not None:
            on_shard(shards[-1], point)

    token_trail.begin(split, resume_point if skip else None)
    for block_array in blocks:
        row_shape = list(block_array.shape[1:])
        if skip and token_trail.taken:  # the rows start after the finished shards' own
            logger.info(
                "Reading the %s texts on from piece %d, where the finished shards end", split, resume_point["piece"]
            )
            skip = 0
        if skip:
            skipped = min(skip, len(block_array))
            block_array, skip = block_array[skipped:], skip - skipped
        if len(block_array) and (block_array.min() < 0 or block_array.max() > largest):
            raise ValueError(f"token ids outside the range of {dtype.name}; the packed corpus needs a wider dtype")
        start = 0
        while start < len(block_array):
            if shard is None:
                name = f"{split}-{len(shards):05d}.npy"
                shard = np.lib.format.open_memmap(
                    os.path.join(directory, f"{name}.{os.getpid()}.tmp.npy"),
                    mode="w+",
                    dtype=dtype,
                    shape=(blocks_per_shard, *block_array.shape[1:]),
                )
                filled = 0
            count = min(blocks_per_shard - filled, len(block_array) - start)
            shard[filled : filled + count] = block_array[start : start + count]
            filled, start, num_blocks = filled + count, start + count, num_blocks + count
            release_written_pages(shard)
            if filled == blocks_per_shard:
                finish_shard()
                shard = None
    if skip:
        raise ValueError(f"the {split} data makes fewer rows than the shards an interrupted run wrote of it")
    if shard is not None:
        finish_shard()
        del shard
    token_trail.begin(None, None)
    entry = {"num_blocks": num_blocks, "shards": shards}
    if row_shape is not None and len(row_shape) > 1:  # rows of one array of block_size need no record
        entry["row_shape"] = row_shape
    return entry


# While a packed corpus is written, the shards finished so far, and what they are shards of: a run interrupted
# (even killed) goes on from them when run again on the same texts with the same code. Removed once the index is
# written.
PACKING_MANIFEST_FILE = "packing.json"


def finished_shards(directory: str, plan: dict) -> tuple[dict[str, list[dict]], dict[str, list]]:
    """{split: entries of the shards an interrupted write of the same `plan` finished}, each checked against the
    checksum taken when it was written (only the unbroken run of good shards from the first is kept), and {split:
    where in the texts the rows after each of them start (TokenTrail.point_after, or None)}."""
    try:
        with open(os.path.join(directory, PACKING_MANIFEST_FILE)) as file:
            manifest = json.load(file)
    except (OSError, ValueError):
        return {}, {}
    if not isinstance(manifest, dict) or manifest.get("plan") != plan:
        return {}, {}
    finished, points = {}, {}
    for split, entries in manifest.get("finished", {}).items():
        good = []
        for entry in entries:
            path = os.path.join(directory, entry["file"])
            if not os.path.isfile(path) or file_checksum(path) != entry["checksum"]:
                break
            good.append(entry)
        if good:
            finished[split] = good
            points[split] = manifest.get("points", {}).get(split, [None] * len(entries))[: len(good)]
    return finished, points


def write_packed_corpus(
    directory: str, splits: dict, description: dict, dtype, tokens_per_shard: int, resume_key: str | None = None
) -> dict:
    """Pack each split's row arrays ({split: iterable of (count, block_size) arrays}) into `directory`, then write
    the index (with `description`, from packed_description) and return it.

    The index is removed first and written last, so an interrupted write leaves a directory that is
    recognised as unfinished. With a `resume_key` (a fingerprint of the texts), the shards that an interrupted write
    of the same texts, description and shard size finished are kept and their rows not written again
    (PACKING_MANIFEST_FILE); every other shard or temporary file left by an earlier write is removed.
    """
    os.makedirs(directory, exist_ok=True)
    index_path = os.path.join(directory, PACKED_INDEX_FILE)
    if os.path.exists(index_path):
        os.remove(index_path)
    blocks_per_shard = max(1, tokens_per_shard // description["block_size"])
    layout = {"format_version": PACKED_FORMAT_VERSION, **description, "dtype": np.dtype(dtype).name}
    layout["blocks_per_shard"] = blocks_per_shard
    plan = {"layout": layout, "texts": resume_key}
    finished, points = finished_shards(directory, plan) if resume_key is not None else ({}, {})
    kept = {entry["file"] for entries in finished.values() for entry in entries}
    split_names = "|".join(map(re.escape, splits))
    leftover = re.compile(rf"^({split_names})-\d{{5}}\.npy(\.\d+(\.end)?\.tmp\.npy)?$")
    for name in os.listdir(directory):
        if leftover.match(name) and name not in kept:
            os.remove(os.path.join(directory, name))
    for split, entries in finished.items():
        logger.info("Keeping the %d %s shards an interrupted run finished in %s", len(entries), split, directory)
    manifest_path = os.path.join(directory, PACKING_MANIFEST_FILE)

    def record(split: str, entry: dict, point: dict | None):
        if resume_key is None:
            return
        finished.setdefault(split, []).append(entry)
        points.setdefault(split, []).append(point)
        temporary = f"{manifest_path}.{os.getpid()}.tmp"
        with open(temporary, "w") as file:
            json.dump({"plan": plan, "finished": finished, "points": points}, file)
        os.replace(temporary, manifest_path)

    index = {
        **layout,
        "splits": {
            split: write_packed_split(
                blocks,
                directory,
                split,
                dtype,
                blocks_per_shard,
                list(finished.get(split, [])),
                functools.partial(record, split),
                (points.get(split) or [None])[-1],
            )
            for split, blocks in splits.items()
        },
    }
    temporary_path = f"{index_path}.{os.getpid()}.tmp"
    with open(temporary_path, "w") as file:
        json.dump(index, file, indent=2)
    os.replace(temporary_path, index_path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(manifest_path)
    return index


def read_packed_index(directory: str) -> dict | None:
    """The index of the packed corpus in `directory`, or None when there is no finished one."""
    path = os.path.join(directory, PACKED_INDEX_FILE)
    try:
        with open(path) as file:
            index = json.load(file)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        index = None
    if not (isinstance(index, dict) and "format_version" in index and "splits" in index):
        raise UsageError(f"{path} is not the index of a packed corpus; use another directory for the packed data")
    return index


def packed_shards_problem(directory: str, index: dict) -> str | None:
    """What is wrong with the shard files of a packed corpus whose index is intact (a shard missing, cut short, or of
    another shape than the index says), or None. Found here, before training, rather than when a shard is first
    memory-mapped, maybe hours into the run."""
    for entry in index["splits"].values():
        for shard in entry["shards"]:
            try:  # mapping the file checks its header, and that it holds every element the header promises
                shape = np.load(os.path.join(directory, shard["file"]), mmap_mode="r").shape
            except (OSError, ValueError, EOFError) as error:
                return f"{shard['file']} is cut short or unreadable ({error})"
            expected = (shard["num_blocks"], *row_shape_of(entry, index))
            if shape != expected:
                return f"{shard['file']} holds an array of shape {shape}, not the {expected} the index lists"
    return None


def row_shape_of(split_entry: dict, index: dict) -> tuple[int, ...]:
    """The shape of one row of a split: (block_size,), or as recorded for rows of several arrays."""
    return tuple(split_entry.get("row_shape", [index["block_size"]]))


class PackedBlocks:
    """The blocks of one split of a packed corpus, indexed like a (num_blocks, *row_shape) int32 array (row_shape:
    (block_size,), or (2, block_size) for examples' token ids and loss weights): `len`, an integer, a slice (a view,
    nothing read), or an array of indices (those blocks, read).

    Shards are memory-mapped when first needed (the most recent few kept open), so a process reads
    only the blocks it asks for, whatever the size of the corpus. The first time it opens a shard, it compares the
    shard's checksum with the index's: a shard whose bytes changed on disk since it was packed is never read, and
    `on_damage(problem)` gives the error that stops the run instead (by default, one naming the directory).
    """

    dtype = np.dtype(np.int32)
    open_shards = 64

    def __init__(
        self,
        directory: str,
        split_entry: dict,
        row_shape: tuple,
        start: int = 0,
        stop: int | None = None,
        on_damage=None,
    ):
        self.directory, self.split_entry, self.row_shape = directory, split_entry, row_shape
        self.ndim = 1 + len(row_shape)
        self.on_damage = on_damage or (
            lambda problem: UsageError(f"the packed corpus {directory} is damaged: {problem}")
        )
        sizes = [shard["num_blocks"] for shard in split_entry["shards"]]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        total = int(self.shard_starts[-1])
        self.start, self.stop = start, total if stop is None else stop
        self.shard = functools.lru_cache(maxsize=self.open_shards)(self.open_shard)
        self.checked_shards = set()  # shared by the views of slices, as `shard` is

    def open_shard(self, shard_number: int) -> np.ndarray:
        shard = self.split_entry["shards"][shard_number]
        path = os.path.join(self.directory, shard["file"])
        if (
            shard_number not in self.checked_shards and "checksum" in shard
        ):  # a corpus packed before checksums has none
            if file_checksum(path) != shard["checksum"]:
                raise self.on_damage(f"{shard['file']} differs from the checksum taken when it was packed")
            self.checked_shards.add(shard_number)
        return np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.row_shape)

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(len(self))
            view = copy.copy(self)
            view.start, view.stop = self.start + start, self.start + max(start, stop)
            return view
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        positions = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if positions.dtype == bool or not np.issubdtype(positions.dtype, np.integer):
            raise IndexError("PackedBlocks takes an integer, a slice or an array of integer indices")
        positions = np.where(positions < 0, positions + len(self), positions)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} blocks")
        return self.read(positions + self.start)

    def read(self, positions: np.ndarray) -> np.ndarray:
        """The blocks at these positions of the whole split, in the order given."""
        blocks = np.empty((*positions.shape, *self.row_shape), dtype=np.int32)
        shard_numbers = np.searchsorted(self.shard_starts, positions, side="right") - 1
        for shard_number in np.unique(shard_numbers):
            chosen = shard_numbers == shard_number
            blocks[chosen] = self.shard(int(shard_number))[positions[chosen] - self.shard_starts[shard_number]]
        return blocks

    def __array__(self, dtype=None, copy=None):
        blocks = self.read(np.arange(self.start, self.stop))
        return blocks if dtype is None else blocks.astype(dtype, copy=False)


def open_packed_corpus(directory: str, index: dict, on_damage=None) -> dict[str, PackedBlocks]:
    """{split: PackedBlocks} of the packed corpus in `directory`; `on_damage(problem)` gives the error that stops the
    run where a shard's bytes changed on disk (see PackedBlocks)."""
    blocks = {
        split: PackedBlocks(directory, entry, row_shape_of(entry, index), on_damage=on_damage)
        for split, entry in index["splits"].items()
    }
    for split, split_blocks in blocks.items():
        logger.info(
            "%s: %d packed blocks of %d tokens in %s", split, len(split_blocks), split_blocks.row_shape[-1], directory
        )
    return blocks


# What an interrupted run leaves in the cache directory: unfinished packed corpora.
STALE_TEMPORARY_NAME = re.compile(r"packed-.*\.\d+\.tmp")


STALE_AFTER_SECONDS = 600


def remove_stale_temporary_files(cache_dir: str):
    """Remove the temporary files that runs killed mid-tokenization left behind (about the size of the tokens each).
    Only files untouched for STALE_AFTER_SECONDS go: a live run, this one or another sharing the cache, writes to
    its own every few seconds."""
    for entry in os.scandir(cache_dir):
        if STALE_TEMPORARY_NAME.fullmatch(entry.name) and time.time() - entry.stat().st_mtime > STALE_AFTER_SECONDS:
            logger.info("Removing %s, left in the cache by an interrupted run", entry.path)
            if entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def pack_texts(
    directory: str,
    texts: dict,
    tokenized_rows,
    tokenizer,
    block_size: int,
    description: dict,
    source: TextSource,
    tokens_per_shard: int,
    resume: bool = False,
) -> dict:
    """Tokenize every split of `texts` ({split: dataset or stream}, read from `source`) into rows with the script's
    `tokenized_rows(dataset, split, tokenizer, block_size, source)` and write them as a packed corpus in `directory`
    (shards of `tokens_per_shard` tokens, --packed_tokens_per_shard); returns its index. A few pieces of text per
    worker (--preprocessing_piece_mb) and one shard are in memory at a time, with the progress shown
    (PackingProgress). With `resume`, the shards an interrupted run finished of the same texts (datasets, whose
    fingerprints follow their content; never a stream's) are kept (write_packed_corpus)."""

    def rows_with_progress(split, dataset):
        progress = PackingProgress(split, text_megabytes(dataset, source.text_column_name))
        for blocks in tokenized_rows(dataset, split, tokenizer, block_size, source):
            progress.update(len(blocks))
            yield blocks
        progress.close()

    splits = {split: rows_with_progress(split, dataset) for split, dataset in texts.items()}
    known = all(isinstance(dataset, datasets.Dataset) for dataset in texts.values())
    resume_key = fingerprint({split: dataset._fingerprint for split, dataset in texts.items()}) if known else None
    dtype = packed_dtype(tokenizer)
    return write_packed_corpus(directory, splits, description, dtype, tokens_per_shard, resume_key if resume else None)


def cached_blocks(
    dataset,
    split: str,
    tokenized_rows,
    tokenizer,
    block_size: int,
    cache_dir: str,
    source: TextSource,
    *,
    framing: str,
    overwrite: bool = False,
    tokens_per_shard: int = PACKED_TOKENS_PER_SHARD,
):
    """The rows of one split (PackedBlocks), from the packed corpus that caches them in `cache_dir` under a
    fingerprint of the texts, the tokenizer, the row length, how texts become rows (`framing`, recorded in a packed
    corpus) and the code that makes the rows (`tokenized_rows` and the functions of the script and of flax_lm it
    calls: function_code_fingerprint): packed there first when it is missing, damaged or `overwrite`
    (--overwrite_cache) is given. Written under a name of this process's own and renamed when complete, so that
    processes sharing the cache never read or write each other's unfinished files."""
    texts_source = {"dataset_fingerprint": dataset._fingerprint, "text_column_name": source.text_column_name}
    texts_source.update(split=split, code_fingerprint=function_code_fingerprint(tokenized_rows))
    description = packed_description(tokenizer, block_size, framing, texts_source)
    directory = os.path.join(cache_dir, f"packed-{fingerprint([PACKED_FORMAT_VERSION, description])}")
    os.makedirs(cache_dir, exist_ok=True)
    remove_stale_temporary_files(cache_dir)
    index = None if overwrite else read_packed_index(directory)
    if index is not None and (problem := packed_shards_problem(directory, index)):
        logger.warning("The packed cache %s is damaged (%s); packing it again", directory, problem)
        index = None
    if index is not None and not all("checksum" in shard for shard in index["splits"][split]["shards"]):
        logger.info("The packed cache %s was packed before shards had checksums; packing it again", directory)
        index = None
    if index is not None:
        logger.info("Loading packed %s blocks from cache %s", split, directory)
    else:
        temporary_directory = f"{directory}.{os.getpid()}.tmp"
        try:
            texts = {split: dataset}
            index = pack_texts(
                temporary_directory,
                texts,
                tokenized_rows,
                tokenizer,
                block_size,
                description,
                source,
                tokens_per_shard,
            )
        except BaseException:
            shutil.rmtree(temporary_directory, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rename(temporary_directory, directory)
        except OSError:  # another process finished the same cache first
            shutil.rmtree(temporary_directory, ignore_errors=True)

    def on_damage(problem: str) -> UsageError:
        # The cache is this program's own: without its index, the next run packs it again.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, PACKED_INDEX_FILE))
        return UsageError(
            f"the token cache {directory} is damaged: {problem}; it is packed again from the texts when the command "
            "runs again (with --resume_from_checkpoint, training goes on from the last checkpoint)"
        )

    return open_packed_corpus(directory, index, on_damage)[split]


def load_packed_corpus(
    directory: str,
    source: TextSource,
    texts_to_rows,
    streaming: bool = False,
    overwrite: bool = False,
    tokens_per_shard: int = PACKED_TOKENS_PER_SHARD,
) -> tuple[dict, str | None]:
    """The blocks of --packed_data_dir `directory`, {split: PackedBlocks}, and the format of the examples they are
    rows of (None: plain text): packed there first when it holds no finished corpus (or `overwrite`,
    --overwrite_cache), by process 0 alone while the others wait, from the texts of `source` that `texts_to_rows`
    (the script's flax_lm.data.loading.TextsToRows) reads, as they are or, `streaming`, as a stream. A directory
    packed with another tokenizer, row length or source is refused, never reused; one packed by other code (its
    fingerprint of the script's tokenized_rows differs) is used with a warning. Rows of examples are as long as
    texts_to_rows.length_of says (run_t5_mlm_flax.py's pairs: --max_seq_length, not its longer rows of text)."""
    tokenized_rows, tokenizer = texts_to_rows.tokenized_rows, texts_to_rows.tokenizer
    block_size, length_flag = texts_to_rows.row_length, texts_to_rows.length_flag
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--packed_data_dir {directory} is a file; pass a directory")
    names = ("dataset_name", "dataset_config_name", "train_file", "validation_file", "text_column_name")
    recorded_source = {name: getattr(source, name) for name in (*names, "text_sample_by", "keep_linebreaks")}
    for name in ("train_file", "validation_file"):  # the same files, from whichever directory
        paths = [os.path.abspath(pattern) for pattern in data_file_patterns(recorded_source[name])]
        recorded_source[name] = paths[0] if len(paths) == 1 else paths or None  # one file: as recorded before lists
    if recorded_source["dataset_name"] is not None and os.path.isdir(recorded_source["dataset_name"]):
        recorded_source["dataset_name"] = os.path.abspath(recorded_source["dataset_name"])
    description = packed_description(tokenizer, block_size, texts_to_rows.framing, recorded_source)
    description["code_fingerprint"] = function_code_fingerprint(tokenized_rows)  # as in the token cache's name
    has_source = any(getattr(source, name) for name in ("dataset_name", "train_file", "validation_file"))
    example_format = None  # known once the data are read, or from the corpus's record

    fix = f"use another --packed_data_dir, delete {directory}, or add --overwrite_cache to pack it again"
    if not has_source:  # packing needs the texts
        fix += " from --train_file or --dataset_name"

    def check(index: dict):
        nonlocal example_format
        if index["format_version"] != PACKED_FORMAT_VERSION:
            raise UsageError(
                f"--packed_data_dir {directory} holds a packed corpus of format version "
                f"{index['format_version']}; {fix}"
            )
        framing = index.get("framing", "grouped")  # corpora before lines: grouped
        if example_format is None:  # a corpus used without reading its data: its examples are of the recorded format
            example_format = recorded_example_format(framing, source.examples)
        # The rows' own length: pairs packed before it was recorded as the block size have it in their row shape.
        recorded_length = row_shape_of(next(iter(index["splits"].values()), {}), index)[-1]
        if recorded_length != (length := texts_to_rows.length_of(example_format)):
            raise UsageError(
                f"--packed_data_dir {directory} holds blocks of {recorded_length} tokens, not the {length} that "
                f"{length_flag} sets; {fix}"
            )
        if index["tokenizer_fingerprint"] != description["tokenizer_fingerprint"]:
            raise UsageError(f"--packed_data_dir {directory} was packed with another tokenizer; {fix}")
        if framing != (framing_here := texts_to_rows.framing_of(example_format, source)):
            raise UsageError(f"--packed_data_dir {directory} holds {framing} rows, not {framing_here} ones; {fix}")
        if problem := packed_shards_problem(directory, index):
            raise UsageError(f"--packed_data_dir {directory} is damaged: {problem}; {fix}")
        differences = [name for name in recorded_source if index["source"].get(name) != recorded_source[name]]
        if has_source and differences:
            recorded = ", ".join(f"--{name} {index['source'].get(name)}" for name in differences)
            raise UsageError(
                f"--packed_data_dir {directory} was packed from other data ({recorded}); pass the same data "
                f"arguments, or none to train on it as it is, or {fix}"
            )

    # Read even with --overwrite_cache: never overwrite a directory of other files.
    index = read_packed_index(directory)
    if overwrite:
        index = None
    if index is not None:
        check(index)
    elif not has_source:
        raise UsageError(
            f"--packed_data_dir {directory} holds no finished packed corpus; pass --train_file or --dataset_name "
            "to pack one"
        )
    # Process 0 packs while the others wait. It reaches the barrier even when packing fails, so that the others
    # stop with an error rather than wait for it until the distributed runtime gives up.
    with main_process_first("packed corpus written"):
        if jax.process_index() == 0 and index is None:
            check_writable_directory(directory, "packed_data_dir")
            texts, example_format = texts_to_rows.read(source, streaming=streaming)
            logger.info("Packing %s into %s", " and ".join(texts), directory)
            row_function = texts_to_rows.row_function(example_format)  # known once the data are read
            framing = texts_to_rows.framing_of(example_format, source)
            block_size = texts_to_rows.length_of(example_format)
            description.update(
                framing=framing, code_fingerprint=function_code_fingerprint(row_function), block_size=block_size
            )
            index = pack_texts(
                directory,
                texts,
                row_function,
                tokenizer,
                block_size,
                description,
                source,
                tokens_per_shard,
                not overwrite,
            )
    if jax.process_count() > 1:
        index = read_packed_index(directory)
        if index is None:
            raise UsageError(
                f"process {jax.process_index()} finds no packed corpus in --packed_data_dir {directory}: process 0 "
                "failed to pack it (see its error), or the directory is not on a filesystem every process shares"
            )
        check(index)
    # Told, not refused: the rows may well be the same (an edit of a comment or of the script's name changes the
    # fingerprint too), and packing a large corpus again is costly. A corpus packed before it was recorded has none.
    fingerprint_here = function_code_fingerprint(texts_to_rows.row_function(example_format))
    if index.get("code_fingerprint", fingerprint_here) != fingerprint_here:
        logger.warning(
            "--packed_data_dir %s was packed by other code than this script's tokenized_rows (example_rows for "
            "examples; another script, or the function or one of the script's functions it calls since edited): its "
            "rows may not be those this script "
            "makes; add --overwrite_cache to pack it again",
            directory,
        )
    if not all("checksum" in shard for entry in index["splits"].values() for shard in entry["shards"]):
        logger.info(
            "--packed_data_dir %s was packed before shards had checksums, so its bytes are not checked; add "
            "--overwrite_cache to pack it again with them",
            directory,
        )

    def on_damage(problem: str) -> UsageError:
        return UsageError(f"--packed_data_dir {directory} is damaged: {problem}; {fix}")

    return open_packed_corpus(directory, index, on_damage), example_format
