#!/usr/bin/env python3
"""Tokens per second of the mixture-of-experts layer's experts (flax_lm/models/shared/moe.py), dropless (the tokens
sorted by expert, each expert's rows one group of jax.lax.ragged_dot) beside the all-experts dense formulation (every
expert on every token, the router's weights zero for the experts a token does not use), at each number of experts;
and the activation memory of each: the temporaries XLA allocates for the step (memory_analysis of the compiled
program), beside the memory of the inputs and weights.

Dropless is measured with each grouped product (moe.dropless_experts): "blocks", the default on a CPU, and
jax.lax.ragged_dot, which XLA:CPU computes as every expert over every row (on GPUs and TPUs, grouped kernels). Beside
them the fixed-capacity dispatch of --moe_capacity_factor 1.25 (moe.capacity_experts), whose output differs by the
(token, expert) pairs it drops.

A step is the experts' forward and backward pass (the gradients of the input and of the three stacked kernels) on
--tokens tokens of --width, each routed to --top_k experts of --inner width by a random router; both formulations
compute the same output (checked). The first call compiles; the best of --rounds timed windows of --steps calls is
reported.

    python benchmarks/benchmark_moe.py [--experts 8 64] [--tokens 2048] [--width 256] [--inner 512] [--top_k 2]

With --mesh_shape (data=2,expert=4, over forced CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8),
the rows split over the mesh's batch axes and the experts over its expert axis as the models lay them out, the dropless
experts as XLA lays them out (moe.dropless_experts) beside the tokens exchanged by all-to-all
(moe.expert_parallel_experts), the first the reference of the last column.
"""

import argparse
import json
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flax_lm.devices.mesh import create_mesh  # noqa: E402
from flax_lm.models.shared import moe  # noqa: E402


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mesh_shape", help="compare the dropless experts' layouts on this mesh (data=2,expert=4)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser.parse_args()


# The formulations compared: dropless with each grouped product, run_clm_flax.py --moe_capacity_factor 1.25's experts
# (each takes at most 1.25 times an even share of the pairs: the output differs by the pairs dropped), and every
# expert on every token.
FORMULATIONS = {
    "dropless (blocks)": partial(moe.dropless_experts, grouping="blocks"),
    "dropless (ragged_dot)": partial(moe.dropless_experts, grouping="ragged_dot"),
    "capacity 1.25": lambda *arguments: moe.capacity_experts(*arguments, factor=1.25)[0],
    "dense": moe.dense_experts,
}


def mesh_formulations(mesh) -> dict:
    """The dropless experts on `mesh`: as XLA lays them out (the reference, first), and with the tokens exchanged."""
    return {
        "dropless (XLA's layout)": moe.dropless_experts,
        "dropless (all-to-all)": partial(moe.expert_parallel_experts, mesh=mesh),
    }


def on_mesh(mesh, x, logits, kernels):
    """The inputs laid out as the models lay them out: the rows over the batch's axes, the kernels' experts over the
    expert axis, their width over fsdp and their inner columns over tensor."""
    rows = NamedSharding(mesh, PartitionSpec(moe.TOKEN_AXES, None))
    inward = NamedSharding(mesh, PartitionSpec("expert", "fsdp", "tensor"))
    outward = NamedSharding(mesh, PartitionSpec("expert", "tensor", "fsdp"))
    placed = [jax.device_put(kernel, sharding) for kernel, sharding in zip(kernels, (inward, inward, outward))]
    return jax.device_put(x, rows), jax.device_put(logits, rows), tuple(placed)


def step_function(experts_function, top_k: int):
    """The experts' forward and backward pass: (gradients of x and the kernels of a sum of squares, the output)."""

    def loss(x, logits, kernels):
        expert_ids, weights = moe.route(logits, top_k, renormalize=True)
        y = experts_function(x, expert_ids, weights, *kernels, "silu")
        return jnp.sum(y * y), y

    return jax.jit(jax.grad(loss, argnums=(0, 2), has_aux=True))


def measure(implementation: str, experts_function, arguments, experts: int, inputs) -> dict:
    step = step_function(experts_function, arguments.top_k)
    compiled = step.lower(*inputs).compile()
    memory = compiled.memory_analysis()
    started = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    compile_and_first = time.perf_counter() - started
    best = float("inf")
    for _ in range(arguments.rounds):
        started = time.perf_counter()
        for _ in range(arguments.steps):
            result = compiled(*inputs)
        jax.block_until_ready(result)
        best = min(best, (time.perf_counter() - started) / arguments.steps)
    return {
        "implementation": implementation,
        "experts": experts,
        "tokens_per_s": arguments.tokens / best,
        "step_ms": best * 1e3,
        "temporaries_mb": memory.temp_size_in_bytes / 1e6,
        "arguments_mb": memory.argument_size_in_bytes / 1e6,
        "first_call_s": compile_and_first,
        "output": np.asarray(result[1]),
    }


def main():
    arguments = parse_arguments()
    formulations, reference = FORMULATIONS, "dense"
    if arguments.mesh_shape:
        mesh = create_mesh(arguments.mesh_shape)
        formulations = mesh_formulations(mesh)
        reference = next(iter(formulations))
    rows = []
    for experts in arguments.experts:
        rng = np.random.default_rng(0)
        width, inner = arguments.width, arguments.inner
        x = jnp.asarray(rng.standard_normal((arguments.tokens, width)), jnp.float32)
        logits = jnp.asarray(rng.standard_normal((arguments.tokens, experts)), jnp.float32)
        kernels = tuple(
            jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.float32)
            for shape in ((experts, width, inner), (experts, width, inner), (experts, inner, width))
        )
        inputs = on_mesh(mesh, x, logits, kernels) if arguments.mesh_shape else (x, logits, kernels)
        measured = [measure(name, function, arguments, experts, inputs) for name, function in formulations.items()]
        reference_output = next(row["output"] for row in measured if row["implementation"] == reference)
        for row in measured:
            difference = float(np.abs(row.pop("output") - reference_output).max())
            rows.append({**row, "largest_output_difference": difference})
    print(
        f"{arguments.tokens} tokens of width {arguments.width}, experts of width {arguments.inner}, "
        f"top-{arguments.top_k}, forward and backward, {jax.devices()[0].device_kind}"
        + (f", mesh {arguments.mesh_shape} of {jax.device_count()} devices" if arguments.mesh_shape else "")
    )
    print(f"{'experts':>7} {'formulation':>24} {'tokens/s':>10} {'step ms':>9} {'temporaries MB':>15} {'x ref':>6}")
    for row in rows:
        base = next(r for r in rows if r["experts"] == row["experts"] and r["implementation"] == reference)
        print(
            f"{row['experts']:>7} {row['implementation']:>24} {row['tokens_per_s']:>10.0f} {row['step_ms']:>9.1f} "
            f"{row['temporaries_mb']:>15.1f} {row['tokens_per_s'] / base['tokens_per_s']:>6.2f}"
        )
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump({"arguments": vars(arguments), "rows": rows, "jax": jax.__version__}, file, indent=1)


if __name__ == "__main__":
    main()
