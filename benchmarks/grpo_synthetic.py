#!/usr/bin/env python3
"""Does GRPO raise the reward? A tiny model learns to add two digits.

The script writes a tokenizer of one token a character ("0"-"9", "+", "=", " ", end of text) and a tiny random
Llama, fine-tunes it briefly with run_clm_flax.py on prompt/completion pairs ("3+4=" -> "7"), so that some of its
sampled answers are right, then trains it with run_grpo_flax.py on the 100 prompts "a+b=" with the `addition`
reward (1 for the right sum), and prints the mean reward of each logged step: the curve should rise.

    python benchmarks/grpo_synthetic.py [--sft_steps 150] [--grpo_steps 400] [--output_dir /tmp/grpo-synthetic]
"""

import argparse
import json
import os
import random
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tiny_model(directory: str):
    """The character tokenizer and a tiny random Llama, as transformers writes them (needs PyTorch)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{character: i + 1 for i, character in enumerate("0123456789+= ")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=64
    ).save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=0, bos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_data(directory: str, pairs: int) -> tuple[str, str]:
    rng = random.Random(0)
    sft, prompts = os.path.join(directory, "sft.jsonl"), os.path.join(directory, "prompts.jsonl")
    with open(sft, "w") as file:
        for _ in range(pairs):
            a, b = rng.randrange(10), rng.randrange(10)
            file.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    with open(prompts, "w") as file:
        file.writelines(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(10) for b in range(10))
    return sft, prompts


def run(script: str, *arguments):
    result = subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, arguments)], text=True)
    if result.returncode:
        sys.exit(f"{script} failed with exit status {result.returncode}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="/tmp/grpo-synthetic")
    parser.add_argument("--sft_pairs", type=int, default=400)
    parser.add_argument("--sft_steps", type=int, default=150)
    parser.add_argument("--grpo_steps", type=int, default=400)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--loss_type", default="grpo")
    parser.add_argument("--beta", type=float, default=0.0)
    args = parser.parse_args()
    tiny, sft_dir, grpo_dir = (os.path.join(args.output_dir, name) for name in ("tiny", "sft", "grpo"))
    os.makedirs(tiny, exist_ok=True)
    write_tiny_model(tiny)
    sft_file, prompts_file = write_data(args.output_dir, args.sft_pairs)
    run(
        "run_clm_flax.py", "--model_name_or_path", tiny, "--train_file", sft_file, "--output_dir", sft_dir,
        "--overwrite_output_dir", "--do_train", "--max_steps", args.sft_steps, "--per_device_train_batch_size", 32,
        "--learning_rate", 3e-3, "--warmup_steps", 10, "--block_size", 16, "--logging_steps", 50,
        "--sample_tokens", 0,
    )  # fmt: skip
    run(
        "run_grpo_flax.py", "--model_name_or_path", sft_dir, "--train_file", prompts_file, "--output_dir", grpo_dir,
        "--reward_funcs", "addition", "--num_generations", 8, "--per_device_train_batch_size", 64,
        "--max_completion_length", 4, "--learning_rate", args.learning_rate, "--loss_type", args.loss_type,
        "--beta", args.beta, "--max_steps", args.grpo_steps, "--logging_steps", 25, "--lr_scheduler_type", "constant",
        "--overwrite_output_dir",
    )  # fmt: skip
    with open(os.path.join(grpo_dir, "grpo_log.jsonl")) as file:
        logged = [json.loads(line) for line in file]
    print("step  reward  reward_std  completions/mean_length")
    for row in logged:
        length = row["completions/mean_length"]
        print(f"{row['step']:4d}  {row['reward']:.3f}   {row['reward_std']:.3f}       {length:.2f}")
    print(f"steps per second: {logged[-1]['steps_per_second']:.3f}")


if __name__ == "__main__":
    main()
