#!/usr/bin/env python3
"""DPO training steps per second: run_dpo_flax.py beside TRL's DPOTrainer, on the same model, pairs and batch.

The model is a random Llama (--hidden_size, --layers; transformers' LlamaForCausalLM, saved once) with a byte-level
BPE tokenizer of 512 tokens trained on the test corpus; the pairs are made-up prompts of --prompt_words words with
a chosen and a rejected completion of --completion_words words each, so that every sequence has about the same
length on both sides (TRL pads each batch to its longest, run_dpo_flax.py every batch to the longest of the data).
Both sides train with AdamW in float32 (on the GPU where there is one), loss sigmoid, the reference model's
log-probabilities computed in every step (no --precompute_ref_log_probs), --batch_size pairs a step, each in its own
process, one after the other: run_dpo_flax.py as a user runs it, its steps/s read from the log lines (tokens/s over the
tokens of a step); TRL's from the time between the ends of its steps, taken by a callback. Each side's speed is the
best of its windows of --window steps after the first window (which compiles, or warms up).

    python benchmarks/benchmark_dpo.py [--steps 24] [--batch_size 8] [--hidden_size 256] [--layers 4]
"""

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "apple river stone cloud green tiger house music paper light north glass water field story night".split()


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--window", type=int, default=6, help="steps a speed is measured over")
    parser.add_argument("--batch_size", type=int, default=8, help="pairs a step")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt_words", type=int, default=24)
    parser.add_argument("--completion_words", type=int, default=16)
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--trl_side", nargs=2, metavar=("MODEL_DIR", "PAIRS"), help=argparse.SUPPRESS)
    return parser.parse_args()


def make_model(directory: str, arguments):
    """A byte-level BPE tokenizer of 512 tokens and a random Llama of the arguments' sizes in `directory`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([os.path.join(REPO, "tests", "fixtures", "en", "train.txt")], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=512, hidden_size=arguments.hidden_size, num_hidden_layers=arguments.layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * arguments.hidden_size, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_pairs(path: str, arguments):
    generator = random.Random(0)

    def words(count):
        return " ".join(generator.choice(WORDS) for _ in range(count))

    with open(path, "w") as file:
        for _ in range(arguments.pairs):
            pair = {"prompt": words(arguments.prompt_words) + ":", "chosen": " " + words(arguments.completion_words)}
            pair["rejected"] = " " + words(arguments.completion_words)
            file.write(json.dumps(pair) + "\n")


def ours(model_dir: str, pairs: str, output_dir: str, arguments) -> dict:
    """run_dpo_flax.py's steps/s: from the tokens/s of each log line after the first, over the tokens of a step."""
    command = [
        sys.executable, os.path.join(REPO, "run_dpo_flax.py"), "--model_name_or_path", model_dir,
        "--train_file", pairs, "--do_train", "--output_dir", output_dir, "--overwrite_output_dir",
        "--max_steps", arguments.steps, "--logging_steps", arguments.window, "--save_steps", arguments.steps,
        "--per_device_train_batch_size", arguments.batch_size, "--report_to", "none",
        "--steps_per_call", arguments.window, "--compilation_cache_dir", "none",
    ]  # fmt: skip
    started, cpu = time.perf_counter(), children_cpu_seconds()
    result = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=offline_environment())
    if result.returncode:
        raise SystemExit(f"run_dpo_flax.py failed:\n{result.stderr[-3000:]}")
    length = int(re.search(r"global batch \d+ pairs of 2 x (\d+) tokens", result.stderr).group(1))
    speeds = [float(value) for value in re.findall(r"step \d+: loss .*?, ([\d.]+) tokens/s", result.stderr)]
    steps_per_second = [speed / (2 * arguments.batch_size * length) for speed in speeds[1:]]
    return {
        "steps_per_second": max(steps_per_second),
        "sequence_length": length,
        "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": children_cpu_seconds() - cpu,
    }


def trl(model_dir: str, pairs: str, arguments) -> dict:
    """TRL's steps/s, measured in its own process (this script with --trl_side)."""
    command = [sys.executable, os.path.abspath(__file__), "--trl_side", model_dir, pairs]
    command += ["--steps", str(arguments.steps), "--window", str(arguments.window)]
    command += ["--batch_size", str(arguments.batch_size)]
    started, cpu = time.perf_counter(), children_cpu_seconds()
    result = subprocess.run(command, capture_output=True, text=True, env=offline_environment())
    if result.returncode:
        raise SystemExit(f"TRL's side failed:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured | {"wall_seconds": time.perf_counter() - started, "cpu_seconds": children_cpu_seconds() - cpu}


def children_cpu_seconds() -> float:
    """The CPU seconds (user and system) of the finished child processes: on a machine others share, a side's
    steps/s varies with their load, its CPU time much less."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trl_side(model_dir: str, pairs: str, arguments):
    """DPOTrainer on the same model and pairs; prints its best steps/s over windows after the first, as JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    ends = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    with open(pairs) as file:
        dataset = Dataset.from_list([json.loads(line) for line in file])
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=arguments.batch_size, max_steps=arguments.steps,
        learning_rate=1e-6, lr_scheduler_type="linear", logging_steps=arguments.steps, save_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), loss_type=["sigmoid"], max_length=1024,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.add_callback(StepTimes())
    trainer.train()
    window = arguments.window
    speeds = [window / (ends[end] - ends[end - window]) for end in range(2 * window - 1, len(ends), window)]
    print(json.dumps({"steps_per_second": max(speeds)}))


def offline_environment() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def main():
    arguments = parse_arguments()
    if arguments.trl_side:
        trl_side(*arguments.trl_side, arguments)
        return
    with tempfile.TemporaryDirectory() as directory:
        model_dir, pairs = os.path.join(directory, "model"), os.path.join(directory, "pairs.jsonl")
        make_model(model_dir, arguments)
        write_pairs(pairs, arguments)
        results = {"flax_lm": ours(model_dir, pairs, os.path.join(directory, "run"), arguments)}
        print("flax_lm:", json.dumps(results["flax_lm"]), flush=True)
        results["trl"] = trl(model_dir, pairs, arguments)
    ratio = results["flax_lm"]["steps_per_second"] / results["trl"]["steps_per_second"]
    shape = f"{arguments.batch_size} pairs x 2 x {results['flax_lm']['sequence_length']} tokens"
    print(f"Llama {arguments.layers} x {arguments.hidden_size}, {shape}, {arguments.steps} steps")
    for side, result in results.items():
        print(
            f"{side:8} {result['steps_per_second']:.2f} steps/s; the whole process {result['wall_seconds']:.0f} s, "
            f"{result['cpu_seconds']:.0f} CPU s"
        )
    print(f"flax_lm / trl: {ratio:.2f}x")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results | {"ratio": ratio}, file, indent=2)


if __name__ == "__main__":
    main()
