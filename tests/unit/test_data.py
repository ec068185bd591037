"""Data at scale in run_clm_flax.py: packed corpora in memory-mapped shards, reused by later runs and every
process, and --streaming, which tokenizes and packs a stream on the fly."""

import csv
import gzip
import itertools
import json
import os
import re
import sys
import tracemalloc
import warnings

import datasets
import numpy as np
import pytest
from conftest import FIXTURES_DIR
from test_clm import model_dir_with_config, run_clm_flax
from transformers import AutoTokenizer

import flax_lm.data.cache_key
import flax_lm.data.data_files
import flax_lm.data.loading
import flax_lm.data.packed
import flax_lm.data.pieces
import flax_lm.data.text_stream
import flax_lm.data.texts
import flax_lm.devices.processes
import flax_lm.errors
from flax_lm.data.source import TextSource

CORPUS = FIXTURES_DIR / "en"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer (its ids fit in uint16) with a tiny GPT-2."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("data-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def expected_blocks(tokenizer, texts, block_size):
    """Every text followed by EOS, joined and cut: the packing written out the slow, obvious way."""
    tokens = [token for text in texts for token in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    return np.array(tokens[: len(tokens) // block_size * block_size]).reshape(-1, block_size)


def train_texts():
    """The documents of train.txt: the whole file, as written."""
    return [(CORPUS / "train.txt").read_text()]


def train_lines():
    return (CORPUS / "train.txt").read_text().splitlines(keepends=True)


def data_arguments(packed_dir, **overrides):
    settings = dict(
        train_file=str(CORPUS / "train.txt"),
        packed_data_dir=str(packed_dir),
        packed_tokens_per_shard=2000,
        text_sample_by="document",  # as check_arguments sets it: a .txt file is one document
    )
    return run_clm_flax.DataTrainingArguments(**{**settings, **overrides})


def pack(packed_dir, tokenizer, block_size=32, **overrides):
    arguments = data_arguments(packed_dir, **overrides)
    blocks, _ = flax_lm.data.packed.load_packed_corpus(
        arguments.packed_data_dir,
        arguments.text_source(run_clm_flax.ModelArguments()),
        texts_to_rows(tokenizer, block_size),
        arguments.streaming,
        arguments.overwrite_cache,
        arguments.packed_tokens_per_shard,
    )
    return blocks


def texts_to_rows(tokenizer, block_size: int = 32) -> flax_lm.data.loading.TextsToRows:
    """run_clm_flax.py's way from texts to rows, as its main() makes it."""
    return run_clm_flax.script_texts_to_rows(run_clm_flax.DataTrainingArguments(), tokenizer, block_size)


def forbid_tokenizing(monkeypatch):
    """Make packing the texts into a corpus (the cache or --packed_data_dir) fail. Not by replacing a function on the
    way from texts to tokens: the cache's key follows that code, so it would miss the cache."""

    def tokenizing(*arguments, **keywords):
        raise AssertionError("the texts were tokenized again")

    monkeypatch.setattr(flax_lm.data.packed, "pack_texts", tokenizing)


# ----------------------------------------------------------------------------------------------------
# Packed corpora
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["from-files", "from-a-stream"])
def test_packed_shards_hold_the_blocks_of_the_in_memory_packing(streaming, tokenizer, tmp_path):
    blocks = pack(tmp_path / "packed", tokenizer, streaming=streaming)
    expected = expected_blocks(tokenizer, train_texts(), 32)
    np.testing.assert_array_equal(np.asarray(blocks["train"]), expected)
    held_out = flax_lm.data.loading.hold_out_blocks(blocks, 5)
    validation_size = len(expected) * 5 // 100  # held out from the start of the packed training blocks
    np.testing.assert_array_equal(np.asarray(held_out["validation"]), expected[:validation_size])
    np.testing.assert_array_equal(np.asarray(held_out["train"]), expected[validation_size:])

    index = json.loads((tmp_path / "packed" / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["blocks_per_shard"] == 2000 // 32
    assert len(index["splits"]["train"]["shards"]) == -(-len(expected) // 62) > 10
    shard = np.load(tmp_path / "packed" / "train-00000.npy", mmap_mode="r")
    assert shard.dtype == np.uint16 and shard.shape == (62, 32)


def test_packed_blocks_index_like_an_array_across_shards(tokenizer, tmp_path):
    train = pack(tmp_path / "packed", tokenizer)["train"]
    expected = np.asarray(train)
    assert isinstance(train, flax_lm.data.packed.PackedBlocks) and train.shape == expected.shape
    indices = np.array([0, 61, 62, 63, 300, len(train) - 1, 5])  # on both sides of shard boundaries, unsorted
    np.testing.assert_array_equal(train[indices], expected[indices])
    assert train[indices].dtype == np.int32
    np.testing.assert_array_equal(train[-1], expected[-1])
    view = train[100:300]
    assert len(view) == 200
    np.testing.assert_array_equal(view[[0, 199]], expected[[100, 299]])
    np.testing.assert_array_equal(np.asarray(view[:10]), expected[100:110])
    with pytest.raises(IndexError):
        view[[200]]

    # Training and evaluation batches are the same from shards as from an array.
    for packed_batch, array_batch in zip(
        run_clm_flax.train_batches(train, 8, seed=1, epoch=2), run_clm_flax.train_batches(expected, 8, seed=1, epoch=2)
    ):
        np.testing.assert_array_equal(packed_batch["input_ids"], array_batch["input_ids"])
    evaluation = list(run_clm_flax.eval_batches(view, 64))
    np.testing.assert_array_equal(
        np.concatenate([batch["input_ids"] for batch in evaluation])[:200], expected[100:300]
    )


def test_packed_data_dir_is_reused_by_later_runs_without_tokenizing(tokenizer, tmp_path, monkeypatch):
    first = pack(tmp_path / "packed", tokenizer)
    index_time = os.path.getmtime(tmp_path / "packed" / "index.json")
    forbid_tokenizing(monkeypatch)
    again = pack(tmp_path / "packed", tokenizer)
    np.testing.assert_array_equal(np.asarray(again["train"]), np.asarray(first["train"]))
    # Without data arguments the packed corpus is used as it is.
    as_it_is = pack(tmp_path / "packed", tokenizer, train_file=None)
    assert len(as_it_is["train"]) == len(first["train"])
    assert os.path.getmtime(tmp_path / "packed" / "index.json") == index_time


def test_unfinished_packed_directory_is_rewritten_not_reused(tokenizer, tmp_path, monkeypatch):
    packed_dir = tmp_path / "packed"
    real_pack_blocks = run_clm_flax.pack_blocks

    def killed_after_a_few_shards(tokens, block_size):
        for blocks in real_pack_blocks(tokens, block_size):
            for start in range(0, len(blocks), 10):
                if start == 200:
                    raise KeyboardInterrupt  # as if the run were stopped mid-write
                yield blocks[start : start + 10]

    monkeypatch.setattr(run_clm_flax, "pack_blocks", killed_after_a_few_shards)
    with pytest.raises(KeyboardInterrupt):
        pack(packed_dir, tokenizer, packed_tokens_per_shard=200)
    written = os.listdir(packed_dir)
    assert "index.json" not in written and any(name.startswith("train-") for name in written)
    assert flax_lm.data.packed.read_packed_index(str(packed_dir)) is None

    monkeypatch.setattr(run_clm_flax, "pack_blocks", real_pack_blocks)
    blocks = pack(packed_dir, tokenizer, packed_tokens_per_shard=200)
    expected = expected_blocks(tokenizer, train_texts(), 32)
    np.testing.assert_array_equal(np.asarray(blocks["train"]), expected)
    index = json.loads((packed_dir / "index.json").read_text())
    listed = {shard["file"] for shard in index["splits"]["train"]["shards"]}
    assert set(os.listdir(packed_dir)) == listed | {"index.json"}, "leftovers of the unfinished write remain"


def test_packed_data_dir_of_another_block_size_tokenizer_or_data_is_refused(
    tokenizer, roberta_tokenizer_dir, tmp_path, monkeypatch
):
    pack(tmp_path / "packed", tokenizer)
    forbid_tokenizing(monkeypatch)
    with pytest.raises(
        run_clm_flax.UsageError,
        match="holds blocks of 32 tokens, not the 16 that --block_size sets; use another --packed_data_dir",
    ):
        pack(tmp_path / "packed", tokenizer, block_size=16)
    with pytest.raises(run_clm_flax.UsageError, match="was packed with another tokenizer"):
        pack(tmp_path / "packed", AutoTokenizer.from_pretrained(roberta_tokenizer_dir))
    with pytest.raises(run_clm_flax.UsageError, match=r"was packed from other data \(--train_file .*train.txt\)"):
        pack(tmp_path / "packed", tokenizer, train_file=str(CORPUS / "validation.txt"))


def test_overwrite_cache_packs_the_directory_again(tokenizer, tmp_path):
    pack(tmp_path / "packed", tokenizer)
    blocks = pack(tmp_path / "packed", tokenizer, block_size=16, overwrite_cache=True)
    assert blocks["train"].shape[1] == 16
    assert json.loads((tmp_path / "packed" / "index.json").read_text())["block_size"] == 16


def test_shard_writer_holds_one_batch_in_memory_whatever_the_corpus_size(tmp_path):
    block_size, chunk_tokens, num_chunks = 64, 8192, 400  # 3.3 million tokens: 13 MB as int32

    def token_chunks():
        for number in range(num_chunks):
            yield np.arange(number * chunk_tokens, (number + 1) * chunk_tokens, dtype=np.int32) % 50000

    tracemalloc.start()
    try:
        index = flax_lm.data.packed.write_packed_corpus(
            str(tmp_path),
            {"train": run_clm_flax.pack_blocks(token_chunks(), block_size)},
            {"block_size": block_size},
            np.uint16,
            tokens_per_shard=64 * 128,
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak} bytes held while writing a corpus of {num_chunks * chunk_tokens * 4} bytes"
    assert len(index["splits"]["train"]["shards"]) == num_chunks and len(os.listdir(tmp_path)) == num_chunks + 1
    blocks = flax_lm.data.packed.open_packed_corpus(str(tmp_path), index)["train"]
    np.testing.assert_array_equal(
        blocks[[0, 12345, len(blocks) - 1]][:, 0], np.array([0, 12345, len(blocks) - 1]) * 64 % 50000
    )


def test_ids_that_do_not_fit_the_shard_dtype_are_refused(tmp_path):
    too_large = [np.array([[1, 2], [70000, 3]], dtype=np.int32)]
    with pytest.raises(ValueError, match="outside the range of uint16"):
        flax_lm.data.packed.write_packed_split(too_large, str(tmp_path), "train", np.uint16, blocks_per_shard=4)


def test_process_zero_failing_to_pack_still_releases_the_waiting_processes(tokenizer, tmp_path, monkeypatch):
    barriers = []
    monkeypatch.setattr(flax_lm.devices.processes.multihost_utils, "sync_global_devices", barriers.append)
    monkeypatch.setattr(run_clm_flax.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 0)

    def fail(*arguments, **options):
        raise run_clm_flax.UsageError("cannot read the data files")

    monkeypatch.setattr(run_clm_flax, "read_texts", fail)
    with pytest.raises(run_clm_flax.UsageError, match="cannot read the data files"):
        pack(tmp_path / "packed", tokenizer)
    assert barriers == ["packed corpus written"]


def test_only_process_zero_writes_the_packed_corpus(tokenizer, tmp_path, monkeypatch):
    barriers = []
    monkeypatch.setattr(flax_lm.devices.processes.multihost_utils, "sync_global_devices", barriers.append)
    monkeypatch.setattr(run_clm_flax.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 1)
    with pytest.raises(
        run_clm_flax.UsageError,
        match="process 1 finds no packed corpus in --packed_data_dir .*: process 0 failed to pack it",
    ):
        pack(tmp_path / "packed", tokenizer)
    assert barriers and not (tmp_path / "packed").exists(), "process 1 should wait for process 0, not write"

    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 0)
    written = pack(tmp_path / "packed", tokenizer)
    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 1)
    forbid_tokenizing(monkeypatch)
    read = pack(tmp_path / "packed", tokenizer)
    np.testing.assert_array_equal(np.asarray(read["train"]), np.asarray(written["train"]))


# ----------------------------------------------------------------------------------------------------
# The token cache: a packed corpus under the cache directory
# ----------------------------------------------------------------------------------------------------


def load_data(tmp_path, tokenizer, do_train=True, do_eval=True, **data_overrides):
    model_args = run_clm_flax.ModelArguments(cache_dir=str(tmp_path / "cache"))
    settings = {"train_file": str(CORPUS / "train.txt"), "text_sample_by": "document", **data_overrides}
    data_args = run_clm_flax.DataTrainingArguments(**settings)
    training_args = run_clm_flax.TrainingArguments(str(tmp_path / "out"), do_train=do_train, do_eval=do_eval)
    return flax_lm.data.loading.load_data(
        data_args.data_route(model_args, training_args), texts_to_rows(tokenizer)
    ).rows


def test_the_token_cache_holds_the_blocks_of_a_packed_data_dir_in_the_same_format(tokenizer, tmp_path, monkeypatch):
    cached = load_data(tmp_path, tokenizer, packed_tokens_per_shard=2000)
    packed = load_data(tmp_path, tokenizer, packed_data_dir=str(tmp_path / "packed"), packed_tokens_per_shard=2000)
    for split in ("train", "validation"):  # the same blocks, the same 5% of them held out
        np.testing.assert_array_equal(np.asarray(cached[split]), np.asarray(packed[split]))
    expected = expected_blocks(tokenizer, train_texts(), 32)
    validation_size = len(expected) * 5 // 100
    assert len(cached["validation"]) == validation_size and len(cached["train"]) == len(expected) - validation_size

    # The blocks decode to the text, the held-out ones from its start.
    text = (CORPUS / "train.txt").read_text()
    assert text.startswith(tokenizer.decode(cached["validation"][0]))
    assert tokenizer.decode(cached["train"][10]) in text and len(tokenizer.decode(cached["train"][10])) > 60

    # The cache is a packed corpus, sharded as --packed_tokens_per_shard says, that --packed_data_dir reads as it is.
    (cache,) = [path for path in (tmp_path / "cache").iterdir() if path.name.startswith("packed-")]
    index = flax_lm.data.packed.read_packed_index(str(cache))
    assert index["blocks_per_shard"] == 2000 // 32 and len(index["splits"]["train"]["shards"]) > 10
    forbid_tokenizing(monkeypatch)
    as_packed_data_dir = pack(cache, tokenizer, train_file=None)
    np.testing.assert_array_equal(np.asarray(as_packed_data_dir["train"]), expected)
    again = load_data(tmp_path, tokenizer)  # and a later run reads the cache
    np.testing.assert_array_equal(np.asarray(again["train"]), np.asarray(cached["train"]))


def test_a_save_to_disk_directory_is_never_written_into_and_cache_dir_holds_the_tokens(
    tokenizer, tmp_path, monkeypatch
):
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": [*train_lines(), None]}).save_to_disk(str(saved))
    listing = {path: path.stat().st_mtime_ns for path in saved.rglob("*")}
    blocks = load_data(tmp_path, tokenizer, train_file=None, dataset_name=str(saved), skip_missing_texts=True)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(blocks["validation"]), np.asarray(blocks["train"])]),
        expected_blocks(tokenizer, train_lines(), 32),
    )
    assert {path: path.stat().st_mtime_ns for path in saved.rglob("*")} == listing, "the dataset directory changed"
    assert any(path.name.startswith("packed-") for path in (tmp_path / "cache").iterdir())
    forbid_tokenizing(monkeypatch)  # the row left out changes nothing in the cache's fingerprint from run to run
    again = load_data(tmp_path, tokenizer, train_file=None, dataset_name=str(saved), skip_missing_texts=True)
    np.testing.assert_array_equal(np.asarray(again["train"]), np.asarray(blocks["train"]))


