#!/usr/bin/env python3
"""Time to quality: from nothing to a model whose eval bits per byte is at or under a target, by wall clock.

Given a train and a validation text, it runs a recipe of this repository from nothing, as a user would: it trains the
tokenizer (train_tokenizer.py), writes the config (create_config.py) and trains and evaluates the model
(run_clm_flax.py), evaluating --evaluations times in the run so that the target is seen soon after it is reached.
Nothing is reused from earlier runs: the datasets and token caches live in the run's own directory and compiled
programs are not cached (--compilation_cache_dir none). It prints the wall time from its own start to the first
evaluation at or under the target, the CPU time by then (user and system, of every tool it ran: on a machine shared
with other work the wall time grows with the load, the CPU time much less), the tokens trained by then, and the final
evaluation's bits per byte; its last line is one JSON object with those (time_to_target_s is null when the target was
never reached) and every evaluation's step, wall and CPU seconds and bits per byte: the curve. The evaluations are
read from the run's own outputs: the TensorBoard scalars eval/bits_per_byte (with the time each was written) and
eval_results.json; the tokens from the global batch and block size its checkpoint records; the CPU time of the
training process from /proc (Linux), sampled four times a second.

    python benchmarks/benchmark_time_to_quality.py --train_file train.jsonl --validation_file valid.jsonl \\
        --target_bits_per_byte 2.0 [--recipe recommended|baseline|moe] [-- more run_clm_flax.py flags]

`--recipe recommended` (the default) is the recommended small recipe (docs/pretraining-clm.md), quickstart.sh's;
`--recipe baseline` the recipe quickstart.sh ran before it: GPT-2 tiny, AdamW, a cosine decay; `--recipe moe` the
recommended recipe's training of a mixture of experts with its active parameters (RECIPES["moe"] below). Flags after
`--` go to run_clm_flax.py after the recipe's own (the last of a flag given twice counts), to try a change of recipe.
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
    positions: int  # the tokenizer's model_max_length and the config's max_position_embeddings (GPT-2's n_positions)
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
# The recommended recipe's training with a mixture of experts in place of the MLPs, at the same active parameters a
# token (378,432 against the GPT-2's 378,624): a Mixtral of the same depth, width and heads, each MLP 8 SwiGLU experts
# of 107, 2 a token (Mixtral's routing; the experts as wide as a SwiGLU of the GPT-2's MLP weights, 171, split in two,
# and then wider by what the GPT-2 has and the Mixtral has not: position embeddings, biases), dropless, with the
# load-balancing loss at Mixtral's coefficient (transformers' default, 0.001). 624,960 parameters in all. The training
# is the recommended recipe's: --optim muon trains each expert's matrix as the GPT-2's MLP kernels (measurements.md).
RECIPES["moe"] = Recipe(
    vocab_size=4096,
    positions=256,
    preset="mixtral-tiny",
    config=[
        "hidden_size=64", "num_attention_heads=2", "num_key_value_heads=2", "intermediate_size=107",
        "num_local_experts=8", "num_experts_per_tok=2", "output_router_logits=true", "router_aux_loss_coef=0.001",
    ],
    training=RECIPES["recommended"].training,
)  # fmt: skip


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


def run_tool(script: str, arguments: list[str], log_path: str, cpu_clock: list | None = None) -> float:
    """Run one of the repository's tools offline, its output into `log_path`; stop on failure with its last lines.
    Returns the seconds it took. Given a list `cpu_clock`, appends to it (wall time, CPU seconds) of the tool's
    process every quarter second, its threads and finished workers included (Linux's /proc; nothing elsewhere)."""
    start = time.time()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, os.path.join(REPO_DIR, script), *arguments], stdout=log, stderr=log, env=environment
        )
        while process.poll() is None:
            if cpu_clock is not None and (seconds := process_cpu_seconds(process.pid)) is not None:
                cpu_clock.append((time.time(), seconds))
            time.sleep(0.25)
    if process.returncode:
        with open(log_path) as log:
            sys.exit(f"{script} failed (exit status {process.returncode}):\n{log.read()[-3000:]}")
    return time.time() - start


