#!/usr/bin/env python3
"""Memory per device of run_clm_flax.py's train step on each device mesh, as XLA accounts for the compiled step:
the training state (parameters and AdamW's two moments) and the batch it is given, and the temporaries it needs
(activations kept for the backward pass, gradients, gathered parameters). Nothing is allocated: the step is compiled
for the shapes alone, so GPT-2 large's account comes from a laptop.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/benchmark_memory.py --preset gpt2 \\
        --mesh_shape data=8 --mesh_shape fsdp=8 --mesh_shape data=2,tensor=4 --mesh_shape fsdp=2,tensor=4

The global batch is --per_device_train_batch_size x the devices, on every mesh: a tensor group computes its rows
together, so per device it holds every row of its group but 1/tensor of each layer's heads and columns.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from transformers import GPT2Config

from flax_lm.mesh import create_mesh
from flax_lm.models.gpt2 import FlaxGPT2LMHeadModel, check_model_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run_clm_flax  # noqa: E402

# GPT-2's published sizes, the vocabulary padded from 50257 to a multiple of 64 (which every tensor size up to 64
# divides).
PRESETS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="gpt2")
    parser.add_argument("--mesh_shape", action="append", help="a mesh to account for; give it once per mesh")
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--per_device_train_batch_size", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the computation's")
    parser.add_argument("--gradient_checkpointing", metavar="POLICY", help="a jax.checkpoint_policies name")
    return parser.parse_args()


def step_memory(config, arguments, mesh_shape: str) -> dict:
    """Gibibytes per device: the state and batch the step takes, and the temporaries it needs."""
    mesh = create_mesh(mesh_shape)
    check_model_config(config, mesh)
    model = FlaxGPT2LMHeadModel(
        config, dtype=jnp.dtype(arguments.dtype), remat_policy=arguments.gradient_checkpointing, mesh=mesh
    )
    training_arguments = run_clm_flax.TrainingArguments(
        output_dir="unused",
        do_train=True,
        max_steps=1000,
        per_device_train_batch_size=arguments.per_device_train_batch_size,
        mesh_shape=mesh_shape,
        steps_per_call=1,
    )
    eval_step = run_clm_flax.make_eval_step(model)
    setup = run_clm_flax.set_up_training(model, eval_step, training_arguments, None, arguments.block_size)
    # One step's batch: (steps of the call, micro-batches, rows, positions).
    shape = (1, 1, setup.train_batch_size, arguments.block_size)
    batches = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.call_batches_sharding)}
    memory = setup.train_steps.lower(setup.abstract_state, batches, 1).compile().memory_analysis()
    gibibyte = 2**30
    return {
        "state_and_batch": memory.argument_size_in_bytes / gibibyte,
        "temporaries": memory.temp_size_in_bytes / gibibyte,
        "total": (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / gibibyte,
    }


def main():
    arguments = parse_arguments()
    config = GPT2Config(
        vocab_size=50304, n_positions=1024, bos_token_id=50256, eos_token_id=50256, **PRESETS[arguments.preset]
    )
    print(
        f"{arguments.preset}: {jax.device_count()} devices, global batch "
        f"{arguments.per_device_train_batch_size * jax.device_count()} x {arguments.block_size} tokens, computing in "
        f"{arguments.dtype}, parameters and AdamW in float32, remat {arguments.gradient_checkpointing or 'off'}"
    )
    print(f"{'mesh':<24} {'state+batch GiB':>16} {'temporaries GiB':>16} {'total GiB':>10}")
    for mesh_shape in arguments.mesh_shape or [f"data={jax.device_count()}"]:
        memory = step_memory(config, arguments, mesh_shape)
        sizes = (memory[name] for name in ("state_and_batch", "temporaries", "total"))
        print(f"{mesh_shape:<24} " + " ".join(f"{size:>{width}.2f}" for size, width in zip(sizes, (16, 16, 10))))


if __name__ == "__main__":
    main()
