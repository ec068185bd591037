"""run_t5_mlm_flax.py beside the Hugging Face Flax example of the same name (benchmark_t5.py --versus): both scripts,
each in its own process, train the same T5 config from scratch with the same tokenizer on the same text file, with
the same input length, batch, steps, Adafactor and linear schedule, and evaluate on the same held-out file; the two
alternate (example, ours, example, ours ...) so that a machine's changing load falls on both.

The example is not part of this repository (nor of any installed package): pass the path of its file
(examples/flax/language-modeling/run_t5_mlm_flax.py of transformers' last release with Flax examples) and the Python
of an environment where it runs (transformers 4.x, which still has FlaxT5ForConditionalGeneration, with its jax, flax,
optax and datasets). Each side prints a line a step (the example: --logging_steps 1; ours: --logging_steps 1), so
the time and the process's CPU seconds are read as each step's line arrives: the steady speed is that of the steps
after --versus_skip_steps (compilation and warm-up excluded). The example's eval loss is the mean over its
evaluation batches (it drops the last partial one), ours the mean over every target token; both are mean
cross-entropy over the span-corruption targets of the held-out rows.

Two things are set for the example so that it computes what ours does:
- Its collator numbers the sentinels up from `tokenizer.vocab_size` (the tokens below the added ones), as T5's own
  tokenizer has them: train_tokenizer.py --model_type t5 keeps its sentinels in the model's vocabulary, where that
  count includes them and the example's sentinel ids would lie past the embedding (a NaN loss). The example gets a
  copy of the tokenizer whose sentinels are added tokens with the same ids: the same tokens for every text.
- It reads a .txt file a line a text, each ended by </s>; ours is given --text_sample_by line to match, and the
  example's count of steps (its rows of text, grouped as its datasets.map groups them, over the batch) as
  --max_steps.
"""

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUR_SCRIPT = os.path.join(REPOSITORY, "run_t5_mlm_flax.py")
# The example's lines: "Step... (12 | Loss: 5.1, Learning Rate: 0.004)" after a step, "Step... (31 | Loss: 4.8,
# Acc: 0.2)" after an evaluation; ours: "step 12: loss 5.1000, ..." and eval_results.json.
EXAMPLE_STEP = re.compile(r"Step\.\.\. \((\d+) \| Loss: ([^,]+), Learning Rate")
EXAMPLE_EVAL = re.compile(r"Step\.\.\. \((\d+) \| Loss: ([^,]+), Acc: ([^)]+)\)")
OUR_STEP = re.compile(r"step (\d+): ")
EXAMPLE_GROUP = 1000  # texts datasets.map hands group_texts at once; each group's remainder is dropped


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a running process, all its threads (Linux: /proc)."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def example_tokenizer(model_dir: str, into: str) -> str:
    """A copy of the config and tokenizer in `model_dir` whose sentinels are added tokens, outside the Unigram
    model's vocabulary, with the same ids (see the module's docstring)."""
    shutil.copytree(model_dir, into, dirs_exist_ok=True)
    path = os.path.join(into, "tokenizer.json")
    with open(path) as file:
        tokenizer = json.load(file)
    vocabulary = tokenizer["model"]["vocab"]
    sentinels = sum(piece.startswith("<extra_id_") for piece, _ in vocabulary)
    if not all(piece.startswith("<extra_id_") for piece, _ in vocabulary[len(vocabulary) - sentinels :]):
        raise SystemExit(
            f"error: the sentinels of {model_dir}/tokenizer.json are not the last tokens of its vocabulary"
        )
    tokenizer["model"]["vocab"] = vocabulary[: len(vocabulary) - sentinels]
    tokenizer["added_tokens"].sort(key=lambda token: token["id"])
    with open(path, "w") as file:
        json.dump(tokenizer, file)
    return into