def process_cpu_seconds(pid: int) -> float | None:
    """User and system seconds of a running process and of the children it has waited for; None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def cpu_seconds_at(cpu_clock: list[tuple[float, float]], wall_time: float) -> float | None:
    """The CPU seconds a process had used at `wall_time`, interpolated between the samples around it."""
    before = [sample for sample in cpu_clock if sample[0] <= wall_time]
    after = [sample for sample in cpu_clock if sample[0] > wall_time]
    if not before:
        return None
    if not after:
        return before[-1][1]
    (wall_0, cpu_0), (wall_1, cpu_1) = before[-1], after[0]
    return cpu_0 + (cpu_1 - cpu_0) * (wall_time - wall_0) / (wall_1 - wall_0)


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
         "--set", f"max_position_embeddings={recipe.positions}", *recipe.config, "--overwrite"],
        os.path.join(work_dir, "create_config.log"),
    )  # fmt: skip
    eval_steps = max(max_steps // arguments.evaluations, 1)
    cpu_before_training, cpu_clock = sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), []
    seconds["run_clm_flax"] = run_tool(
        "run_clm_flax.py",
        ["--output_dir", run_dir, "--overwrite_output_dir", "--config_name", model_dir, "--tokenizer_name", model_dir,
         "--train_file", arguments.train_file, "--validation_file", arguments.validation_file,
         "--cache_dir", os.path.join(work_dir, "cache"), "--compilation_cache_dir", "none",
         "--do_train", "--do_eval", "--sample_tokens", "0", "--report_to", "tensorboard",
         "--eval_steps", str(eval_steps), "--logging_steps", str(eval_steps), "--save_steps", str(max_steps),
         *recipe.training],
        os.path.join(work_dir, "run_clm_flax.log"),
        cpu_clock,
    )  # fmt: skip
    end = time.time()

    # Each evaluation: its step, the wall and CPU seconds from the benchmark's start, its bits per byte.
    logged = []
    for wall_time, step, value in evaluations(run_dir):
        training_cpu = cpu_seconds_at(cpu_clock, wall_time)
        cpu = None if training_cpu is None else round(cpu_before_training + training_cpu, 1)
        logged.append((step, round(wall_time - start, 1), cpu, value))
    with open(os.path.join(run_dir, "eval_results.json")) as file:
        final_bits_per_byte = json.load(file)["eval_bits_per_byte"]
    reached = next((evaluation for evaluation in logged if evaluation[3] <= arguments.target_bits_per_byte), None)
    step_tokens = tokens_per_step(run_dir)
    results = {
        "recipe": arguments.recipe,
        "target_bits_per_byte": arguments.target_bits_per_byte,
        "time_to_target_s": None if reached is None else reached[1],
        # On a machine shared with other work, the wall time grows with the load and the CPU time much less.
        "cpu_time_to_target_s": None if reached is None else reached[2],
        "tokens": None if reached is None else reached[0] * step_tokens,
        "final_bits_per_byte": final_bits_per_byte,
        "total_time_s": round(end - start, 1),
        "cpu_time_s": round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 1),
        "total_tokens": max_steps * step_tokens,
        "seconds_per_tool": {script: round(value, 1) for script, value in seconds.items()},
        "load_average": os.getloadavg()[0],  # of the last minute, at the end
        "evaluations": [(*evaluation[:3], round(evaluation[3], 4)) for evaluation in logged],
    }
    if reached is None:
        print(f"never reached {arguments.target_bits_per_byte} bits per byte in {results['total_time_s']} s")
    else:
        print(
            f"reached {arguments.target_bits_per_byte} bits per byte in {results['time_to_target_s']} s "
            f"({results['cpu_time_to_target_s']} CPU s), at step {reached[0]} after {results['tokens']:,} tokens"
        )
    print(
        f"final: {final_bits_per_byte:.4f} bits per byte after {results['total_tokens']:,} tokens, {end - start:.1f} s"
    )
    if not (arguments.keep or arguments.work_dir):
        shutil.rmtree(work_dir)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
