#!/usr/bin/env python3
"""Does fine-tuning teach a task, and what does the loss mask change? A tiny model learns to sort digits.

Each example asks to sort a few random digits ("sort: 7 3 9 1 4") and answers with them sorted ("1 3 4 7 9"), as a
conversation (the default) or a prompt/completion pair (--format prompt_completion). The script trains a tokenizer
with a chat template on the task's text (train_tokenizer.py --chat_template), writes a tiny config (create_config.py),
and fine-tunes it twice with run_clm_flax.py from the same initial weights, data order and steps: with the loss on
the answers only (the default: --assistant_only_loss, --completion_only_loss) and on every token. Each model then
answers --test_prompts prompts that no training example holds, greedily, and the answer must equal the sorted digits
exactly. The answers are decoded twice, by generate_flax.py's Generator and by transformers' generate on the export
(the chat template applied by apply_chat_template), and both accuracies are printed.

    python benchmarks/finetune_synthetic.py [--model_type gpt2] [--format conversations] [--steps 300] [--packing]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

try:  # a test requirement (pip install -r requirements-test.txt): without it the benchmark only answers --help
    import torch
except ModuleNotFoundError as missing:
    missing_requirement = missing.name
else:
    missing_requirement = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import generate_flax  # noqa: E402
from flax_lm.generation.sampling import Sampling  # noqa: E402
from flax_lm.models.huggingface import ModelLoading  # noqa: E402


def task(rng: random.Random, digits: int) -> tuple[str, str]:
    numbers = [rng.randrange(10) for _ in range(digits)]
    return f"sort: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))


def write_data(work_dir: str, arguments) -> tuple[str, str, list[tuple[str, str]]]:
    """The training and validation files, and the held-out test pairs (prompts that no training example holds)."""
    rng = random.Random(0)
    test = {}
    while len(test) < arguments.test_prompts:
        prompt, answer = task(rng, arguments.digits)
        test[prompt] = answer
    pairs = []
    while len(pairs) < arguments.train_examples + 500:
        prompt, answer = task(rng, arguments.digits)
        if prompt not in test:
            pairs.append((prompt, answer))

    def row(prompt, answer):
        if arguments.format == "conversations":
            return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
        return {"prompt": prompt + "\n", "completion": answer}

    paths = []
    for name, part in (("train", pairs[500:]), ("validation", pairs[:500])):
        paths.append(os.path.join(work_dir, f"{name}.jsonl"))
        with open(paths[-1], "w") as file:
            file.writelines(json.dumps(row(prompt, answer)) + "\n" for prompt, answer in part)
    with open(os.path.join(work_dir, "tokenizer-text.txt"), "w") as file:  # with the roles the template writes
        file.writelines(f"user\n{prompt}\nassistant\n{answer}\n" for prompt, answer in pairs[:5000])
    return paths[0], paths[1], list(test.items())


def run(*command):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, command[:1]))} failed:\n{result.stderr[-3000:]}")
    return result


def accuracy_of_generator(model_dir: str, test, chat: bool) -> float:
    model, params, tokenizer = generate_flax.load_model(ModelLoading(model_dir))
    generator = generate_flax.Generator(model, params, tokenizer, batch_size=64)
    if chat:
        results = generator.reply([[{"role": "user", "content": prompt}] for prompt, _ in test], Sampling(16))
    else:
        results = generator.generate([prompt + "\n" for prompt, _ in test], Sampling(16))
    return sum(result["text"].strip() == answer for result, (_, answer) in zip(results, test)) / len(test)


def accuracy_of_transformers(model_dir: str, test, chat: bool) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    correct = 0
    for start in range(0, len(test), 64):
        batch = test[start : start + 64]
        if chat:
            conversations = [[{"role": "user", "content": prompt}] for prompt, _ in batch]
            inputs = tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = tokenizer([prompt + "\n" for prompt, _ in batch], padding=True, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        new = output[:, inputs["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        correct += sum(text.strip() == answer for text, (_, answer) in zip(texts, batch))
    return correct / len(test)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", default="finetune-synthetic")
    parser.add_argument("--model_type", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--format", choices=["conversations", "prompt_completion"], default="conversations")
    parser.add_argument("--digits", type=int, default=5)
    parser.add_argument("--train_examples", type=int, default=20000)
    parser.add_argument("--test_prompts", type=int, default=500)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--block_size", type=int, default=64, help="also the model's positions")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--losses", nargs="+", choices=["answers", "every_token"], default=["answers", "every_token"])
    arguments = parser.parse_args()
    if missing_requirement:
        parser.error(
            f"{missing_requirement} is not installed: this benchmark needs the test requirements "
            "(pip install -r requirements-test.txt)"
        )
    os.makedirs(arguments.work_dir, exist_ok=True)
    train_file, validation_file, test = write_data(arguments.work_dir, arguments)
    model_dir = os.path.join(arguments.work_dir, f"{arguments.model_type}-model")
    run(
        os.path.join(REPO, "train_tokenizer.py"),
        "--train_file", os.path.join(arguments.work_dir, "tokenizer-text.txt"),
        "--model_type", arguments.model_type, "--vocab_size", 320, "--model_max_length", arguments.block_size,
        "--chat_template", "--output_dir", model_dir, "--overwrite",
    )  # fmt: skip
    if arguments.model_type == "gpt2":
        settings = [f"n_positions={arguments.block_size}", "resid_pdrop=0.0", "embd_pdrop=0.0", "attn_pdrop=0.0"]
    else:
        settings = [f"max_position_embeddings={arguments.block_size}"]
    preset = f"{arguments.model_type}-tiny"
    run(
        os.path.join(REPO, "create_config.py"),
        "--preset",
        preset,
        "--tokenizer_dir",
        model_dir,
        "--overwrite",
        "--set",
        *settings,
    )
    chat = arguments.format == "conversations"
    mask_flag = "--assistant_only_loss" if chat else "--completion_only_loss"
    rows = "packed" if arguments.packing else "one example per row"
    print(
        f"{arguments.model_type}-tiny, {arguments.format}, {arguments.steps} steps of {arguments.batch_size} rows of "
        f"{arguments.block_size} tokens, {rows}"
    )
    print("| loss on | eval loss (answers) | accuracy, generate_flax.py | accuracy, transformers | train time |")
    print("| --- | --- | --- | --- | --- |")
    for masked in [loss == "answers" for loss in arguments.losses]:
        output_dir = os.path.join(arguments.work_dir, f"trained-{'masked' if masked else 'unmasked'}")
        start = time.perf_counter()
        run(
            os.path.join(REPO, "run_clm_flax.py"), "--output_dir", output_dir, "--overwrite_output_dir",
            "--config_name", model_dir, "--tokenizer_name", model_dir, "--train_file", train_file,
            "--validation_file", validation_file, "--do_train", "--block_size", arguments.block_size,
            "--per_device_train_batch_size", arguments.batch_size, "--per_device_eval_batch_size", 64,
            "--learning_rate", arguments.learning_rate, "--warmup_steps", arguments.steps // 10,
            "--lr_scheduler_type", "cosine", "--max_steps", arguments.steps, "--logging_steps", 100,
            "--save_steps", arguments.steps, "--sample_tokens", 0, mask_flag, str(masked).lower(),
            *(["--packing"] if arguments.packing else []),
        )  # fmt: skip
        seconds = time.perf_counter() - start
        # Evaluated with the loss on the answers alone either way, so that the two losses mean the same.
        evaluation_dir = output_dir + "-eval"
        run(
            os.path.join(REPO, "run_clm_flax.py"), "--output_dir", evaluation_dir, "--overwrite_output_dir",
            "--model_name_or_path", output_dir, "--validation_file", validation_file, "--do_eval",
            "--block_size", arguments.block_size, "--per_device_eval_batch_size", 64, "--sample_tokens", 0,
        )  # fmt: skip
        with open(os.path.join(evaluation_dir, "eval_results.json")) as file:
            eval_loss = json.load(file)["eval_loss"]
        flax_accuracy = accuracy_of_generator(output_dir, test, chat)
        torch_accuracy = accuracy_of_transformers(output_dir, test, chat)
        covered = ("the assistant's turns" if chat else "the completions") if masked else "every token"
        print(f"| {covered} | {eval_loss:.4f} | {flax_accuracy:.1%} | {torch_accuracy:.1%} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