@pytest.mark.parametrize("route", ["train_file", "dataset_name folder"])
def test_a_file_rewritten_with_its_old_modification_time_is_read_again(tokenizer, tmp_path, route):
    """The token cache and the conversion `datasets` keeps are keyed by the files' bytes: a JSON Lines file whose every
    text was rewritten, its old modification time restored (as cp -p or a reproducible build leaves it), gives the
    new texts' blocks, read from the files or from a folder of them (--dataset_name)."""
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "train.jsonl"
    old_texts, new_texts = train_lines(), [line.upper() for line in train_lines()]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in old_texts))
    source = {"train_file": str(path)} if route == "train_file" else {"train_file": None, "dataset_name": str(folder)}
    old = load_data(tmp_path, tokenizer, do_eval=False, **source)
    times = path.stat()
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in new_texts))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert path.stat().st_mtime_ns == times.st_mtime_ns  # and its size too, the texts being ASCII upper-cased
    new = load_data(tmp_path, tokenizer, do_eval=False, **source)
    assert "validation" not in new  # nothing held out without evaluation
    np.testing.assert_array_equal(np.asarray(new["train"]), expected_blocks(tokenizer, new_texts, 32))
    assert not np.array_equal(np.asarray(old["train"]), np.asarray(new["train"]))


