"""A run of run_clm_flax.py with LoRA adapters on a tiny Llama, as a user runs it: the base weights stay bit for bit
what they were and have no optimizer state, the output directory is a PEFT adapter that
`peft.PeftModel.from_pretrained(base, directory)` loads and that scores the evaluation rows in PyTorch as the run
reported, the merged model (--merge_adapters) loads in transformers and scores the same, and a resumed run trains the
adapters the uninterrupted one did."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from conftest import FIXTURES_DIR
from flax.traverse_util import flatten_dict
from peft import PeftModel
from safetensors.numpy import load_file
from test_clm import model_dir_with_config, run_script
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flax_lm.models.llama.model import to_hf_state_dict
from flax_lm.training.lora import without_adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pytorch_loss(model, tokenizer, blocks: int, block_size: int) -> float:
    """The mean next-token loss of `model` on the first `blocks` evaluation blocks, packed as the script packs them."""
    text = (FIXTURES_DIR / "en" / "validation.txt").read_text()
    ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    rows = torch.tensor(ids[: blocks * block_size]).reshape(blocks, block_size)
    with torch.no_grad():
        logits = model(rows).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).item()


def test_a_lora_run_trains_adapters_that_peft_loads_on_the_untouched_base(llama_tokenizer_dir, tmp_path):
    base_dir = model_dir_with_config(llama_tokenizer_dir, tmp_path / "base", "llama", tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir)).save_pretrained(base_dir)
    arguments = [
        "--model_name_or_path", base_dir, "--train_file", FIXTURES_DIR / "en" / "train.txt",
        "--validation_file", FIXTURES_DIR / "en" / "validation.txt", "--max_eval_samples", "4", "--do_train",
        "--do_eval", "--block_size", "32", "--per_device_train_batch_size", "2", "--max_steps", "4", "--save_steps",
        "2", "--learning_rate", "1e-2", "--sample_tokens", "0", "--lora_rank", "4", "--lora_dropout", "0.1",
        "--lora_target_modules", *TARGETS, "--merge_adapters", "--cache_dir", tmp_path / "cache",
    ]  # fmt: skip
    output_dir = tmp_path / "out"
    run_script([*map(str, arguments), "--output_dir", str(output_dir)])

    # Frozen: the base weights of the last checkpoint are the base model's, bit for bit; the optimizer's moments
    # are the adapters' alone.
    state = ocp.StandardCheckpointer().restore(output_dir / "checkpoints" / "4" / "state")
    trained = {name: np.asarray(value) for name, value in to_hf_state_dict(without_adapters(state["params"])).items()}
    base_weights = load_file(f"{base_dir}/model.safetensors")
    assert trained.keys() == base_weights.keys()
    assert all(np.array_equal(trained[name], base_weights[name]) for name in base_weights)
    adapter_sizes = sum(value.size for path, value in flatten_dict(state["params"]).items() if "lora_" in path[-1])
    moments = sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(state["opt_state"]) if np.ndim(leaf))
    # Two layers of rank 4 times in + out of q, k, v (one key/value head of 16), o, gate, up, down (inner 64).
    assert adapter_sizes == 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 3 * (32 + 64))
    assert moments == 2 * adapter_sizes  # AdamW's two moments, of the adapters only

    config = json.loads((output_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 4, sorted(TARGETS))
    results = json.loads((output_dir / "eval_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), output_dir).eval()
    assert results["eval_loss"] == pytest.approx(pytorch_loss(adapted, tokenizer, 4, 32), rel=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged").eval()
    assert results["eval_loss"] == pytest.approx(pytorch_loss(merged, tokenizer, 4, 32), rel=1e-5)

    # Resumed from the checkpoint of step 2 (without the evaluation and the merge, which train nothing), the run
    # trains the adapters the uninterrupted one did.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir / "checkpoints" / "2", resumed_dir / "checkpoints" / "2")
    resumed_arguments = [argument for argument in arguments if argument not in ("--do_eval", "--merge_adapters")]
    run_script([*map(str, resumed_arguments), "--output_dir", str(resumed_dir), "--resume_from_checkpoint"])
    uninterrupted, resumed = (load_file(f"{path}/adapter_model.safetensors") for path in (output_dir, resumed_dir))
    assert uninterrupted.keys() == resumed.keys()
    assert all(np.array_equal(uninterrupted[name], resumed[name]) for name in uninterrupted)
