#!/usr/bin/env python3
"""How much a SIGKILL costs run_clm_flax.py: kill runs at chosen steps, resume each with the same command, count.

Every trial starts the preemption-safe command (`--resume_from_checkpoint` with no value) in a fresh output
directory and kills it with SIGKILL at a chosen point of training: the kill steps are spread evenly over
1..max_steps-1 with a random offset each, and the kill comes when the run logs that step (--logging_steps 1
logs every step) plus a random delay of up to the time the uninterrupted run took to the next step, so that
a kill at a save step can land in the middle of the save. A few more trials (--final_kills) are killed after
the last step, at a random moment of the final save and exit. Then the same command runs again to the end.
For each trial it reports

- the steps done when the kill came (the last step logged) and the step the second run resumed from: their
  difference is the steps lost, which must not exceed one save interval plus the steps done while the last
  checkpoint was still being written;
- whether the resume started at or after the newest checkpoint announced as committed (it must);
- whether the final weights equal the uninterrupted run's, bit for bit (they must: the data order, dropout and
  the optimizer state all continue from the checkpoint).

    python benchmarks/benchmark_sigkill.py [--kills 20] [--final_kills 4] [--max_steps 40] [--save_steps 8]

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
    """A run of the command whose log lines are read, and timed, as they come; killed with SIGKILL `kill_delay`
    seconds after a line containing `kill_after` when that is given."""

    def __init__(self, argument_list, environment, kill_after: str | None = None, kill_delay: float = 0.0):
        self.process = subprocess.Popen(
            argument_list, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines, self.times, self.end_time = [], [], None
        self.kill_after, self.kill_delay, self.kill_timer, self.killed = kill_after, kill_delay, None, False
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        # The pipe is read in text mode, so the progress bar's carriage returns split lines too.
        for line in self.process.stderr:
            self.times.append(time.perf_counter())
            self.lines.append(line)
            if self.kill_after is not None and self.kill_timer is None and self.kill_after in line:
                self.kill_timer = threading.Timer(self.kill_delay, self.kill)
                self.kill_timer.start()
        self.end_time = time.perf_counter()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.killed = True

    def finish(self) -> int:
        code = self.process.wait()
        self.reader.join()
        if self.kill_timer is not None:
            self.kill_timer.cancel()
        return code

    def log(self) -> str:
        return "".join(self.lines)

    def step_times(self, message: str = "loss") -> dict:
        """When each step's line with `message` came, by step."""
        return {
            int(match.group(1)): moment
            for line, moment in zip(self.lines, self.times)
            if (match := re.search(rf"step (\d+): {message}", line))
        }


def last_number(pattern: str, text: str, default=None):
    numbers = [int(match) for match in re.findall(pattern, text)]
    return numbers[-1] if numbers else default


def kill_plan(arguments, step_gaps: dict, draws: random.Random) -> list[tuple[str, int, float]]:
    """(kind, step, delay) of each trial: `--kills` steps spread evenly over 1..max_steps-1 with a random offset
    in each stretch, then `--final_kills` after the last step; each delay is drawn uniformly over the time the
    uninterrupted run took from that step's log line to the next one (to its exit after the last step)."""
    stretch = (arguments.max_steps - 1) / arguments.kills
    steps = [1 + int((trial + draws.random()) * stretch) for trial in range(arguments.kills)]
    plan = [("training", step, draws.uniform(0, step_gaps[step])) for step in steps]
    last = arguments.max_steps
    return plan + [("final", last, draws.uniform(0, step_gaps[last])) for _ in range(arguments.final_kills)]


