"""Shared test helpers: run a script of the repository offline, and small tokenizers trained on the test corpus."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO_DIR / "tests" / "fixtures"
# The multilingual corpus (English, Norwegian, Turkish, Korean) plus about 110 KB of English prose.
TOKENIZER_TRAINING_FILES = sorted((FIXTURES_DIR / "corpus").glob("*.txt")) + [FIXTURES_DIR / "en" / "train.txt"]


@pytest.fixture(scope="session")
def run_tool(tmp_path_factory):
    """Run a script of the repository in a fresh Python process, offline; returns the CompletedProcess."""
    hf_home = tmp_path_factory.mktemp("hf_home")

    def run(script, *args, cwd=None):
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(hf_home))
        command = [sys.executable, str(REPO_DIR / script), *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)

    return run


@pytest.fixture(scope="session")
def test_tokenizer_dirs(run_tool, tmp_path_factory):
    """A GPT-2 and a RoBERTa tokenizer of 1000 tokens with model_max_length 256, trained side by side."""
    output_dirs = {
        model_type: tmp_path_factory.mktemp(f"{model_type}_tokenizer") for model_type in ["gpt2", "roberta"]
    }

    def train(model_type):
        return run_tool(
            "train_tokenizer.py",
            "--train_file", *TOKENIZER_TRAINING_FILES,
            "--model_type", model_type,
            "--vocab_size", 1000,
            "--model_max_length", 256,
            "--output_dir", output_dirs[model_type],
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(output_dirs, pool.map(train, output_dirs)))
    for result in results.values():
        assert result.returncode == 0, result.stderr
    return output_dirs


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(test_tokenizer_dirs):
    """The GPT-2 test tokenizer. Shared by all tests: copy it before writing into it."""
    return test_tokenizer_dirs["gpt2"]


@pytest.fixture(scope="session")
def roberta_tokenizer_dir(test_tokenizer_dirs):
    """The RoBERTa test tokenizer. Shared by all tests: copy it before writing into it."""
    return test_tokenizer_dirs["roberta"]
