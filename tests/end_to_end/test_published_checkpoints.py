"""Checkpoints as the families publish them (bfloat16, in shards, beside a tokenizer): each loads by its config alone,
is evaluated and decoded as PyTorch does, trains on in run_clm_flax.py (in this process), and exports what
transformers loads and scores as the script reported. The families are those of tests/parity/test_models.py."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import REPO_DIR
from test_clm import tiny_llama_config
from test_models import CORPUS, FAMILY_CONFIGS, hf_class_of, random_torch_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
)

from flax_lm.data.texts import ids_around_documents
from flax_lm.generation.sampling import generate_ids, make_sampler
from flax_lm.models.huggingface import ModelLoading


@pytest.fixture(scope="module")
def sharded_llama_dir(llama_tokenizer_dir, tmp_path_factory):
    """A Llama saved by transformers as Llama checkpoints are published: in bfloat16, in several safetensors shards
    with their index, beside its tokenizer."""
    directory = tmp_path_factory.mktemp("sharded-llama")
    config = tiny_llama_config(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size="100KB")
    for name in os.listdir(llama_tokenizer_dir):
        shutil.copy(os.path.join(llama_tokenizer_dir, name), directory)
    return directory


@pytest.fixture(scope="module")
def run_clm_in_process():
    sys.path.insert(0, str(REPO_DIR))
    import run_clm_flax

    def run(monkeypatch, *arguments):
        monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *map(str, arguments)])
        run_clm_flax.main()

    return run


def pytorch_block_loss(model_dir, text: str, block_size: int) -> float:
    """The mean next-token loss of PyTorch's model over the blocks run_clm_flax.py makes of one document: its tokens
    framed as the tokenizer frames a text (BOS first) and followed by EOS, cut into blocks of block_size."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before, after = ids_around_documents(tokenizer)
    assert before == [tokenizer.bos_token_id] and after == [tokenizer.eos_token_id]
    tokens = before + tokenizer(text, add_special_tokens=False)["input_ids"] + after
    blocks = torch.tensor(tokens[: len(tokens) // block_size * block_size]).reshape(-1, block_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(blocks).logits[:, :-1]
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)))


def test_a_sharded_bfloat16_llama_checkpoint_is_evaluated_as_pytorch_does_and_trains_on(
    sharded_llama_dir, run_clm_in_process, tmp_path, monkeypatch
):
    assert len([name for name in os.listdir(sharded_llama_dir) if name.startswith("model-000")]) > 1
    validation = CORPUS / "validation.txt"
    common = ["--model_name_or_path", str(sharded_llama_dir), "--validation_file", str(validation), "--block_size",
              "32", "--per_device_eval_batch_size", "4", "--sample_tokens", "0"]  # fmt: skip

    def run(*arguments):
        run_clm_in_process(monkeypatch, *common, *arguments)

    run("--output_dir", str(tmp_path / "evaluated"), "--do_eval")
    evaluated = json.loads((tmp_path / "evaluated" / "eval_results.json").read_text())
    expected = pytorch_block_loss(str(sharded_llama_dir), validation.read_text(), 32)
    assert abs(evaluated["eval_loss"] - expected) < 1e-3, (evaluated["eval_loss"], expected)

    run("--output_dir", str(tmp_path / "trained"), "--do_train", "--train_file", str(CORPUS / "train.txt"),
        "--max_steps", "3", "--learning_rate", "1e-3", "--per_device_train_batch_size", "4")  # fmt: skip
    trained = json.loads((tmp_path / "trained" / "train_results.json").read_text())
    assert np.isfinite(trained["train_loss"])
    torch_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
    assert type(torch_model).__name__ == "LlamaForCausalLM"


# This test takes a minute and a half of a CPU per family, so it leaves out the families whose checkpoints are read
# and written by the same code as another's here: SmolLM3's as Llama's (shared/common.py's mapping); GPT-J's and OPT's
# as GPT-NeoX's (the sharded bfloat16 files read by huggingface.py, then the module's own mapping, which their logits
# tests check tensor by tensor against the PyTorch state dict). GPT-NeoX stays for its output layer saved as embed_out.
ONE_FAMILY_OF_EACH_READING = [
    model_type for model_type in FAMILY_CONFIGS if model_type not in ("smollm3", "gptj", "opt")
]


@pytest.mark.parametrize("model_type", ONE_FAMILY_OF_EACH_READING)
def test_a_sharded_bfloat16_checkpoint_of_each_family_decodes_trains_and_exports_as_transformers_computes(
    model_type, llama_tokenizer_dir, run_clm_in_process, tmp_path, monkeypatch
):
    """A checkpoint as the family's are published (bfloat16, sharded, beside a tokenizer) loads by its config alone:
    generate_flax.py decodes it greedily as PyTorch's generate does; run_clm_flax.py trains on it and exports the
    family's architecture, which transformers loads with no tensor missing or unexpected and scores as the script
    reported."""
    import generate_flax

    tokenizer = AutoTokenizer.from_pretrained(llama_tokenizer_dir)
    config = FAMILY_CONFIGS[model_type](
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, max_position_embeddings=64,
    )  # fmt: skip
    checkpoint = tmp_path / "checkpoint"
    random_torch_model(hf_class_of(config), config).to(torch.bfloat16).save_pretrained(
        checkpoint, max_shard_size="100KB"
    )
    tokenizer.save_pretrained(checkpoint)
    assert len([name for name in os.listdir(checkpoint) if name.startswith("model-000")]) > 1

    model, params, _ = generate_flax.load_model(ModelLoading(str(checkpoint)))
    prompt = tokenizer("The history of", add_special_tokens=True)["input_ids"]
    [decoded] = generate_ids(make_sampler(model, config.eos_token_id), params, [prompt], max_new_tokens=10)
    torch_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=config.eos_token_id,
            pad_token_id=config.eos_token_id,
        )  # fmt: skip
    assert decoded == expected[0, len(prompt) :].tolist()

    output_dir = tmp_path / "trained"
    run_clm_in_process(
        monkeypatch, "--model_name_or_path", checkpoint, "--output_dir", output_dir, "--do_train", "--do_eval",
        "--train_file", CORPUS / "train.txt", "--validation_file", CORPUS / "validation.txt", "--block_size", 32,
        "--max_steps", 2, "--learning_rate", 1e-3, "--per_device_train_batch_size", 4,
        "--per_device_eval_batch_size", 4, "--sample_tokens", 0,
    )  # fmt: skip
    reported = json.loads((output_dir / "eval_results.json").read_text())["eval_loss"]
    exported, loading_info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert type(exported) is hf_class_of(config)
    assert not any(loading_info.values()), loading_info
    scored = pytorch_block_loss(str(output_dir), (CORPUS / "validation.txt").read_text(), 32)
    assert abs(reported - scored) < 1e-3, (reported, scored)
