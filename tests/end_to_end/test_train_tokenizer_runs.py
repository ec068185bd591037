"""train_tokenizer.py run as a user runs it: the files and formats it reads, its arguments in a JSON file, and its
refusals, each one line on stderr with nothing written."""

import gzip
import json
import lzma
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest
from test_train_tokenizer import CORPUS_DIR
from transformers import AutoTokenizer


def assert_single_error_line(result, *expected_words):
    """A bad input ends with status 2 and one line on stderr that says what is wrong, without a traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for word in expected_words:
        assert word in lines[0]


def rows_of_mixed_corpus():
    with open(CORPUS_DIR / "mixed.jsonl", encoding="utf-8") as jsonl_file:
        return [json.loads(line) for line in jsonl_file]


def test_reads_jsonl_csv_and_parquet_together_and_keeps_other_files(run_tool, tmp_path):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows_of_mixed_corpus()), tmp_path / "mixed.parquet")
    output_dir = tmp_path / "model"
    output_dir.mkdir()
    (output_dir / "config.json").write_text('{"model_type": "gpt2"}')

    result = run_tool(
        "train_tokenizer.py",
        "--train_file", CORPUS_DIR / "mixed.jsonl", CORPUS_DIR / "mixed.csv", tmp_path / "mixed.parquet",
        "--vocab_size", 400,
        "--output_dir", output_dir,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert f"Trained on {3 * len(rows_of_mixed_corpus())} texts" in result.stdout
    assert (output_dir / "config.json").read_text() == '{"model_type": "gpt2"}'
    assert (output_dir / "tokenizer.json").is_file()
    # The summary names the directory and the vocabulary size and shows a sample from the corpus.
    assert str(output_dir) in result.stdout
    assert "vocab size: 400" in result.stdout
    assert "sample: 'The morning train was late again" in result.stdout
    assert "ids: [" in result.stdout


def test_reads_a_dataset_saved_with_save_to_disk_up_to_max_texts(run_tool, tmp_path):
    saved = datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"body": row["text"]} for row in rows_of_mixed_corpus()]),
        validation=datasets.Dataset.from_list([{"body": "not this split"}]),
    )
    saved.save_to_disk(tmp_path / "saved")

    result = run_tool(
        "train_tokenizer.py",
        "--dataset_name", tmp_path / "saved",
        "--text_column_name", "body",
        "--max_texts", 50,
        "--vocab_size", 300,
        "--output_dir", tmp_path / "tokenizer",
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert "Trained on 50 texts" in result.stdout
    assert AutoTokenizer.from_pretrained(tmp_path / "tokenizer").bos_token == "<|endoftext|>"


def test_a_single_json_file_of_arguments_works_like_flags(run_tool, tmp_path):
    arguments = {
        "train_file": str(CORPUS_DIR / "korean.txt"),
        "model_type": "roberta",
        "vocab_size": 300,
        "max_characters": 200,
        "output_dir": str(tmp_path / "tokenizer"),
    }
    (tmp_path / "arguments.json").write_text(json.dumps(arguments))

    result = run_tool("train_tokenizer.py", tmp_path / "arguments.json")

    assert result.returncode == 0, result.stderr
    assert "(200 characters" in result.stdout
    assert AutoTokenizer.from_pretrained(tmp_path / "tokenizer").mask_token == "<mask>"


@pytest.fixture(scope="module")
def refusals(run_tool, gpt2_tokenizer_dir, tmp_path_factory):
    """Every bad input of this module, run side by side (most of each run is Python starting up).

    Returns the scratch directory they ran in and their CompletedProcess by name.
    """
    scratch = tmp_path_factory.mktemp("refusals")
    (scratch / "empty.txt").write_text("\n\n")
    shutil.copytree(gpt2_tokenizer_dir, scratch / "existing")
    english = CORPUS_DIR / "english.txt"
    cases = {
        "missing file": ["--train_file", scratch / "missing.txt", "--output_dir", scratch / "out-missing"],
        "empty corpus": ["--train_file", scratch / "empty.txt", "--output_dir", scratch / "out-empty"],
        "unknown column": [
            "--train_file", CORPUS_DIR / "mixed.jsonl",
            "--text_column_name", "content",
            "--output_dir", scratch / "out-column",
        ],
        "vocab too small": [
            "--train_file", english,
            "--model_type", "roberta",
            "--vocab_size", 260,
            "--output_dir", scratch / "out-vocab",
        ],
        "existing tokenizer": ["--train_file", english, "--vocab_size", 300, "--output_dir", scratch / "existing"],
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_tool, "train_tokenizer.py", *args) for name, args in cases.items()}
    return scratch, {name: future.result() for name, future in futures.items()}


def test_missing_file_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["missing file"], "--train_file", "missing.txt", "does not exist")
    assert not (scratch / "out-missing").exists()


def test_empty_corpus_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["empty corpus"], "no text found", "empty.txt")
    assert not (scratch / "out-empty").exists()


def test_unknown_text_column_is_refused_with_the_columns_there_are(refusals):
    scratch, results = refusals

    assert_single_error_line(results["unknown column"], "no column 'content'", "text, language", "--text_column_name")
    assert not (scratch / "out-column").exists()


def test_vocab_smaller_than_bytes_plus_special_tokens_is_refused(refusals):
    scratch, results = refusals

    # 256 byte tokens and RoBERTa's 5 special tokens need 261 ids.
    assert_single_error_line(results["vocab too small"], "--vocab_size 260", "at least 261")
    assert not (scratch / "out-vocab").exists()


def test_existing_tokenizer_is_kept_unless_overwrite_is_given(refusals, gpt2_tokenizer_dir):
    scratch, results = refusals

    assert_single_error_line(results["existing tokenizer"], "--overwrite")
    for original in Path(gpt2_tokenizer_dir).iterdir():
        assert (scratch / "existing" / original.name).read_bytes() == original.read_bytes()


def test_compressed_files_train_the_tokenizer_of_the_plain_ones(run_tool, tmp_path):
    plain, compressed = tmp_path / "plain", tmp_path / "compressed"
    plain.mkdir(), compressed.mkdir()
    for name in ("mixed.jsonl", "mixed.csv"):
        content = (CORPUS_DIR / name).read_bytes()
        (plain / name).write_bytes(content)
    with gzip.open(compressed / "mixed.jsonl.gz", "wb") as file:
        file.write((CORPUS_DIR / "mixed.jsonl").read_bytes())
    with lzma.open(compressed / "mixed.csv.xz", "wb") as file:
        file.write((CORPUS_DIR / "mixed.csv").read_bytes())
    vocabularies = []
    for inputs in (plain, compressed):
        files = sorted(str(path) for path in inputs.iterdir())
        result = run_tool(
            "train_tokenizer.py", "--train_file", *files, "--vocab_size", 400, "--output_dir", inputs / "model"
        )
        assert result.returncode == 0, result.stderr
        assert f"Trained on {2 * len(rows_of_mixed_corpus())} texts" in result.stdout
        vocabularies.append(json.loads((inputs / "model" / "tokenizer.json").read_text())["model"]["vocab"])
    assert vocabularies[0] == vocabularies[1]
