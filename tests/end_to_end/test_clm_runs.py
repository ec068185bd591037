"""run_clm_flax.py run as a user runs it: it trains, evaluates and exports a model transformers loads, it continues a
PyTorch checkpoint, and it trains on a stream. (Eight devices train as one: test_tensor_parallel.py.)"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_clm import (
    CORPUS,
    abstract_params,
    flax_logits,
    model_dir_with_config,
    run_script,
    scalars,
    tiny_config,
    tiny_gpt2_dir_of_512_tokens,
    training_arguments,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

from flax_lm.models.gpt2 import model as gpt2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_gpt2_dir_of_512_tokens(tmp_path_factory.mktemp("tiny-gpt2"))


def test_cli_run_trains_evaluates_and_writes_a_loadable_model(model_dir, tmp_path):
    output_dir = tmp_path / "trained"
    result = run_script(
        training_arguments(
            model_dir,
            output_dir,
            "--do_train",
            "--do_eval",
            "--per_device_train_batch_size",
            "16",
            "--per_device_eval_batch_size",
            "16",
            "--learning_rate",
            "3e-3",
            "--warmup_steps",
            "5",
            "--max_steps",
            "60",
            "--logging_steps",
            "20",
            "--eval_steps",
            "30",
            "--save_steps",
            "30",
            "--weight_decay",
            "0.01",
            "--adam_beta2",
            "0.98",
            "--sample_tokens",
            "8",
        )
    )
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "eval_results.json",
        "train_results.json",
    ):
        assert (output_dir / name).is_file(), f"{name} was not written"
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    train_results = json.loads((output_dir / "train_results.json").read_text())
    # An untrained model's loss is about log(512) (test_continues_training_from_a_pytorch_checkpoint).
    assert eval_results["eval_loss"] < np.log(512) - 1.0
    assert eval_results["eval_perplexity"] == pytest.approx(np.exp(eval_results["eval_loss"]), rel=1e-6)
    assert train_results["train_steps"] == 60 and train_results["train_tokens_per_second"] > 0
    assert "eval perplexity:" in result.stdout and "tensorboard --logdir" in result.stdout
    assert "sample from" in result.stdout

    for tag in (
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_second",
        "eval/loss",
        "eval/perplexity",
    ):
        assert scalars(output_dir, tag), f"no {tag} in TensorBoard"
    assert [step for step, _ in scalars(output_dir, "eval/loss")] == [30, 60]
    assert scalars(output_dir, "eval/loss")[-1][1] == pytest.approx(eval_results["eval_loss"], rel=1e-5)

    # The export is an ordinary transformers model directory with the trained weights.
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    torch_model = AutoModelForCausalLM.from_pretrained(str(output_dir)).eval()
    input_ids = tokenizer("The gardener counted to ten", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = torch_model(input_ids).logits.numpy()
    config = GPT2Config.from_pretrained(str(output_dir))
    params = gpt2.from_hf_state_dict(load_file(str(output_dir / "model.safetensors")), abstract_params(config))
    np.testing.assert_allclose(flax_logits(config, params, input_ids.numpy()), expected, atol=1e-4, rtol=0)


def test_continues_training_from_a_pytorch_checkpoint(model_dir, tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    GPT2LMHeadModel(tiny_config()).save_pretrained(str(checkpoint))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(checkpoint))
    result = run_script(
        [
            "--output_dir",
            str(tmp_path / "out"),
            "--model_name_or_path",
            str(checkpoint),
            "--do_eval",
            "--validation_file",
            os.path.join(CORPUS, "validation.txt"),
            "--block_size",
            "32",
        ]
    )
    assert f"Loaded weights from {checkpoint}" in result.stderr
    loss = json.loads((tmp_path / "out" / "eval_results.json").read_text())["eval_loss"]
    assert loss == pytest.approx(np.log(512), abs=0.3)  # an untrained model is close to uniform


@pytest.fixture(scope="module")
def vocabulary_of_1000_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer (its ids fit in uint16) with a tiny GPT-2."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("data-model"))


def test_streaming_run_trains_with_max_steps_and_lowers_the_loss(run_tool, vocabulary_of_1000_dir, tmp_path):
    model_dir = vocabulary_of_1000_dir
    output_dir = tmp_path / "streamed"
    result = run_tool(
        "run_clm_flax.py",
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", Path(CORPUS, "train.txt"), "--validation_file", Path(CORPUS, "validation.txt"), "--streaming",
        "--do_train", "--do_eval", "--max_steps", 40, "--block_size", 32, "--per_device_train_batch_size", 8,
        "--learning_rate", 3e-3, "--logging_steps", 10, "--eval_steps", 20, "--max_eval_samples", 64,
        "--shuffle_buffer_size", 100, "--sample_tokens", 0,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on blocks packed from a stream" in result.stderr
    losses = [loss for _, loss in scalars(output_dir, "train/loss")]
    evaluations = scalars(output_dir, "eval/loss")
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    assert [step for step, _ in evaluations] == [20, 40] and evaluations[-1][1] < np.log(1000) - 0.5
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["eval_tokens"] == 64 * 31  # --max_eval_samples blocks, 31 predicted tokens each
    assert json.loads((output_dir / "train_results.json").read_text())["train_steps"] == 40
