#!/usr/bin/env python3
"""GRPO steps per second: run_grpo_flax.py beside TRL's GRPOTrainer, each in its own process, on the same model,
prompts, reward and batch (completions per step, --num_generations, --max_completion_length), on this machine's
CPU or accelerator. Each side's rate is taken after its first --warmup_steps (compilation, first allocations).

    python benchmarks/benchmark_grpo.py --model_name_or_path /tmp/grpo-synthetic/sft \
        --train_file /tmp/grpo-synthetic/prompts.jsonl [--steps 60] [--batch 64] [--num_generations 8]
    python benchmarks/benchmark_grpo.py --hidden_size 256 --layers 4    # a random Llama, prompts "a+b=" made here

benchmarks/grpo_synthetic.py writes such a model and prompts; without them, benchmark_dpo.py's random Llama (its
tokenizer trained on the test corpus) and the 100 prompts "a+b=" are made in a temporary directory, whose rewards
are mostly 0: the steps' work is the same. Needs the test requirements (TRL, PyTorch).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_dpo import make_model  # noqa: E402  (same folder)


def trl_side(args):
    """TRL's steps per second after the warm-up steps, printed as one JSON line (run in a process of its own)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from run_grpo_flax import addition

    torch.set_num_threads(os.cpu_count())
    with open(args.train_file) as file:
        prompts = [json.loads(line)["prompt"] for line in file if line.strip()]

    def reward(prompts, completions, **_):
        return [addition(prompt, completion) for prompt, completion in zip(prompts, completions)]

    times = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), num_generations=args.num_generations, per_device_train_batch_size=args.batch,
        max_completion_length=args.max_completion_length, learning_rate=args.learning_rate, loss_type="grpo",
        max_steps=args.steps, logging_steps=args.steps, report_to="none", use_cpu=not torch.cuda.is_available(),
        bf16=False, save_strategy="no", seed=args.seed,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]),
        processing_class=AutoTokenizer.from_pretrained(args.model_name_or_path),
        callbacks=[StepTimes()],
    )
    trainer.train()
    timed = times[args.warmup_steps - 1 :]
    print(json.dumps({"steps_per_second": (len(timed) - 1) / (timed[-1] - timed[0])}))


def ours(args) -> float:
    """run_grpo_flax.py's steps per second after the warm-up, from its grpo_log.jsonl (one line per step)."""
    output_dir = tempfile.mkdtemp()
    command = [
        sys.executable, os.path.join(REPO, "run_grpo_flax.py"), "--model_name_or_path", args.model_name_or_path,
        "--train_file", args.train_file, "--output_dir", output_dir, "--num_generations", str(args.num_generations),
        "--per_device_train_batch_size", str(args.batch), "--max_completion_length", str(args.max_completion_length),
        "--learning_rate", str(args.learning_rate), "--loss_type", "grpo", "--max_steps", str(args.steps),
        "--logging_steps", "1", "--seed", str(args.seed), "--lr_scheduler_type", "constant",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    with open(os.path.join(output_dir, "grpo_log.jsonl")) as file:
        logged = [json.loads(line) for line in file]
    seconds = [row["step"] / row["steps_per_second"] for row in logged]  # since the loop started, at each step
    first, last = args.warmup_steps - 1, len(logged) - 1
    return (logged[last]["step"] - logged[first]["step"]) / (seconds[last] - seconds[first])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="default: a random Llama of --hidden_size and --layers")
    parser.add_argument("--train_file", help='prompts, JSON lines of {"prompt": ...} (default: the 100 "a+b=")')
    parser.add_argument("--hidden_size", type=int, default=256, help="the random Llama's width")
    parser.add_argument("--layers", type=int, default=4, help="the random Llama's layers")
    parser.add_argument("--json", help="also write both sides' steps/s and their ratio to this JSON file")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--side", choices=["both", "trl"], default="both", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "trl":
        return trl_side(args)
    with tempfile.TemporaryDirectory() as directory:
        if args.model_name_or_path is None:
            args.model_name_or_path = os.path.join(directory, "model")
            make_model(args.model_name_or_path, args)
        if args.train_file is None:
            args.train_file = os.path.join(directory, "prompts.jsonl")
            with open(args.train_file, "w") as file:
                file.writelines(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(10) for b in range(10))
        flax_rate = ours(args)
        trl_command = [sys.executable, __file__, *sys.argv[1:], "--side", "trl"]
        trl_command += ["--model_name_or_path", args.model_name_or_path, "--train_file", args.train_file]
        result = subprocess.run(trl_command, check=True, capture_output=True, text=True)
    trl_rate = json.loads(result.stdout.strip().splitlines()[-1])["steps_per_second"]
    print(f"GRPO steps/s, {args.batch} completions of {args.max_completion_length} tokens a step:")
    print(f"  run_grpo_flax.py: {flax_rate:.2f}   TRL GRPOTrainer: {trl_rate:.2f}   ratio {flax_rate / trl_rate:.2f}x")
    if args.json:
        results = {"flax_lm": {"steps_per_second": flax_rate}, "trl": {"steps_per_second": trl_rate}}
        with open(args.json, "w") as file:
            json.dump(results | {"ratio": flax_rate / trl_rate}, file, indent=2)


if __name__ == "__main__":
    main()
