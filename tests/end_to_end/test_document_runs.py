"""A short run on .txt files with the documented recipe tokenizer, and its export scored in PyTorch: the eval loss,
the bits per byte, the sample."""

import json
import math

import numpy as np
import pytest
import torch
from test_clm import scalars
from test_documents import BLOCK_SIZE, CORPUS, recipe_model_dir
from transformers import AutoTokenizer, GPT2LMHeadModel


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    return recipe_model_dir(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def trained_dir(run_tool, recipe_dir, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_tool(
        "run_clm_flax.py", "--output_dir", output_dir, "--config_name", recipe_dir, "--tokenizer_name", recipe_dir,
        "--train_file", CORPUS / "train.txt", "--validation_file", CORPUS / "validation.txt",
        "--do_train", "--do_eval", "--block_size", BLOCK_SIZE, "--per_device_train_batch_size", 16,
        "--per_device_eval_batch_size", 16, "--max_steps", 40, "--learning_rate", 3e-3, "--logging_steps", 20,
        "--sample_tokens", 20,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Documents end with </s>, id 2 (the config's eos_token_id)" in result.stderr
    return output_dir, result


def validation_blocks(tokenizer):
    """The raw validation text, tokenized as written, ended by EOS and cut into blocks."""
    ids = tokenizer((CORPUS / "validation.txt").read_text())["input_ids"] + [tokenizer.eos_token_id]
    return np.array(ids[: len(ids) // BLOCK_SIZE * BLOCK_SIZE]).reshape(-1, BLOCK_SIZE)


def test_exported_model_scored_in_pytorch_on_the_raw_validation_text_gives_the_eval_loss(trained_dir):
    output_dir, _ = trained_dir
    results = json.loads((output_dir / "eval_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    assert tokenizer.eos_token == "</s>", "the export names the model's end-of-text token"
    model = GPT2LMHeadModel.from_pretrained(str(output_dir)).eval()
    blocks = torch.tensor(validation_blocks(tokenizer))
    with torch.no_grad():
        loss = model(blocks, labels=blocks).loss.item()  # every block predicts BLOCK_SIZE - 1 tokens
    assert results["eval_tokens"] == blocks.numel() - len(blocks)
    assert results["eval_loss"] < math.log(1000) - 1.0, "the run should have learned something"
    assert abs(loss - results["eval_loss"]) < 0.02, (loss, results["eval_loss"])


def test_bits_per_byte_counts_the_bytes_of_the_predicted_text_once(trained_dir):
    output_dir, result = trained_dir
    results = json.loads((output_dir / "eval_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    # Decoded rather than looked up: the text each block's predicted tokens stand for, EOS standing for none.
    predicted_bytes = sum(
        len(tokenizer.decode(block[1:], skip_special_tokens=True).encode("utf-8"))
        for block in validation_blocks(tokenizer)
    )
    assert results["eval_bytes"] == predicted_bytes
    expected = results["eval_loss"] * results["eval_tokens"] / math.log(2) / predicted_bytes
    assert results["eval_bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert f"{results['eval_bits_per_byte']:.4f} bits per byte" in result.stdout
    assert scalars(output_dir, "eval/bits_per_byte")[-1][1] == pytest.approx(results["eval_bits_per_byte"], rel=1e-5)


def test_the_sample_is_text_without_special_tokens(trained_dir):
    _, result = trained_dir
    sample = next(line for line in result.stdout.splitlines() if line.startswith("sample from"))
    assert not any(token in sample for token in ("</s>", "<s>", "<|endoftext|>", "<pad>")), sample
    assert len(sample.split(": ", 1)[1]) > len("''"), "the sample should hold some text"