def phase_of(kind: str, killed: bool, steps_done: int, committed: int, newest_save: int, save_steps: int) -> str:
    """Where the kill landed, read from the killed run's log."""
    if not killed:
        return "exited first"
    if kind == "final":
        return "final: " + ("after commit" if committed == steps_done else "saving")
    if newest_save > committed:
        return "ckpt in flight"
    if steps_done % save_steps == 0 and newest_save < steps_done:
        return "in save"
    return "training"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="trials killed during training")
    parser.add_argument("--final_kills", type=int, default=4, help="trials killed during the final save and exit")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--save_steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training runs and of the kill points")
    arguments = parser.parse_args()
    if arguments.kills < 1 or arguments.final_kills < 0 or arguments.max_steps < 2:
        parser.error("--kills must be at least 1, --final_kills at least 0 and --max_steps at least 2")

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work_dir:
        environment = {
            **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HOME": os.path.join(work_dir, "hf_home"), "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": os.path.join(work_dir, "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }  # fmt: skip
        model_dir = os.path.join(work_dir, "model")
        prepare_model_dir(model_dir, environment)

        # Twice: the first run fills the caches (data, compilation), the second gives the time between steps.
        for _ in range(2):
            reference_dir = os.path.join(work_dir, "uninterrupted")
            shutil.rmtree(reference_dir, ignore_errors=True)
            reference = Run(command(model_dir, reference_dir, arguments), environment)
            if reference.finish() != 0:
                sys.exit(f"the uninterrupted run failed:\n{reference.log()[-3000:]}")
        expected = load_file(os.path.join(reference_dir, "model.safetensors"))
        step_times = reference.step_times()
        if sorted(step_times) != list(range(1, arguments.max_steps + 1)):
            sys.exit(f"the uninterrupted run did not log every step:\n{reference.log()[-3000:]}")
        step_times[arguments.max_steps + 1] = reference.end_time
        step_gaps = {step: step_times[step + 1] - step_times[step] for step in range(1, arguments.max_steps + 1)}
        plan = kill_plan(arguments, step_gaps, random.Random(arguments.seed))
        saved, committed = reference.step_times("exported the model"), reference.step_times("training checkpoint")
        # How long a checkpoint stays in flight bounds the steps a kill can lose beyond one save interval.
        commit_lags = [committed[step] - saved[step] for step in saved if step in committed]
        print(
            f"uninterrupted run: {arguments.max_steps} steps, a checkpoint every {arguments.save_steps}, "
            f"{step_times[arguments.max_steps] - step_times[1]:.1f} s from step 1 to step {arguments.max_steps}, "
            f"{step_gaps[arguments.max_steps]:.2f} s from then to its exit; checkpoints announced as committed "
            f"{min(commit_lags):.2f} to {max(commit_lags):.2f} s after their save started\n"
            f"{arguments.kills} kills at steps spread over 1..{arguments.max_steps - 1}, {arguments.final_kills} "
            f"after step {arguments.max_steps}; each after a random delay of up to the time to the next step\n"
        )
        print(
            f"{'kill after':>16} {'phase':>19} {'steps done':>10} {'committed':>9} {'resumed at':>10} {'lost':>4} "
            f"{'bound':>5} {'same weights':>12}"
        )

        results = []
        for trial, (kind, kill_step, delay) in enumerate(plan):
            output_dir = os.path.join(work_dir, f"trial{trial}")
            killed = Run(command(model_dir, output_dir, arguments), environment, f"step {kill_step}: loss", delay)
            code = killed.finish()
            if not killed.killed and code != 0:
                sys.exit(f"trial {trial}: the run failed before its kill:\n{killed.log()[-3000:]}")
            log = killed.log()
            steps_done = last_number(r"step (\d+): loss", log, 0)
            committed = last_number(r"step (\d+): training checkpoint committed", log, 0)
            # The newest save started: steps done after it were done while it was being written.
            newest_save = last_number(r"step (\d+): exported the model", log, 0)
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
            bound = arguments.save_steps + in_flight
            phase = phase_of(kind, killed.killed, steps_done, committed, newest_save, arguments.save_steps)
            results.append(
                {"kind": kind, "killed": killed.killed, "lost": lost, "bound": bound, "same": same,
                 "kept_commit": resumed_from >= committed}
            )  # fmt: skip
            print(
                f"{f'step {kill_step} +{delay:.2f}s':>16} {phase:>19} {steps_done:10d} {committed:9d} "
                f"{resumed_from:10d} {lost:4d} {bound:5d} {'yes' if same else 'NO':>12}"
            )
            shutil.rmtree(output_dir)

        during = [r for r in results if r["kind"] == "training" and r["killed"]]
        lost = [r["lost"] for r in during] or [0]
        print(
            f"\nkilled during training: {len(during)} of {arguments.kills}; steps lost: mean {np.mean(lost):.1f}, "
            f"max {max(lost)} (--save_steps {arguments.save_steps})\n"
            f"killed after the last step: {sum(r['killed'] for r in results if r['kind'] == 'final')} of "
            f"{arguments.final_kills}\n"
            f"over one save interval plus the steps in flight: {sum(r['lost'] > r['bound'] for r in results)}; "
            f"resumed before a checkpoint announced as committed: {sum(not r['kept_commit'] for r in results)}; "
            f"final weights equal to the uninterrupted run's: {sum(r['same'] for r in results)} of {len(results)}"
        )


if __name__ == "__main__":
    main()
