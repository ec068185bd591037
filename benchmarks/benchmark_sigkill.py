#!/usr/bin/env python3
"""How much a SIGKILL costs run_clm_flax.py: kill a run at random moments, resume each with the same command, count.

Every trial starts the preemption-safe command (`--resume_from_checkpoint` with no value) in a fresh output
directory, kills it with SIGKILL at a moment drawn uniformly over the training part of an uninterrupted run
(from the log line that starts training to the process's exit: steps, saves, the final wait for the last
checkpoint), then runs the same command again to the end. For each trial it reports

- the steps done when the kill came (the last step logged: --logging_steps 1 reads every step's metrics) and
  the step the second run resumed from: their difference is the steps lost, which must not exceed one save
  interval plus the steps done while the last checkpoint was still being written;
- whether the resume started at or after the newest checkpoint announced as committed (it must);
- whether the final weights equal the uninterrupted run's, bit for bit (they must: the data order, dropout and
  the optimizer state all continue from the checkpoint).

    python benchmarks/benchmark_sigkill.py [--kills 20] [--max_steps 40] [--save_steps 8] [--seed 0]

The model is a one-layer GPT-2 and the tokenizer is trained on the test corpus, so the sweep runs on a laptop;
all runs share one compilation cache.
"""

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from safetensors.numpy import load_file

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO_DIR, "tests", "fixtures", "en")


def prepare_model_dir(directory: str, environment: dict):
    """A 1000-token tokenizer trained on the test corpus and a one-layer GPT-2 config (dropout on)."""
    subprocess.run(
        [sys.executable, os.path.join(REPO_DIR, "train_tokenizer.py"),
         "--train_file", os.path.join(CORPUS, "train.txt"), "--model_type", "gpt2", "--vocab_size", "1000",
         "--model_max_length", "64", "--output_dir", directory],
        env=environment, check=True, capture_output=True,
    )  # fmt: skip
    from transformers import GPT2Config

    GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    ).save_pretrained(directory)


def command(model_dir: str, output_dir: str, arguments) -> list[str]:
    return [
        sys.executable, os.path.join(REPO_DIR, "run_clm_flax.py"), "--output_dir", output_dir,
        "--config_name", model_dir, "--tokenizer_name", model_dir, "--train_file", os.path.join(CORPUS, "train.txt"),
        "--do_train", "--block_size", "32", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
        "--seed", str(arguments.seed), "--max_steps", str(arguments.max_steps),
        "--save_steps", str(arguments.save_steps),
        "--logging_steps", "1", "--save_total_limit", "2", "--sample_tokens", "0", "--resume_from_checkpoint",
    ]  # fmt: skip


class Run:
    """A run of the command whose log lines are read as they come."""

    def __init__(self, argument_list, environment):
        self.process = subprocess.Popen(
            argument_list, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines, self.training_started = [], None
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.process.stderr:
            if self.training_started is None and "Training steps" in line:
                self.training_started = time.perf_counter()
            self.lines.append(line)

    def wait_for_training(self):
        while self.training_started is None:
            if self.process.poll() is not None:
                sys.exit(f"the run ended before training:\n{self.log()[-3000:]}")
            time.sleep(0.001)

    def finish(self) -> int:
        code = self.process.wait()
        self.reader.join()
        return code

    def log(self) -> str:
        return "".join(self.lines)


def last_number(pattern: str, text: str, default=None):
    numbers = [int(match) for match in re.findall(pattern, text)]
    return numbers[-1] if numbers else default


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--save_steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training runs and of the kill moments")
    arguments = parser.parse_args()
    moments = random.Random(arguments.seed)

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work_dir:
        environment = {
            **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HOME": os.path.join(work_dir, "hf_home"), "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": os.path.join(work_dir, "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }  # fmt: skip
        model_dir = os.path.join(work_dir, "model")
        prepare_model_dir(model_dir, environment)

        # Twice: the first run fills the caches (data, compilation), the second gives the duration to draw from.
        for _ in range(2):
            reference_dir = os.path.join(work_dir, "uninterrupted")
            shutil.rmtree(reference_dir, ignore_errors=True)
            reference = Run(command(model_dir, reference_dir, arguments), environment)
            if reference.finish() != 0:
                sys.exit(f"the uninterrupted run failed:\n{reference.log()[-3000:]}")
            duration = time.perf_counter() - reference.training_started
        expected = load_file(os.path.join(reference_dir, "model.safetensors"))
        print(
            f"uninterrupted run: {arguments.max_steps} steps, a checkpoint every {arguments.save_steps}, "
            f"training took {duration:.1f} s; {arguments.kills} kills at moments drawn uniformly over that time\n"
        )
        print(
            f"{'kill at':>8} {'steps done':>10} {'committed':>9} {'resumed at':>10} {'lost':>4} {'in flight':>9} "
            f"{'same weights':>12}"
        )

        results = []
        for trial in range(arguments.kills):
            output_dir = os.path.join(work_dir, f"trial{trial}")
            delay = moments.uniform(0, duration)
            killed = Run(command(model_dir, output_dir, arguments), environment)
            killed.wait_for_training()
            time.sleep(max(0.0, delay - (time.perf_counter() - killed.training_started)))
            killed.process.kill()
            killed.finish()
            log = killed.log()
            steps_done = last_number(r"step (\d+): loss", log, 0)
            committed = last_number(r"step (\d+): training checkpoint committed", log, 0)
            # The newest save started: steps done after it were done while it was being written.
            newest_save = last_number(r"step (\d+): saved the model", log, 0)
            resumed = Run(command(model_dir, output_dir, arguments), environment)
            if resumed.finish() != 0:
                sys.exit(f"trial {trial}: the resumed run failed:\n{resumed.log()[-3000:]}")
            resumed_from = last_number(r"Resumed from .* at step (\d+)", resumed.log(), 0)
            final = load_file(os.path.join(output_dir, "model.safetensors"))
            same = final.keys() == expected.keys() and all(
                np.array_equal(final[name], expected[name]) for name in expected
            )
            lost = max(0, steps_done - resumed_from)
            in_flight = steps_done - newest_save if newest_save > committed else 0
            results.append(dict(lost=lost, in_flight=in_flight, kept_commit=resumed_from >= committed, same=same))
            print(
                f"{delay:7.2f}s {steps_done:10d} {committed:9d} {resumed_from:10d} {lost:4d} {in_flight:9d} "
                f"{'yes' if same else 'NO':>12}"
            )
            shutil.rmtree(output_dir)

        lost = [result["lost"] for result in results]
        over_bound = [r for r in results if r["lost"] > arguments.save_steps + r["in_flight"]]
        print(
            f"\nsteps lost: mean {np.mean(lost):.1f}, max {max(lost)} (--save_steps {arguments.save_steps}); "
            f"over one save interval plus the steps in flight: {len(over_bound)} of {len(results)}\n"
            f"resumed before a checkpoint announced as committed: {sum(not r['kept_commit'] for r in results)}; "
            f"final weights equal to the uninterrupted run's: {sum(r['same'] for r in results)} of {len(results)}"
        )


if __name__ == "__main__":
    main()
