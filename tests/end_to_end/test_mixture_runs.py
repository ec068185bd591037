"""Training on a --data_mixture through the scripts' main(): each source in its proportion at every step, evaluated on
its own, resumed exactly; run_mlm_flax.py mixes too."""

import json
import shutil
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_clm import model_dir_with_config, run_clm_flax, scalars
from test_mixture import ROWS_OFF_WEIGHT, SOURCES, clm_arguments, write_mixture
from test_mlm import run_mlm_flax
from transformers import RobertaConfig


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("mixture-model"))


def test_a_mixture_trains_in_its_proportions_evaluates_each_source_and_resumes_exactly(
    model_dir, tmp_path, monkeypatch, capfd
):
    mixture = write_mixture(tmp_path, **SOURCES)
    output_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path / "data")  # the mixture's paths are relative to its own directory, not to here
    monkeypatch.setattr(sys, "argv", clm_arguments(model_dir, output_dir, mixture))
    run_clm_flax.main()

    train_results = json.loads((output_dir / "train_results.json").read_text())
    rows = 12 * 8
    assert train_results["train_tokens_english"] + train_results["train_tokens_nordic"] == rows * 32
    assert abs(train_results["train_tokens_english"] / 32 - rows * 0.75) <= ROWS_OFF_WEIGHT
    assert abs(train_results["train_token_share_nordic"] - 0.25) <= ROWS_OFF_WEIGHT / rows
    assert "The mixture's tokens: english" in capfd.readouterr().err

    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    for source in ("english", "nordic"):  # nordic: its validation rows are held out of its training rows
        assert eval_results[f"eval_{source}_tokens"] > 0
        (step_6, loss_6), (step_12, loss_12) = scalars(output_dir, f"eval/{source}/loss")
        assert (
            (step_6, step_12) == (6, 12)
            and loss_12 < loss_6
            and loss_12 == pytest.approx(eval_results[f"eval_{source}_loss"])
        )
    # The whole evaluation is that of all its tokens: the sources' losses weighted by their token counts.
    english, nordic = eval_results["eval_english_tokens"], eval_results["eval_nordic_tokens"]
    assert eval_results["eval_tokens"] == english + nordic
    weighted = (eval_results["eval_english_loss"] * english + eval_results["eval_nordic_loss"] * nordic) / (
        english + nordic
    )
    assert eval_results["eval_loss"] == pytest.approx(weighted, rel=1e-6)

    # Resumed from step 6, the run draws the batches the uninterrupted one drew and ends with the same weights.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "12")
    (resumed_dir / "model.safetensors").unlink()
    monkeypatch.setattr(sys, "argv", clm_arguments(model_dir, resumed_dir, mixture, "--resume_from_checkpoint"))
    run_clm_flax.main()
    assert "checkpoints/6 at step 6" in capfd.readouterr().err
    resumed, uninterrupted = load_file(resumed_dir / "model.safetensors"), load_file(output_dir / "model.safetensors")
    for name, weights in uninterrupted.items():
        np.testing.assert_array_equal(resumed[name], weights, err_msg=name)


def test_run_mlm_flax_mixes_sources_too(roberta_tokenizer_dir, tmp_path, monkeypatch):
    mixture = write_mixture(tmp_path, **SOURCES)
    model = tmp_path / "model"
    shutil.copytree(roberta_tokenizer_dir, model)
    RobertaConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=34,
    ).save_pretrained(model)  # fmt: skip
    output_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", [
        "run_mlm_flax.py", "--output_dir", str(output_dir), "--config_name", str(model), "--tokenizer_name",
        str(model), "--data_mixture", mixture, "--line_by_line",
        "--max_seq_length", "32", "--per_device_train_batch_size", "8", "--max_steps", "8", "--logging_steps", "4",
        "--fill_mask_top_k", "0",
    ])  # fmt: skip
    run_mlm_flax.main()
    train_results = json.loads((output_dir / "train_results.json").read_text())
    assert train_results["train_rows_english"] + train_results["train_rows_nordic"] == 64  # lines: rows, not tokens
    assert abs(train_results["train_rows_english"] - 48) <= ROWS_OFF_WEIGHT
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    assert (
        eval_results["eval_masked_tokens"]
        == eval_results["eval_english_masked_tokens"] + eval_results["eval_nordic_masked_tokens"]
    )