def test_evaluation_alone_reads_and_tokenizes_only_the_validation_texts(tokenizer, tmp_path, monkeypatch):
    read, tokenized = [], []
    real_resolve, real_token_arrays = flax_lm.data.texts.resolve_data_files, run_clm_flax.token_arrays

    def resolve(pattern, flag):
        read.append(flag)
        return real_resolve(pattern, flag)

    def token_arrays(dataset, tokenizer, text_column, num_workers=None, split="train", around=None):
        tokenized.append(split)
        return real_token_arrays(dataset, tokenizer, text_column, num_workers, split, around)

    monkeypatch.setattr(flax_lm.data.texts, "resolve_data_files", resolve)
    monkeypatch.setattr(run_clm_flax, "token_arrays", token_arrays)
    blocks = load_data(tmp_path, tokenizer, do_train=False, validation_file=str(CORPUS / "validation.txt"))
    assert list(blocks) == ["validation"] and read == ["validation_file"] and tokenized == ["validation"]
    np.testing.assert_array_equal(
        np.asarray(blocks["validation"]), expected_blocks(tokenizer, [(CORPUS / "validation.txt").read_text()], 32)
    )

    splits = {"train": train_lines(), "validation": (CORPUS / "validation.txt").read_text().splitlines()}
    saved = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"text": lines}) for split, lines in splits.items()}
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    tokenized.clear()
    blocks = load_data(tmp_path, tokenizer, do_train=False, train_file=None, dataset_name=str(tmp_path / "saved"))
    assert list(blocks) == ["validation"] and tokenized == ["validation"]


