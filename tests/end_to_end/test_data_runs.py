"""Training from a --packed_data_dir through run_clm_flax.py's main(): a run that only packs, then runs that read the
packed corpus without tokenizing."""

import json
import sys

import numpy as np
import pytest
from test_clm import model_dir_with_config, run_clm_flax
from test_data import CORPUS, forbid_tokenizing


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer (its ids fit in uint16) with a tiny GPT-2."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("data-model"))


def test_training_from_a_packed_data_dir(model_dir, tmp_path, monkeypatch, capfd):
    packed_dir = tmp_path / "packed"
    common = [
        "--config_name", model_dir, "--tokenizer_name", model_dir, "--block_size", "32",
        "--packed_data_dir", str(packed_dir), "--sample_tokens", "0",
    ]  # fmt: skip
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "run_clm_flax.py",
            "--output_dir",
            str(tmp_path / "unused"),
            *common,
            "--train_file",
            str(CORPUS / "train.txt"),
            "--streaming",
        ],
    )
    run_clm_flax.main()  # no --do_train or --do_eval: only pack
    assert (packed_dir / "index.json").is_file() and not (tmp_path / "unused").exists()

    forbid_tokenizing(monkeypatch)
    output_dir = tmp_path / "trained"
    monkeypatch.setattr(sys, "argv", [
        "run_clm_flax.py", "--output_dir", str(output_dir), *common, "--do_train", "--do_eval", "--max_steps", "30",
        "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--logging_steps", "10",
    ])  # fmt: skip
    run_clm_flax.main()
    packed = json.loads((packed_dir / "index.json").read_text())["splits"]["train"]["num_blocks"]
    assert f"epochs of {packed - packed * 5 // 100} blocks" in capfd.readouterr().err  # 5% held out for evaluation
    eval_loss = json.loads((output_dir / "eval_results.json").read_text())["eval_loss"]
    assert eval_loss < np.log(1000) - 0.5
