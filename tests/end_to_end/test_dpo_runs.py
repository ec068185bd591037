"""run_dpo_flax.py as a user runs it: DPO on an easy preference set raises the reward accuracy and margin, the
exported model, loaded by transformers, gives the log-probabilities the final evaluation reported, and the run resumed
from its first checkpoint ends with the same results."""

import json
import re
import shutil

import numpy as np
import torch
from test_dpo import tiny_llama_tokenizer_dir, write_jsonl
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from flax_lm.data.preferences import encode_pair

WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "house", "music", "paper", "light", "north", "glass"]


def easy_pairs(count: int) -> list[dict]:
    """Pairs that prefer one answer to every prompt: ' good' over ' bad'."""
    prompts = [f"{first} {second}:" for first in WORDS for second in WORDS if first != second][:count]
    return [{"prompt": prompt, "chosen": " good", "rejected": " bad"} for prompt in prompts]


def test_dpo_learns_an_easy_preference_and_exports_what_it_evaluated(run_tool, tmp_path):
    model_dir = tiny_llama_tokenizer_dir(tmp_path / "model")
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.from_pretrained(model_dir)).save_pretrained(model_dir)
    train, validation = easy_pairs(40), easy_pairs(48)[40:]
    output_dir = tmp_path / "run"
    flags = [
        "--model_name_or_path", model_dir,
        "--train_file", write_jsonl(tmp_path / "train.jsonl", train),
        "--validation_file", write_jsonl(tmp_path / "validation.jsonl", validation),
        "--do_train", "--do_eval", "--eval_on_start",
        "--learning_rate", "1e-3", "--max_steps", "10", "--per_device_train_batch_size", "8",
        "--logging_steps", "5", "--save_steps", "5", "--report_to", "none",
    ]  # fmt: skip
    result = run_tool("run_dpo_flax.py", *flags, "--output_dir", output_dir)
    assert result.returncode == 0, result.stderr[-3000:]

    evaluations = re.findall(
        r"step (\d+): eval loss ([\d.]+), .*rewards/accuracies ([\d.]+), rewards/margins ([-\d.]+)", result.stderr
    )
    steps, losses, accuracies, margins = (list(map(float, column)) for column in zip(*evaluations))
    assert steps == [0, 5, 10]
    assert accuracies[0] == 0.0 and accuracies[-1] == 1.0  # the reference is the starting model: no margin at 0
    assert margins[0] == 0.0 < margins[1] < margins[2]
    assert losses[0] > losses[1] > losses[2]

    results = json.loads((output_dir / "eval_results.json").read_text())
    assert results["step"] == 10 and results["eval_rewards/accuracies"] == 1.0
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    exported = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    chosen_logps = []
    for pair in validation:
        prompt, chosen, _ = encode_pair(tokenizer, pair)
        ids = torch.tensor([prompt + chosen])
        with torch.no_grad():
            log_probs = torch.log_softmax(exported(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        chosen_logps.append(log_probs[torch.arange(len(targets)), targets][len(prompt) - 1 :].sum().item())
    np.testing.assert_allclose(np.mean(chosen_logps), results["eval_logps/chosen"], atol=1e-3)

    # Interrupted after the save of step 5 (its results not yet written), and resumed by the same command: the same
    # batches and steps, so the same training metrics over the whole run and the same final evaluation.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "10")
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        (resumed_dir / name).unlink()
    result = run_tool("run_dpo_flax.py", *flags, "--output_dir", resumed_dir, "--resume_from_checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from" in result.stderr
    assert json.loads((resumed_dir / "eval_results.json").read_text()) == results
    train_results, resumed_train_results = (
        json.loads((directory / "train_results.json").read_text()) for directory in (output_dir, resumed_dir)
    )
    for name in ("train_loss", "train_rewards/accuracies", "train_rewards/margins", "train_logps/chosen"):
        assert resumed_train_results[name] == train_results[name], name
