#!/usr/bin/env python3
"""Time to quality: from nothing to a model whose eval bits per byte is at or under a target, by wall clock.

Given a train and a validation text, it runs a recipe of this repository from nothing, as a user would: it trains the
tokenizer (train_tokenizer.py), writes the config (create_config.py) and trains and evaluates the model
(run_clm_flax.py), evaluating --evaluations times in the run so that the target is seen soon after it is reached.
Nothing is reused from earlier runs: the datasets and token caches live in the run's own directory and compiled
programs are not cached (--compilation_cache_dir none). It prints the wall time from its own start to the first
evaluation at or under the target, the tokens trained by then, and the final evaluation's bits per byte; its last
line is one JSON object with those (time_to_target_s is null when the target was never reached). The evaluations are
read from the run's own outputs: the TensorBoard scalars eval/bits_per_byte (with the time each was written) and
eval_results.json; the tokens from the global batch and block size its checkpoint records.

    python benchmarks/benchmark_time_to_quality.py --train_file train.jsonl --validation_file valid.jsonl \\
        --target_bits_per_byte 2.0 [--recipe recommended|baseline] [-- more run_clm_flax.py flags]

`--recipe recommended` (the default) is the recommended small recipe (docs/pretraining-clm.md), quickstart.sh's;
`--recipe baseline` the recipe quickstart.sh ran before it: GPT-2 tiny, AdamW, a cosine decay. Flags after `--` go
to run_clm_flax.py after the recipe's own (the last of a flag given twice counts), to try a change of recipe.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Recipe:
    vocab_size: int  # of the byte-level BPE tokenizer
    positions: int  # the tokenizer's model_max_length and the config's n_positions
    preset: str  # of create_config.py
    config: list[str]  # create_config.py --set KEY=VALUE ...
    training: list[str]  # run_clm_flax.py flags


NO_DROPOUT = ["resid_pdrop=0.0", "embd_pdrop=0.0", "attn_pdrop=0.0"]
RECIPES = {
    # quickstart.sh's recipe until the recommended one replaced it.
    "baseline": Recipe(
        vocab_size=8192,
        positions=256,
        preset="gpt2-tiny",
        config=NO_DROPOUT,
        training="--block_size 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 --optim adamw "
        "--learning_rate 2e-3 --warmup_steps 30 --lr_scheduler_type cosine --weight_decay 0.01 --adam_beta2 0.98 "
        "--max_steps 300".split(),
    ),
    # The recommended small recipe (and quickstart.sh's), chosen with this benchmark: see docs/measurements.md.
    "recommended": Recipe(
        vocab_size=4096,
        positions=256,
        preset="gpt2-tiny",
        config=[*NO_DROPOUT, "n_embd=64"],
        training="--block_size 128 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 --optim muon "
        "--learning_rate 1.6e-2 --muon_learning_rate 0.025 --warmup_steps 5 --lr_scheduler_type warmup_stable_decay "
        "--lr_decay_ratio 0.2 --lr_decay_shape linear --weight_decay 0.01 --adam_beta2 0.98 --max_steps 220".split(),
    ),
}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_file", required=True, help="the training text, in any format run_clm_flax.py reads")
    parser.add_argument("--validation_file", required=True, help="the validation text")
    parser.add_argument("--target_bits_per_byte", type=float, required=True, help="eval bits per byte to reach")
    parser.add_argument("--recipe", choices=RECIPES, default="recommended")
    parser.add_argument("--vocab_size", type=int, help="instead of the recipe's vocabulary size")
    parser.add_argument("--preset", help="instead of the recipe's create_config.py preset")
    parser.add_argument("--set", nargs="+", default=[], help="create_config.py --set KEY=VALUE, over the recipe's")
    parser.add_argument("--evaluations", type=int, default=10, help="evaluations in the run, evenly spaced")
    parser.add_argument("--work_dir", help="where the tokenizer, caches and run go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    parser.add_argument("run_flags", nargs="*", help="after --: more run_clm_flax.py flags, after the recipe's")
    return parser.parse_args()


def changed_recipe(recipe: Recipe, arguments) -> Recipe:
    """The recipe with the changes of the command line: another vocabulary size or preset, config values (each
    replacing the recipe's value of its key) and run_clm_flax.py flags."""
    config = dict(item.split("=", 1) for item in [*recipe.config, *arguments.set])
    return Recipe(
        vocab_size=arguments.vocab_size or recipe.vocab_size,
        positions=recipe.positions,
        preset=arguments.preset or recipe.preset,
        config=[f"{key}={value}" for key, value in config.items()],
        training=[*recipe.training, *arguments.run_flags],
    )


def run_tool(script: str, arguments: list[str], log_path: str) -> float:
    """Run one of the repository's tools offline, its output into `log_path`; stop on failure with its last lines.
    Returns the seconds it took."""
    start = time.time()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log_path, "w") as log:
        result = subprocess.run(
            [sys.executable, os.path.join(REPO_DIR, script), *arguments], stdout=log, stderr=log, env=environment
        )
    if result.returncode:
        with open(log_path) as log:
            sys.exit(f"{script} failed (exit status {result.returncode}):\n{log.read()[-3000:]}")
    return time.time() - start


