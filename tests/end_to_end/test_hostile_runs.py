"""Hostile inputs to the scripts run as commands: the exit status, the one line on stderr and the files on disk."""

import hashlib
import os
import shutil

import pytest
from test_hostile_inputs import CLM, MISSING_TEXT, TOKENIZER, hostile_paths, script_arguments


@pytest.fixture(scope="module")
def paths(gpt2_tokenizer_dir, roberta_tokenizer_dir, tmp_path_factory):
    return hostile_paths(tmp_path_factory.mktemp("hostile"), gpt2_tokenizer_dir, roberta_tokenizer_dir)


def assert_one_error_line(result, *fragments):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ")
    for fragment in fragments:
        assert fragment in last_line


def test_rows_without_text_end_the_command_with_one_line(run_tool, paths, tmp_path):
    arguments = script_arguments("run_clm_flax", [*CLM, "--train_file", "{null}"], paths, tmp_path)
    result = run_tool("run_clm_flax.py", *arguments)
    assert_one_error_line(result, "null.jsonl", *MISSING_TEXT)


def test_an_uncached_hub_dataset_offline_ends_the_command_with_one_line(run_tool, paths, tmp_path):
    arguments = [argument for argument in CLM if argument not in ("--train_file", "{train}")]
    arguments += ["--dataset_name", "no-such-user/no-such-dataset"]  # run_tool runs the scripts offline
    result = run_tool("run_clm_flax.py", *script_arguments("run_clm_flax", arguments, paths, tmp_path))
    assert_one_error_line(result, "no-such-user/no-such-dataset", "it is not in the cache")
    assert not (tmp_path / "out").exists()


def test_whitespace_only_text_leaves_a_tokenizer_it_would_overwrite_as_it_was(run_tool, paths, tmp_path):
    shutil.copytree(paths["gpt2"], tmp_path / "tokenizer")
    before = hashlib.sha256((tmp_path / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    result = run_tool(
        "train_tokenizer.py", *TOKENIZER, paths["whitespace"], "--output_dir", tmp_path / "tokenizer", "--overwrite"
    )
    assert_one_error_line(result, "only whitespace")
    assert hashlib.sha256((tmp_path / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest() == before


@pytest.fixture(scope="module")
def run_skipping_rows(run_tool, paths, tmp_path_factory):
    """A short CLM run on a file with a null row, with --skip_missing_texts, and that file also as validation."""
    directory = tmp_path_factory.mktemp("skipping")
    arguments = [*CLM, "--train_file", "{null}", "--validation_file", "{null}", "--skip_missing_texts"]
    arguments += ["--max_steps", "1"]
    result = run_tool("run_clm_flax.py", *script_arguments("run_clm_flax", arguments, paths, directory))
    assert result.returncode == 0, result.stderr[-3000:]
    return result, directory / "out"


def test_skipped_rows_are_counted_in_the_log(run_skipping_rows):
    result, _ = run_skipping_rows
    for split in ("train", "validation"):
        assert f"{split}: left out 1 of 300 rows without text, the first at row 58 of" in result.stderr


def test_the_same_file_for_training_and_validation_is_warned_of(run_skipping_rows):
    result, _ = run_skipping_rows
    assert "WARNING" in result.stderr and "--train_file and --validation_file share" in result.stderr


def test_the_exported_weights_have_the_mode_of_the_other_files(run_skipping_rows):
    _, output_dir = run_skipping_rows
    mode = os.stat(output_dir / "model.safetensors").st_mode & 0o777
    assert mode == os.stat(output_dir / "config.json").st_mode & 0o777
    umask = os.umask(0o022)
    os.umask(umask)
    assert mode == 0o666 & ~umask
