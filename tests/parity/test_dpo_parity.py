"""run_dpo_flax.py against TRL 1.16's DPOTrainer on a tiny random Llama: the same tokens for the same pairs (text
and conversations), the same truncation, and --do_eval's loss and metrics equal to DPOTrainer.evaluate()'s."""

import json
import sys

import numpy as np
import pytest
import torch
from datasets import Dataset
from test_dpo import conversational_pairs, run_dpo_flax, text_pairs, tiny_llama_tokenizer_dir, write_jsonl
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from flax_lm.data.preferences import encode_pair, pair_rows

FORMATS = {"text": text_pairs, "conversational": conversational_pairs}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The policy, a tiny random Llama with its tokenizer, and another as the reference model: two models apart, so
    that the rewards and their accuracy are more than rounding noise."""
    policy_dir = tiny_llama_tokenizer_dir(tmp_path_factory.mktemp("policy"))
    reference_dir = str(tmp_path_factory.mktemp("reference"))
    config = AutoConfig.from_pretrained(policy_dir)
    for seed, directory in ((0, policy_dir), (1, reference_dir)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(directory)
    return policy_dir, reference_dir


def trl_trainer(model_dirs, pair_format: str, loss_type: str, output_dir) -> DPOTrainer:
    policy_dir, reference_dir = model_dirs
    dataset = Dataset.from_list(FORMATS[pair_format]())
    arguments = DPOConfig(
        output_dir=str(output_dir), per_device_eval_batch_size=8, loss_type=[loss_type], report_to="none", use_cpu=True
    )
    return DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(reference_dir),
        args=arguments,
        train_dataset=dataset,
        eval_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
    )


@pytest.mark.parametrize("pair_format, loss_type", [("text", "sigmoid"), ("conversational", "ipo")])
def test_do_eval_reports_what_trl_evaluate_reports(model_dirs, pair_format, loss_type, tmp_path, monkeypatch):
    trainer = trl_trainer(model_dirs, pair_format, loss_type, tmp_path / "trl")
    tokenizer = trainer.processing_class
    for pair, tokenized in zip(FORMATS[pair_format](), trainer.eval_dataset):
        expected = (tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])
        assert encode_pair(tokenizer, pair) == expected, pair
    expected = trainer.evaluate()

    pairs = write_jsonl(tmp_path / "pairs.jsonl", FORMATS[pair_format]())
    output_dir = tmp_path / "ours"
    arguments = ["--model_name_or_path", model_dirs[0], "--ref_model_name_or_path", model_dirs[1]]
    arguments += ["--validation_file", pairs, "--do_eval", "--loss_type", loss_type, "--output_dir", output_dir]
    monkeypatch.setattr(sys, "argv", ["run_dpo_flax.py", *map(str, arguments), "--report_to", "none"])
    run_dpo_flax.main()
    ours = json.loads((output_dir / "eval_results.json").read_text())

    assert ours["eval_loss"] == pytest.approx(expected["eval_loss"], abs=2e-3)
    assert ours["eval_rewards/accuracies"] == expected["eval_rewards/accuracies"]
    assert 0 < expected["eval_rewards/accuracies"] < 1  # the models differ: some pairs each way
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert ours[f"eval_{name}"] == pytest.approx(expected[f"eval_{name}"], abs=2e-3), name


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_sequences_are_cut_as_trls_collator_cuts_them(model_dirs, truncation_mode):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[0])
    encoded = [encode_pair(tokenizer, pair) for pair in text_pairs()]
    max_length = max(len(prompt) for prompt, _, _ in encoded) + 2  # longer than every prompt
    assert any(len(prompt + rejected) > max_length for prompt, _, rejected in encoded)  # some are cut
    rows, dropped = pair_rows(encoded, max_length, truncation_mode, tokenizer.eos_token_id)
    collator = DataCollatorForPreference(tokenizer.eos_token_id, max_length, truncation_mode)
    examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in encoded]
    batch = collator(examples)
    pairs = len(encoded)
    assert dropped == 0
    for side in (0, 1):  # TRL's batch: every chosen sequence, then every rejected one
        np.testing.assert_array_equal(rows[:, side, 0], batch["input_ids"][side * pairs : (side + 1) * pairs].numpy())
        np.testing.assert_array_equal(
            rows[:, side, 1], batch["completion_mask"][side * pairs : (side + 1) * pairs].numpy()
        )
