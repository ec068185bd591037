#!/usr/bin/env python3
"""How long run_clm_flax.py's training checkpoint takes to save, and how much of that blocks training.

The state is GPT-2's (124M parameters by default) with its AdamW moments: about 1.5 GB in float32.
`save_checkpoint` returns once the arrays are copied off the devices (the part training waits for);
Orbax writes the files in the background, and takes their checksums before it commits them. Both times are
reported, a restore (which compares the checksums first) for comparison, and the checksums alone, taken and
compared, per GB.

    python benchmarks/benchmark_checkpoint.py [--preset gpt2|gpt2-medium] [--repeats 3]
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from transformers import GPT2Config

from flax_lm.devices.mesh import create_mesh
from flax_lm.models.gpt2.model import FlaxGPT2LMHeadModel
from flax_lm.run.checkpoints import open_checkpoints, restore_checkpoint, save_checkpoint
from flax_lm.run.checksums import checkpoint_checksum_problem, write_checkpoint_checksums
from flax_lm.training.train_state import abstract_train_state, create_train_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run_clm_flax  # noqa: E402

PRESETS = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12), "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="gpt2")
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()

    config = GPT2Config(
        vocab_size=50257, n_positions=1024, bos_token_id=0, eos_token_id=0, **PRESETS[arguments.preset]
    )
    model = FlaxGPT2LMHeadModel(config)
    training_arguments = run_clm_flax.TrainingArguments(output_dir="unused", weight_decay=0.1)
    optimizer = run_clm_flax.create_optimizer(
        training_arguments.optimizer_settings(),
        run_clm_flax.learning_rate_schedule(training_arguments.optimizer_settings(), 1000),
    )
    mesh = create_mesh()
    dummy_input = jnp.zeros((1, 8), jnp.int32)
    abstract_state = abstract_train_state(model, optimizer, mesh, dummy_input)
    state = create_train_state(model, optimizer, abstract_state, 0, dummy_input)
    jax.block_until_ready(state)
    parameters = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state.params))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))
    print(f"{arguments.preset}: {parameters / 1e6:.1f}M parameters, training state {state_bytes / 1e9:.2f} GB")

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as output_dir:
        with open_checkpoints(output_dir, save_total_limit=2) as checkpoints:
            for repeat in range(1, arguments.repeats + 1):
                start = time.perf_counter()
                save_checkpoint(checkpoints, state, {"step": repeat})
                blocking = time.perf_counter() - start
                checkpoints.wait_until_finished()
                total = time.perf_counter() - start
                print(
                    f"save {repeat}: training blocked {blocking:.2f} s; written in {total:.2f} s "
                    f"({state_bytes / 1e9 / total:.2f} GB/s)"
                )
        start = time.perf_counter()
        restored, _, path = restore_checkpoint("auto", output_dir, abstract_state, ["step"])
        jax.block_until_ready(restored)
        print(f"restore: {time.perf_counter() - start:.2f} s")
        checkpoint_bytes = sum(
            os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
        )
        for what, checksums in (("taken", write_checkpoint_checksums), ("compared", checkpoint_checksum_problem)):
            start = time.perf_counter()
            checksums(path)
            seconds = time.perf_counter() - start
            print(
                f"checksums {what} in {seconds:.2f} s, {seconds / (checkpoint_bytes / 1e9):.3f} s per GB "
                f"({checkpoint_bytes / 1e9:.2f} GB of files, read from the page cache)"
            )


if __name__ == "__main__":
    main()
