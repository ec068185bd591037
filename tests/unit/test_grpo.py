"""run_grpo_flax.py in-process: the advantages by hand, the rewards of the synthetic task, and the one-line refusals
of bad input (before any model is loaded)."""

import json
import sys

import numpy as np
import pytest
from conftest import REPO_DIR

from flax_lm.errors import UsageError

sys.path.insert(0, str(REPO_DIR))
import run_grpo_flax  # noqa: E402


def test_advantages_are_normalised_within_each_group_as_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], np.float32)
    # Group 1: mean 0.25, Bessel-corrected std 0.5 (0.75 squared plus three 0.25 squared, over 3); group 2: every
    # reward equal, std 0 and advantage 0.
    expected = np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / np.array([0.5 + 1e-4] * 4 + [1e-4] * 4)
    np.testing.assert_allclose(run_grpo_flax.group_advantages(rewards, 4, "group"), expected, rtol=1e-6)
    np.testing.assert_allclose(
        run_grpo_flax.group_advantages(rewards, 4, "none"), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], rtol=1e-6
    )
    batch_std = rewards.std(ddof=1)
    np.testing.assert_allclose(
        run_grpo_flax.group_advantages(rewards, 4, "batch"),
        np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (batch_std + 1e-4),
        rtol=1e-6,
    )


def test_the_addition_reward_checks_the_sum_the_prompt_asks_for():
    assert run_grpo_flax.addition("3+4=", "7") == 1.0
    assert run_grpo_flax.addition("3+4=", " 7 and more") == 1.0
    assert run_grpo_flax.addition("3+4=", "8") == 0.0
    assert run_grpo_flax.addition("3+4=", "") == 0.0
    assert run_grpo_flax.addition("no question", "7") == 0.0


def test_a_conversation_prompt_is_rendered_by_the_chat_template_and_rewarded_on_its_last_message():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{character: i + 1 for i, character in enumerate("0123456789+=>: ")}}
    tokenizer_model = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer_model.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer_model, eos_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    )
    conversation = [{"role": "user", "content": "1+2="}]
    args = run_grpo_flax.TrainingArguments(output_dir="out", max_completion_length=4)
    ids = run_grpo_flax.tokenized_prompts(
        ["1+2=", conversation], tokenizer, LlamaConfig(max_position_embeddings=64), args
    )
    assert (
        tokenizer.decode(ids[0]).replace(" ", "") == "1+2=" and tokenizer.decode(ids[1]).replace(" ", "") == "1+2=>:"
    )
    assert run_grpo_flax.addition(run_grpo_flax.prompt_text(conversation), "3") == 1.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_generations", "1"], "--num_generations 1 must be at least 2"),
        (
            ["--per_device_train_batch_size", "10", "--num_generations", "4"],
            "not a multiple of --num_generations",
        ),
        (["--reward_funcs", "nonsense"], "--reward_funcs nonsense is not in REWARD_FUNCTIONS"),
        (["--temperature", "0"], "--temperature must be positive"),
        (["--gradient_accumulation_steps", "2"], "leave --gradient_accumulation_steps and --steps_per_call"),
        (["--do_eval"], "run_grpo_flax.py has no evaluation"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch, flags, message):
    train_file = tmp_path / "prompts.jsonl"
    train_file.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    output_dir = tmp_path / "out"
    arguments = ["--model_name_or_path", str(tmp_path / "no-model"), "--train_file", str(train_file)]
    monkeypatch.setattr(sys, "argv", ["run_grpo_flax.py", *arguments, "--output_dir", str(output_dir), *flags])
    with pytest.raises(UsageError, match=message) as refusal:
        run_grpo_flax.main()
    assert "\n" not in str(refusal.value)
    assert not output_dir.exists()


def test_a_prompt_file_line_without_a_prompt_is_refused_in_one_line(tmp_path):
    train_file = tmp_path / "prompts.jsonl"
    train_file.write_text(json.dumps({"prompt": "1+2="}) + "\n" + json.dumps({"question": "3+4="}) + "\n")
    with pytest.raises(UsageError, match='line 2 has no "prompt" field') as refusal:
        run_grpo_flax.read_prompts([str(train_file)])
    assert "\n" not in str(refusal.value)