def test_tokenizing_in_worker_processes_gives_the_same_tokens_without_forking_jax(tokenizer, tmp_path, monkeypatch):
    run_clm_flax.jax.devices()  # JAX's runtime and its threads are up, as in a run
    monkeypatch.setattr(flax_lm.data.texts, "TEXTS_PER_BATCH", 40)
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 300)
    lines = datasets.load_dataset(
        "text", data_files=str(CORPUS / "train.txt"), split="train", cache_dir=str(tmp_path / "cache")
    )
    document = (CORPUS / "train.txt").read_text()  # one long document, cut across pieces of 8 KB
    documents = datasets.Dataset.from_dict({"text": ["A first short text.", document, "A last one."]})
    with warnings.catch_warnings(record=True) as caught, flax_lm.data.pieces.pieces_of(2**13 / 2**20):
        warnings.simplefilter("always")
        in_workers = [list(flax_lm.data.texts.token_arrays(data, tokenizer, "text", num_workers=2)) for data in
                      (lines, documents)]  # fmt: skip
        here = [list(flax_lm.data.texts.token_arrays(data, tokenizer, "text", num_workers=1)) for data in
                (lines, documents)]  # fmt: skip
    assert not [warning for warning in caught if "fork" in str(warning.message)], "a process was forked"
    assert len(in_workers[0]) == len(here[0]) > 8 and len(in_workers[1]) == len(here[1]) > 10
    for arrays_in_workers, arrays_here in zip(in_workers, here):
        np.testing.assert_array_equal(np.concatenate(arrays_in_workers), np.concatenate(arrays_here))
    backend, eos = tokenizer.backend_tokenizer, [tokenizer.eos_token_id]
    whole = [backend.encode(text, add_special_tokens=False).ids + eos for text in documents["text"]]
    np.testing.assert_array_equal(np.concatenate(here[1]), np.concatenate(whole))


def test_the_packed_corpus_is_the_same_whatever_the_piece_size(tokenizer, tmp_path):
    documents = datasets.Dataset.from_dict({"text": [(CORPUS / "train.txt").read_text(), "A short text."] * 2})
    source = TextSource(train_file="unused")
    shards, cache_keys = [], set()
    for megabytes in (2**12 / 2**20, 1.0):  # pieces of 4 KB (dozens to the corpus), and one piece
        directory = tmp_path / str(megabytes)
        with flax_lm.data.pieces.pieces_of(megabytes):
            cache_keys.add(flax_lm.data.cache_key.function_code_fingerprint(run_clm_flax.tokenized_rows))
            flax_lm.data.packed.pack_texts(
                str(directory), {"train": documents}, run_clm_flax.tokenized_rows, tokenizer, 32, {"block_size": 32},
                source, tokens_per_shard=32 * 100,
            )  # fmt: skip
        shards.append({path.name: path.read_bytes() for path in directory.glob("train-*.npy")})
    assert len(shards[0]) > 2 and shards[0] == shards[1]
    assert len(cache_keys) == 1  # the token cache is the same too