def last_flag_value(flags: list[str], name: str) -> str:
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def evaluations(run_dir: str) -> list[tuple[float, int, float]]:
    """(wall time, step, bits per byte) of every evaluation the run logged to TensorBoard, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.wall_time, event.step, event.value) for event in events.Scalars("eval/bits_per_byte")]


def tokens_per_step(run_dir: str) -> int:
    """Global batch times block size, as the run's last training checkpoint records them."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    newest = max(os.listdir(checkpoints), key=int)
    with open(os.path.join(checkpoints, newest, "progress", "metadata")) as file:
        record = json.load(file)
    return record["global_batch_size"] * record["block_size"]


def main():
    arguments = parse_arguments()
    start = time.time()
    recipe = changed_recipe(RECIPES[arguments.recipe], arguments)
    work_dir = arguments.work_dir or tempfile.mkdtemp(prefix="time-to-quality-")
    os.makedirs(work_dir, exist_ok=True)
    model_dir, run_dir = os.path.join(work_dir, "model"), os.path.join(work_dir, "run")
    max_steps = int(last_flag_value(recipe.training, "--max_steps"))

    seconds = {}
    seconds["train_tokenizer"] = run_tool(
        "train_tokenizer.py",
        ["--train_file", arguments.train_file, "--model_type", "gpt2", "--vocab_size", str(recipe.vocab_size),
         "--model_max_length", str(recipe.positions), "--output_dir", model_dir, "--overwrite"],
        os.path.join(work_dir, "train_tokenizer.log"),
    )  # fmt: skip
    seconds["create_config"] = run_tool(
        "create_config.py",
        ["--preset", recipe.preset, "--tokenizer_dir", model_dir, "--pad_vocab_to_multiple_of", "64",
         "--set", f"n_positions={recipe.positions}", *recipe.config, "--overwrite"],
        os.path.join(work_dir, "create_config.log"),
    )  # fmt: skip
    eval_steps = max(max_steps // arguments.evaluations, 1)
    seconds["run_clm_flax"] = run_tool(
        "run_clm_flax.py",
        ["--output_dir", run_dir, "--overwrite_output_dir", "--config_name", model_dir, "--tokenizer_name", model_dir,
         "--train_file", arguments.train_file, "--validation_file", arguments.validation_file,
         "--cache_dir", os.path.join(work_dir, "cache"), "--compilation_cache_dir", "none",
         "--do_train", "--do_eval", "--sample_tokens", "0", "--report_to", "tensorboard",
         "--eval_steps", str(eval_steps), "--logging_steps", str(eval_steps), "--save_steps", str(max_steps),
         *recipe.training],
        os.path.join(work_dir, "run_clm_flax.log"),
    )  # fmt: skip
    end = time.time()

    logged = evaluations(run_dir)
    with open(os.path.join(run_dir, "eval_results.json")) as file:
        final_bits_per_byte = json.load(file)["eval_bits_per_byte"]
    reached = next(
        ((wall_time, step) for wall_time, step, value in logged if value <= arguments.target_bits_per_byte), None
    )
    step_tokens = tokens_per_step(run_dir)
    results = {
        "recipe": arguments.recipe,
        "target_bits_per_byte": arguments.target_bits_per_byte,
        "time_to_target_s": None if reached is None else round(reached[0] - start, 1),
        "tokens": None if reached is None else reached[1] * step_tokens,
        "final_bits_per_byte": final_bits_per_byte,
        "total_time_s": round(end - start, 1),
        # Of the tools it ran, all cores together: on a machine shared with other work, the wall time grows with the
        # load and this much less.
        "cpu_time_s": round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 1),
        "total_tokens": max_steps * step_tokens,
        "seconds_per_tool": {script: round(value, 1) for script, value in seconds.items()},
        "evaluations": [(step, round(value, 4)) for _, step, value in logged],
    }
    if reached is None:
        print(f"never reached {arguments.target_bits_per_byte} bits per byte in {results['total_time_s']} s")
    else:
        print(
            f"reached {arguments.target_bits_per_byte} bits per byte in {results['time_to_target_s']} s, at step "
            f"{reached[1]} after {results['tokens']:,} tokens"
        )
    print(
        f"final: {final_bits_per_byte:.4f} bits per byte after {results['total_tokens']:,} tokens, {end - start:.1f} s"
    )
    if not (arguments.keep or arguments.work_dir):
        shutil.rmtree(work_dir)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
