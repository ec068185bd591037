"""A training script copied out of the repository runs anywhere, with flax_lm from the installed package; a training
checkpoint written by run_clm_flax.py before flax_lm existed (commit 37bf3fd) resumes with the current script."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from safetensors.numpy import load_file
from transformers import GPT2Config, RobertaConfig

TRAIN_FILE = FIXTURES_DIR / "en" / "train.txt"
OLD_CLM_RUN = FIXTURES_DIR / "clm-37bf3fd"  # see its README.md
MODEL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json"]
MLM_SEQUENCE_LENGTH = 32


@pytest.fixture(scope="module")
def outside_env(tmp_path_factory):
    """The environment of a run outside the repository: offline, on the CPU, with no PYTHONPATH (nor XLA_FLAGS,
    which could split the CPU into several devices: the old checkpoint was written on one)."""
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path_factory.mktemp("hf_home")),
        TOKENIZERS_PARALLELISM="false",
        JAX_PLATFORMS="cpu",
    )
    return env


@pytest.fixture(scope="module")
def installed_flax_lm(outside_env, tmp_path_factory):
    """Fail unless this Python imports flax_lm from a directory other than the repository's on sys.path: the
    installed package, which the scripts copied out of the repository need."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    probe = "import sys, flax_lm; print(flax_lm.__file__); print(*sys.path, sep='\\n')"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=outside_env, cwd=elsewhere, timeout=120
    )
    if result.returncode != 0:
        pytest.fail(
            f"flax_lm is not installed in {sys.executable}, so a script copied out of the repository cannot import "
            f"it: run `pip install -r requirements.txt` in {REPO_DIR} (it installs flax_lm editable).\n"
            + result.stderr[-2000:]
        )
    package_file, *search_path = result.stdout.splitlines()
    repository_on_path = [entry for entry in search_path if Path(elsewhere, entry).resolve() == REPO_DIR]
    assert not repository_on_path, (
        f"the repository is on sys.path outside it, so the test proves nothing: {search_path}"
    )
    return package_file


def run_copy(script: Path, arguments: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *map(str, arguments)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def tiny_model_dir(script_name: str, tokenizer_dir: Path, directory: Path) -> Path:
    """The 1000-token test tokenizer with a 1-layer, 32-wide model of the script's kind."""
    shutil.copytree(tokenizer_dir, directory)
    if script_name == "run_clm_flax.py":
        config = GPT2Config(
            vocab_size=1000, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
    else:
        config = RobertaConfig(
            vocab_size=1000,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=MLM_SEQUENCE_LENGTH + 2,
            type_vocab_size=1,
            bos_token_id=0,
            pad_token_id=1,  # the tokenizer's <pad>
            eos_token_id=2,
        )
    config.save_pretrained(directory)
    return directory


COPIES = {"run_clm_flax.py": "my_clm_run.py", "run_mlm_flax.py": "my_mlm_run.py"}


@pytest.fixture(scope="module", params=list(COPIES))
def copied_run(request, installed_flax_lm, outside_env, gpt2_tokenizer_dir, roberta_tokenizer_dir, tmp_path_factory):
    """The script copied out of the repository under another name and run for 2 steps with the working directory
    elsewhere again; returns (the copy, the output directory, the CompletedProcess)."""
    script_name = request.param
    root = tmp_path_factory.mktemp(COPIES[script_name].removesuffix(".py"))
    copy = root / "scripts" / COPIES[script_name]
    copy.parent.mkdir()
    shutil.copyfile(REPO_DIR / script_name, copy)
    tokenizer_dir = gpt2_tokenizer_dir if script_name == "run_clm_flax.py" else roberta_tokenizer_dir
    model_dir = tiny_model_dir(script_name, tokenizer_dir, root / "model")
    cwd = root / "work"
    cwd.mkdir()
    if script_name == "run_clm_flax.py":
        own_arguments = ["--block_size", 32, "--sample_tokens", 0]
    else:
        own_arguments = ["--max_seq_length", MLM_SEQUENCE_LENGTH, "--fill_mask_top_k", 0]
    arguments = [
        "--output_dir", "out", "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", TRAIN_FILE, "--do_train", "--per_device_train_batch_size", 4, "--max_steps", 2,
        "--logging_steps", 1, "--report_to", "none", "--cache_dir", root / "cache", *own_arguments,
    ]  # fmt: skip
    result = run_copy(copy, arguments, cwd, outside_env)
    return copy, cwd / "out", result


def test_a_copied_script_trains_and_exports_from_another_directory(copied_run):
    copy, output_dir, result = copied_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "model.safetensors").is_file(), sorted(os.listdir(output_dir))


def test_the_output_directory_holds_the_copy_of_the_script_that_ran(copied_run):
    copy, output_dir, result = copied_run
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = output_dir / copy.name
    assert recorded.is_file(), sorted(os.listdir(output_dir))
    assert recorded.read_bytes() == copy.read_bytes()


@pytest.fixture(scope="module")
def resumed_old_run(outside_env, tmp_path_factory):
    """checkpoints/3 of the 37bf3fd run resumed to step 6 by the current run_clm_flax.py, with the run's arguments
    but other paths than those its progress record holds (model, corpus, output and cache directories); returns
    (the output directory, the CompletedProcess). --do_eval: that version held out 5% of the blocks whether the run
    evaluated or not, and today's holds them out only where it does, so that it trains on the same rows."""
    root = tmp_path_factory.mktemp("resume-37bf3fd")
    model_dir = root / "tiny-gpt2"
    model_dir.mkdir()
    for name in MODEL_FILES:
        shutil.copyfile(OLD_CLM_RUN / name, model_dir / name)
    train_file = root / "corpus" / "train.txt"
    train_file.parent.mkdir()
    shutil.copyfile(TRAIN_FILE, train_file)
    output_dir = root / "resumed"
    shutil.copytree(OLD_CLM_RUN / "checkpoints" / "3", output_dir / "checkpoints" / "3")
    arguments = [
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", train_file, "--do_train", "--do_eval", "--block_size", 32, "--per_device_train_batch_size", 4,
        "--learning_rate", "1e-3", "--seed", 0, "--sample_tokens", 0, "--max_steps", 6, "--logging_steps", 1,
        "--save_steps", 3, "--save_total_limit", 2, "--report_to", "none", "--cache_dir", root / "cache",
        "--resume_from_checkpoint",
    ]  # fmt: skip
    result = run_copy(REPO_DIR / "run_clm_flax.py", arguments, root, outside_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir, result


def test_the_checkpoint_of_the_pre_split_script_is_resumed_at_step_3(resumed_old_run):
    output_dir, result = resumed_old_run
    assert re.search(r"Resumed from \S+ at step 3\n", result.stderr), result.stderr[-3000:]
    assert "the training data changed" not in result.stderr, "it records no count of training examples to compare"


def test_resuming_it_exports_the_model_of_the_uninterrupted_run(resumed_old_run):
    """Within 1e-6, as another CPU may round differently from the one that made step-6-model.safetensors (on that one
    the two are bit-identical); a step of Adam at learning rate 1e-3 moves a weight by about 1e-3."""
    output_dir, result = resumed_old_run
    exported = load_file(str(output_dir / "model.safetensors"))
    expected = load_file(str(OLD_CLM_RUN / "step-6-model.safetensors"))
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        np.testing.assert_allclose(exported[name], tensor, rtol=0, atol=1e-6, err_msg=name)