def test_packing_without_a_terminal_logs_its_progress_and_the_time_left(monkeypatch, caplog):
    monkeypatch.setattr(flax_lm.data.pieces, "PROGRESS_LOG_SECONDS", 0)
    caplog.set_level("INFO", logger="flax_lm.data.pieces")
    progress = flax_lm.data.pieces.PackingProgress("train", total_megabytes=40.0)  # pytest's output is no terminal
    flax_lm.data.pieces.read_progress.add(10_000_000, 3)
    progress.update(1000)
    progress.close()
    assert re.search(r"Packing train: 10.0 of 40.0 MB of text read \([\d.]+ MB/s\), 3 texts, 1,000 rows written, "
                     r"about \d+:\d\d:\d\d left", caplog.text)  # fmt: skip
    assert re.search(r"Packed train: 10.0 MB of text \([\d.]+ MB/s\), 3 texts, 1,000 rows in", caplog.text)


def test_a_packing_run_killed_halfway_goes_on_from_its_finished_shards(tmp_path, monkeypatch):
    def blocks(stop_after=None):
        for number in range(10):  # 10 arrays of 3 rows: 30 rows, shards of 4 rows
            if number == stop_after:
                raise KeyboardInterrupt  # killed while shard 2 is half written
            yield np.arange(number * 96, (number + 1) * 96, dtype=np.int32).reshape(3, 32)

    def write(directory, rows, resume_key="texts"):
        return flax_lm.data.packed.write_packed_corpus(
            str(directory), {"train": rows}, {"block_size": 32}, np.uint16, 32 * 4, resume_key
        )

    uninterrupted = write(tmp_path / "whole", blocks())
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path / "packed", blocks(stop_after=3))
    names = sorted(os.listdir(tmp_path / "packed"))
    assert names[:4] == [
        "packing.json",
        "train-00000.npy",
        "train-00001.npy",
        f"train-00002.npy.{os.getpid()}.tmp.npy",
    ]
    (tmp_path / "packed" / "train-00002.npy").write_bytes(b"half written")  # as if renamed, never recorded
    finished = {name: os.stat(tmp_path / "packed" / name).st_mtime_ns for name in names[1:3]}
    written = []
    monkeypatch.setattr(flax_lm.data.packed.np.lib.format, "open_memmap", lambda *a, **k: written.append(a[0]) or
                        real_open_memmap(*a, **k))  # fmt: skip
    index = write(tmp_path / "packed", blocks())
    assert len(written) == 8 - 2 and not any("00000" in path or "00001" in path for path in written)
    assert {name: os.stat(tmp_path / "packed" / name).st_mtime_ns for name in finished} == finished
    assert sorted(os.listdir(tmp_path / "packed")) == sorted(os.listdir(tmp_path / "whole"))  # no manifest left
    assert index == uninterrupted
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "packed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    with pytest.raises(KeyboardInterrupt):  # other texts: nothing of the interrupted write is kept
        write(tmp_path / "other", blocks(stop_after=3))
    write(tmp_path / "other", (rows + 1 for rows in blocks()), resume_key="other texts")
    assert np.load(tmp_path / "other" / "train-00000.npy")[0, 0] == 1


real_open_memmap = np.lib.format.open_memmap