def example_steps(train_file: str, model_dir: str, row_length: int, batch_size: int) -> int:
    """The steps of one epoch of the example: its rows of `row_length` tokens (the lines of the file, each tokenized
    with </s>, joined a group of EXAMPLE_GROUP lines at a time) over the batch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(train_file, encoding="utf-8") as file:
        lines = file.read().splitlines()
    rows = 0
    for start in range(0, len(lines), EXAMPLE_GROUP):
        ids = tokenizer(lines[start : start + EXAMPLE_GROUP])["input_ids"]
        rows += sum(map(len, ids)) // row_length
    return rows // batch_size


def common_settings(arguments) -> list[str]:
    return [
        f"--max_seq_length={arguments.max_seq_length}",
        f"--per_device_train_batch_size={arguments.batch_size}",
        f"--per_device_eval_batch_size={arguments.batch_size}",
        f"--learning_rate={arguments.learning_rate}",
        f"--warmup_steps={arguments.warmup_steps}",
        f"--seed={arguments.seed}",
        f"--train_file={arguments.train_file}",
        f"--validation_file={arguments.validation_file}",
        "--do_train",
        "--do_eval",
        "--logging_steps=1",
        "--save_steps=1000000",
    ]


def run_side(command: list[str], step_pattern, log_path: str, environment: dict) -> tuple[dict, list[str]]:
    """Runs one side; returns, by step, (seconds since the start, the process's CPU seconds) when its line came,
    and the lines it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    steps, lines = {}, []
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, bufsize=1
        ) as process,
    ):
        for line in process.stdout:
            log.write(line)
            lines.append(line)
            if (match := step_pattern.search(line)) and not EXAMPLE_EVAL.search(line):
                steps[int(match.group(1))] = (time.perf_counter() - start, process_cpu_seconds(process.pid))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode:
        raise SystemExit(f"error: {command[1]} failed (exit {process.returncode}); its output is in {log_path}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"steps": steps, "wall_seconds": time.perf_counter() - start, "cpu_seconds": cpu}, lines


def steady(result: dict, first: int, tokens_per_step: int) -> dict:
    """Speed over the steps after `first`, in wall and in CPU seconds."""
    steps = result.pop("steps")
    last = max(steps)
    if first not in steps or last <= first:
        raise SystemExit(f"error: too few steps logged ({sorted(steps)}) after --versus_skip_steps {first}")
    (wall_0, cpu_0), (wall_1, cpu_1) = steps[first], steps[last]
    tokens = (last - first) * tokens_per_step
    return result | {
        "timed_steps": last - first,
        "tokens_per_second": tokens / (wall_1 - wall_0),
        "tokens_per_cpu_second": tokens / (cpu_1 - cpu_0),
        "cpu_seconds_per_step": (cpu_1 - cpu_0) / (last - first),
    }


def versus(arguments, row_length: int) -> dict:
    """Alternates the two scripts --versus_rounds times each; returns each run's results and the medians."""
    work = tempfile.mkdtemp(prefix="t5-versus-")
    steps = example_steps(arguments.train_file, arguments.model_dir, row_length, arguments.batch_size)
    if steps <= arguments.versus_skip_steps + 1:
        raise SystemExit(f"error: {arguments.train_file} makes {steps} steps; give a longer file or a smaller batch")
    tokens_per_step = arguments.batch_size * row_length
    example_dir = example_tokenizer(arguments.model_dir, os.path.join(work, "example-tokenizer"))
    environment = dict(os.environ, PYTHONPATH=REPOSITORY, PYTHONUNBUFFERED="1")
    example_environment = {key: value for key, value in environment.items() if key != "PYTHONPATH"}
    runs = {"example": [], "ours": []}
    for round_number in range(arguments.versus_rounds):
        output = os.path.join(work, f"example-{round_number}")
        command = [arguments.versus_python, arguments.versus, f"--output_dir={output}"]
        command += [f"--config_name={example_dir}", f"--tokenizer_name={example_dir}", "--adafactor"]
        command += ["--num_train_epochs=1", f"--eval_steps={steps - 1}", *common_settings(arguments)]
        result, lines = run_side(command, EXAMPLE_STEP, output + ".log", example_environment)
        evals = [EXAMPLE_EVAL.search(line) for line in lines]
        result["eval_loss"] = float([match for match in evals if match][-1].group(2))
        runs["example"].append(steady(result, arguments.versus_skip_steps, tokens_per_step))
        print(f"example, round {round_number + 1}: {runs['example'][-1]}", flush=True)

        output = os.path.join(work, f"ours-{round_number}")
        command = [sys.executable, OUR_SCRIPT, f"--output_dir={output}", f"--config_name={arguments.model_dir}"]
        command += [f"--tokenizer_name={arguments.model_dir}", "--optim=adafactor", "--lr_scheduler_type=linear"]
        command += [f"--max_steps={steps}", f"--eval_steps={steps}", "--text_sample_by=line"]
        command += common_settings(arguments)
        result, _ = run_side(command, OUR_STEP, output + ".log", environment)
        with open(os.path.join(output, "eval_results.json")) as file:
            result["eval_loss"] = json.load(file)["eval_loss"]
        runs["ours"].append(steady(result, arguments.versus_skip_steps, tokens_per_step))
        print(f"ours, round {round_number + 1}: {runs['ours'][-1]}", flush=True)
    medians = {
        side: {key: float(np.median([run[key] for run in side_runs])) for key in side_runs[0]}
        for side, side_runs in runs.items()
    }
    ratios = {
        key: medians["ours"][key] / medians["example"][key] for key in ("tokens_per_second", "tokens_per_cpu_second")
    }
    return {"steps": steps, "row_length": row_length, "runs": runs, "medians": medians, "ratios": ratios}
