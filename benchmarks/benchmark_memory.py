#!/usr/bin/env python3
"""Memory per device of run_clm_flax.py's train step on each device mesh, as XLA accounts for the compiled step:
the training state (parameters and AdamW's two moments) and the batch it is given, and the temporaries it needs
(activations kept for the backward pass, gradients, gathered parameters). Nothing is allocated: the step is compiled
for the shapes alone, so GPT-2 large's account comes from a laptop. The presets are create_config.py's causal ones
(GPT-2 and Llama sizes), the vocabulary padded to a multiple of 64 (which every tensor size up to 64 divides).

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

from flax_lm.devices.mesh import create_mesh
from flax_lm.models.model_code import load_model_code
from flax_lm.training.lifecycle import set_up_training

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import create_config  # noqa: E402
import run_clm_flax  # noqa: E402

PRESETS = {name: preset for name, preset in create_config.PRESETS.items() if preset[0] != "roberta"}


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
    model_code = load_model_code(config, None, True, "benchmark_memory.py", mesh)
    model = model_code.module.MODEL_CLASS(
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
    script = run_clm_flax.SCRIPT_TRAINING
    setup = set_up_training(
        model, model_code, script, eval_step, training_arguments.training_settings(), None, arguments.block_size
    )
    # One step's batch: (steps of the call, micro-batches, rows, positions).
    shape = (1, 1, setup.train_batch_size, arguments.block_size)
    batches = {"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.call_batches_sharding)}
    memory = setup.compiled_train_steps.lower(setup.abstract_state, batches, 1).compile().memory_analysis()
    gibibyte = 2**30
    return {
        "state_and_batch": memory.argument_size_in_bytes / gibibyte,
        "temporaries": memory.temp_size_in_bytes / gibibyte,
        "total": (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / gibibyte,
    }


def main():
    arguments = parse_arguments()
    model_type, values = PRESETS[arguments.preset]
    values = {**values, "vocab_size": create_config.round_up(values["vocab_size"], 64), "bos_token_id": 0}
    config = create_config.CONFIG_CLASSES[model_type](**values, eos_token_id=0)
    if arguments.block_size > config.max_position_embeddings:
        raise SystemExit(
            f"error: {arguments.preset} has {config.max_position_embeddings} positions; lower --block_size"
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