def test_a_packing_run_killed_halfway_reads_on_from_where_its_finished_shards_end(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(flax_lm.data.texts, "TEXT_PIECE_CHARACTERS", 2000)  # a document cut into dozens of pieces
    documents = datasets.Dataset.from_dict({"text": [(CORPUS / "train.txt").read_text(), "A short text."] * 2})
    encoded, encode_documents = [], flax_lm.data.texts.encode_documents
    monkeypatch.setattr(flax_lm.data.texts, "encode_documents", lambda *arguments: encoded.append(arguments[-1][0])
                        or encode_documents(*arguments))  # fmt: skip

    def pack(directory, stop_after=None):
        def tokenized_rows(*arguments):
            for number, rows in enumerate(run_clm_flax.tokenized_rows(*arguments, num_workers=1)):
                if number == stop_after:
                    raise KeyboardInterrupt  # killed while a shard is half written
                yield rows

        return flax_lm.data.packed.pack_texts(
            str(directory), {"train": documents}, tokenized_rows, tokenizer, 32, {"block_size": 32},
            TextSource(train_file="unused"), tokens_per_shard=32 * 100, resume=True,
        )  # fmt: skip

    with flax_lm.data.pieces.pieces_of(2**12 / 2**20):
        whole, pieces = pack(tmp_path / "whole"), list(encoded)
        with pytest.raises(KeyboardInterrupt):
            pack(tmp_path / "packed", stop_after=len(pieces) // 2)
        finished = len(list((tmp_path / "packed").glob("train-?????.npy")))
        encoded.clear()
        assert pack(tmp_path / "packed") == whole
    assert len(pieces) > 40 and finished > 5
    assert pieces[-len(encoded) :] == encoded and len(encoded) < len(pieces) - len(pieces) // 3  # read on, not again
    assert sorted(os.listdir(tmp_path / "packed")) == sorted(os.listdir(tmp_path / "whole"))
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "packed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_an_unknown_dataset_config_is_named_in_the_message(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "texts.jsonl").write_text('{"text": "a text"}\n')
    arguments = run_clm_flax.DataTrainingArguments(dataset_name=str(tmp_path / "data"), dataset_config_name="wiki")
    with pytest.raises(run_clm_flax.UsageError) as refusal:
        flax_lm.data.texts.load_text_datasets(
            arguments.text_source(run_clm_flax.ModelArguments(cache_dir=str(tmp_path / "cache")))
        )
    message = str(refusal.value)
    assert "--dataset_config_name wiki" in message and "'wiki' not found" in message and "default" in message
    assert "format and encoding" not in message and "\n" not in message


# ----------------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------------


def text_stream(*paths):
    return datasets.load_dataset(
        "text", data_files=[str(path) for path in paths], split="train", streaming=True, keep_linebreaks=True
    )


@pytest.mark.parametrize(
    "extra_arguments, message",
    [
        ([], "--streaming needs --max_steps"),
        (["--max_steps", "5", "--max_train_samples", "10"], "--max_train_samples does not apply to --streaming"),
        (["--max_steps", "5", "--do_eval"], "--streaming --do_eval needs --validation_file"),
    ],
)
def test_streaming_misuse_is_refused(extra_arguments, message, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        "run_clm_flax.py", "--output_dir", str(tmp_path / "out"), "--config_name", model_dir, "--tokenizer_name",
        model_dir, "--train_file", str(CORPUS / "train.txt"), "--block_size", "32", "--streaming", "--do_train",
        *extra_arguments,
    ])  # fmt: skip
    with pytest.raises(run_clm_flax.UsageError, match=message):
        run_clm_flax.main()


@pytest.mark.parametrize("num_files, num_processes", [(1, 2), (1, 3), (2, 2)])
def test_each_process_reads_its_own_share_of_the_stream(num_files, num_processes, tmp_path, monkeypatch):
    lines = train_lines()
    paths = []
    for number in range(num_files):  # one file (every process skips the others' texts) or one file per process
        paths.append(tmp_path / f"part{number}.txt")
        paths[-1].write_text("".join(lines[number::num_files]))
    stream = text_stream(*paths).shuffle(seed=0, buffer_size=50)
    monkeypatch.setattr(run_clm_flax.jax, "process_count", lambda: num_processes)
    shares = []
    for process_index in range(num_processes):
        monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda index=process_index: index)
        shares.append([example["text"] for example in flax_lm.data.loading.stream_share(stream)])
    assert all(len(share) >= len(lines) // num_processes - 1 for share in shares), "the shares are unbalanced"
    assert sorted(itertools.chain.from_iterable(shares)) == sorted(lines), "the shares overlap or miss texts"


def test_streaming_batches_hold_this_process_rows_and_resume_where_they_stopped(tokenizer, monkeypatch):
    stream = text_stream(CORPUS / "train.txt")
    monkeypatch.setattr(run_clm_flax.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 1)

    def batches(first_batch=0, seed=0):

        def rows_of_texts(texts):
            return run_clm_flax.tokenized_rows(texts, "train", tokenizer, 32, TextSource())

        return flax_lm.data.loading.streaming_train_batches(stream, rows_of_texts, 16, seed, 100, first_batch)

    # 160 batches of 8 rows run past the end of this process's share (about 420 blocks): the stream repeats.
    uninterrupted = [batch["input_ids"] for batch in itertools.islice(batches(), 160)]
    assert all(batch.shape == (8, 32) and batch.dtype == np.int32 for batch in uninterrupted)
    resumed = [batch["input_ids"] for batch in itertools.islice(batches(first_batch=150), 10)]
    np.testing.assert_array_equal(np.stack(resumed), np.stack(uninterrupted[150:]))
    # The shuffle follows the seed, and each pass over the stream is shuffled anew.
    other_seed = next(batches(seed=1))["input_ids"]
    assert not np.array_equal(other_seed, uninterrupted[0])
    first_pass, second_pass = np.concatenate(uninterrupted[:40]), np.concatenate(uninterrupted[90:130])
    assert not np.array_equal(first_pass, second_pass)


def test_a_process_whose_share_of_the_stream_is_empty_is_refused(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "one.txt").write_text("The only text.\n")
    monkeypatch.setattr(run_clm_flax.jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_clm_flax.jax, "process_index", lambda: 1)

    def rows_of_texts(texts):
        return run_clm_flax.tokenized_rows(texts, "train", tokenizer, 32, TextSource())

    batches = flax_lm.data.loading.streaming_train_batches(text_stream(tmp_path / "one.txt"), rows_of_texts, 2, 0, 10)
    with pytest.raises(run_clm_flax.UsageError, match="process 1's share of the training stream holds no text"):
        next(batches)


def test_a_stream_whose_every_text_the_script_drops_is_refused_not_read_forever(tokenizer, tmp_path):
    (tmp_path / "texts.txt").write_text("".join(f"Document number {number}.\n" for number in range(300)))
    kept = {"word": "number 7"}

    def rows_of_texts(texts):  # a document filter in tokenized_rows, where docs/where-to-edit.md puts one
        texts = texts.filter(lambda row: kept["word"] in row["text"])
        return run_clm_flax.tokenized_rows(texts, "train", tokenizer, 32, TextSource())

    def first_batch():
        stream = text_stream(tmp_path / "texts.txt")  # a document a line
        return next(flax_lm.data.loading.streaming_train_batches(stream, rows_of_texts, 2, 0, 10))

    # A filter that keeps a few documents (31 of 300) trains on them, though a pass ends before its first row.
    rows = first_batch()["input_ids"]
    numbers = re.findall(r"Document number (\d+)\.", tokenizer.decode(rows.ravel()))
    assert rows.shape == (2, 32) and len(numbers) >= 3 and all("7" in number for number in numbers), numbers
    kept["word"] = "number 1000"
    with pytest.raises(run_clm_flax.UsageError, match="share of the training stream makes no row: .*filter"):
        first_batch()


def test_streamed_evaluation_blocks_are_the_first_blocks_of_the_validation_stream(tokenizer):
    arguments = data_arguments(None, train_file=None, validation_file=str(CORPUS / "validation.txt"))
    source = arguments.text_source(run_clm_flax.ModelArguments())
    stream = flax_lm.data.texts.load_text_datasets(source, streaming=True)["validation"]
    texts = [(CORPUS / "validation.txt").read_text()]  # one document: the file as written
    expected = expected_blocks(tokenizer, texts, 32)

    def rows():
        return run_clm_flax.tokenized_rows(stream, "validation", tokenizer, 32, source)

    np.testing.assert_array_equal(flax_lm.data.loading.first_blocks(rows(), 32, 50), expected[:50])
    np.testing.assert_array_equal(flax_lm.data.loading.first_blocks(rows(), 32, None), expected)


def test_every_route_trains_on_every_block_unless_the_run_evaluates(tokenizer, tmp_path):
    """The token cache and --streaming train on the same blocks, all of them, without --do_eval; with it, the first
    --validation_split_percentage are held out (a stream, of no known length, needs a validation file instead)."""
    source = data_arguments(None).text_source(run_clm_flax.ModelArguments(cache_dir=str(tmp_path)))
    every_block = expected_blocks(tokenizer, train_texts(), 32)

    def rows(**route):
        return flax_lm.data.loading.load_data(
            flax_lm.data.loading.DataRoute(source, **route), texts_to_rows(tokenizer)
        ).rows

    training_only = rows(do_eval=False)
    assert training_only.keys() == {"train"}
    np.testing.assert_array_equal(np.asarray(training_only["train"]), every_block)
    np.testing.assert_array_equal(np.asarray(rows(do_eval=False, validation_split_percentage=0)["train"]), every_block)
    streamed = flax_lm.data.loading.load_data(
        flax_lm.data.loading.DataRoute(source, do_eval=False, streaming=True), texts_to_rows(tokenizer)
    )
    assert streamed.rows == {}
    stream_rows = texts_to_rows(tokenizer).rows_of(streamed.train_stream, "train", source, None)
    np.testing.assert_array_equal(flax_lm.data.loading.first_blocks(stream_rows, 32, None), every_block)
    evaluated = rows(do_eval=True)
    held_out = len(every_block) * 5 // 100
    np.testing.assert_array_equal(np.asarray(evaluated["validation"]), every_block[:held_out])
    np.testing.assert_array_equal(np.asarray(evaluated["train"]), every_block[held_out:])
    with pytest.raises(
        run_clm_flax.UsageError, match="--validation_split_percentage 0 holds none .* --validation_file"
    ):
        rows(do_eval=True, validation_split_percentage=0)


def test_stream_without_the_text_column_is_refused(tokenizer, tmp_path):
    data_file = tmp_path / "data.jsonl"
    data_file.write_text('{"body": "a text"}\n' * 3)
    stream = datasets.load_dataset("json", data_files=str(data_file), split="train", streaming=True)
    with pytest.raises(run_clm_flax.UsageError, match="no column 'text' .*pass --text_column_name"):
        rows = run_clm_flax.tokenized_rows(stream, "validation", tokenizer, 32, TextSource())
        flax_lm.data.loading.first_blocks(rows, 32, None)


# ----------------------------------------------------------------------------------------------------
# Compressed data files
# ----------------------------------------------------------------------------------------------------


def compressed_copies(directory, texts):
    """The same documents as .txt (one file, one document), .jsonl and .csv, each plain and gzip/bz2/xz-compressed."""
    import bz2
    import csv
    import gzip
    import io
    import lzma

    contents = {"corpus.txt": "".join(texts)}
    contents["corpus.jsonl"] = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    table = io.StringIO()
    csv.writer(table).writerows([["text"], *([text] for text in texts)])
    contents["corpus.csv"] = table.getvalue()
    paths = {}
    for name, content in contents.items():
        paths[name] = directory / name
        paths[name].write_text(content)
        for suffix, opener in ((".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)):
            with opener(directory / (name + suffix), "wt") as file:
                file.write(content)
            paths[name + suffix] = directory / (name + suffix)
    return paths


@pytest.mark.parametrize("streaming", [False, True], ids=["from-files", "from-a-stream"])
def test_compressed_files_give_the_blocks_of_the_uncompressed_ones(streaming, tokenizer, tmp_path):
    texts = train_lines()[:40]
    paths = compressed_copies(tmp_path, texts)
    blocks = {}
    for name, path in paths.items():
        blocks[name] = np.asarray(
            pack(tmp_path / f"packed-{name}", tokenizer, train_file=str(path), streaming=streaming)["train"]
        )
    for name in paths:
        file_format = name.split(".")[1]  # corpus.FORMAT[.COMPRESSION]
        expected = expected_blocks(tokenizer, ["".join(texts)] if file_format == "txt" else texts, 32)
        assert len(expected) > 5
        np.testing.assert_array_equal(blocks[name], expected, err_msg=name)


@pytest.mark.parametrize(
    "name, message",
    [
        ("corpus.txt.zip", "unsupported extension; use one of .txt, .text, .json, .jsonl, .csv, .parquet, or one of"),
        ("corpus.md.gz", "corpus.md.gz has an unsupported extension"),
        ("corpus.parquet.gz", "compressed Parquet file; Parquet compresses inside"),
    ],
)
def test_a_compressed_file_of_no_known_format_is_one_clear_line(name, message, tmp_path):
    path = tmp_path / name
    path.write_bytes(b"not empty")
    with pytest.raises(flax_lm.errors.UsageError, match=message):
        flax_lm.data.data_files.resolve_data_files(str(path), "train_file")


def test_data_files_are_resolved_by_one_rule_for_the_scripts_and_the_tokenizer(tmp_path, monkeypatch):
    for name in ["b.txt", "a.jsonl", "deep/er/c.txt", "deep/d.txt", "folder.txt/e.txt", "blank/f.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n" if name.endswith("jsonl") else name + "\n")
    (tmp_path / "blank/g.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)

    # '**' reaches every depth, its own folder included; a folder a glob matches is left out; a file named twice
    # is read once, where it was first named; each glob's matches are sorted.
    groups = flax_lm.data.data_files.resolve_data_files(["deep/d.txt", "**/*.txt", "*.jsonl"], "train_file")
    assert groups == {
        "text": ["deep/d.txt", "b.txt", "blank/f.txt", "deep/er/c.txt", "folder.txt/e.txt"],
        "json": ["a.jsonl"],
    }
    source = TextSource(train_file=["deep/d.txt", "**/*.txt", "*.jsonl"], text_sample_by="line")
    sources = flax_lm.data.text_stream.open_text_sources(source)
    assert [description for description, *_ in sources] == ["5 text files", "a.jsonl"]
    counts = flax_lm.data.text_stream.ReadCounts()
    texts = [text for batch in flax_lm.data.text_stream.counted_text_batches(sources, counts) for text in batch]
    assert "".join(texts).split() == [*groups["text"], *groups["json"]]

    refusals = {
        "deep": "--train_file deep is a directory; pass the files in it ('deep/*.txt', 'deep/**/*.jsonl')",
        "nowhere/**/*.txt": "--train_file nowhere/**/*.txt matches no file; check the path, and quote the pattern",
        "blank/*": "--train_file: blank/g.jsonl is empty; leave it out",
        "missing.txt": "--train_file: missing.txt does not exist or is not a file",
    }
    for pattern, message in refusals.items():
        with pytest.raises(flax_lm.errors.UsageError) as error:
            flax_lm.data.data_files.resolve_data_files(pattern, "train_file")
        assert str(error.value).startswith(message)
        with pytest.raises(flax_lm.errors.UsageError) as error:
            flax_lm.data.text_stream.open_text_sources(TextSource(train_file=[pattern]))
        assert str(error.value).startswith(message)


def test_a_zstandard_file_without_the_package_names_the_package(tmp_path, monkeypatch):
    path = tmp_path / "corpus.jsonl.zst"
    path.write_bytes(b"not empty")
    importlib_util = flax_lm.data.data_files.importlib.util
    find_spec = importlib_util.find_spec
    monkeypatch.setattr(importlib_util, "find_spec", lambda name: None if name == "zstandard" else find_spec(name))
    with pytest.raises(flax_lm.errors.UsageError, match="needs the zstandard package: pip install zstandard"):
        flax_lm.data.data_files.resolve_data_files(str(path), "train_file")


def test_train_files_of_several_formats_are_all_read_each_format_by_its_own_builder(tokenizer, tmp_path):
    texts = train_lines()[:60]
    (tmp_path / "a.txt").write_text("".join(texts[:20]))  # one document
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": text, "id": 1}) + "\n" for text in texts[20:40]))
    with gzip.open(tmp_path / "c.csv.gz", "wt") as file:
        csv.writer(file).writerows([["text"], *([text] for text in texts[40:])])
    patterns = [str(tmp_path / "a.txt"), str(tmp_path / "c.csv.gz"), str(tmp_path / "*.jsonl")]
    for streaming in (False, True):
        blocks = pack(tmp_path / f"packed-{streaming}", tokenizer, train_file=patterns, streaming=streaming)
        # Format after format, in the order the flags name them: the .txt document, the CSV rows, the JSON rows.
        documents = ["".join(texts[:20]), *texts[40:], *texts[20:40]]
        np.testing.assert_array_equal(np.asarray(blocks["train"]), expected_blocks(tokenizer, documents, 32))


def test_a_byte_order_mark_is_dropped_with_a_note(tokenizer, tmp_path, caplog):
    text = "".join(train_lines()[:30])
    (tmp_path / "plain.txt").write_text(text)
    (tmp_path / "marked.txt").write_text("\ufeff" + text)  # as an editor saves "UTF-8 with BOM"
    with gzip.open(tmp_path / "marked.txt.gz", "wt") as file:
        file.write("\ufeff" + text)
    expected = np.asarray(pack(tmp_path / "packed-plain", tokenizer, train_file=str(tmp_path / "plain.txt"))["train"])
    assert tokenizer("\ufeff")["input_ids"], "the mark would be trained on as a token"
    for name in ("marked.txt", "marked.txt.gz"):
        with caplog.at_level("INFO", logger="flax_lm.data.texts"):
            blocks = pack(tmp_path / f"packed-{name}", tokenizer, train_file=str(tmp_path / name))["train"]
        np.testing.assert_array_equal(np.asarray(blocks), expected, err_msg=name)
        assert "train: dropped the byte-order mark (U+FEFF) at the start of 1 text(s)" in caplog.text
        caplog.clear()
