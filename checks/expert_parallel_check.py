"""The mixture-of-experts layer's experts split over the expert axis of meshes of 4 and 8 forced CPU devices, the
tokens exchanged by all-to-all (moe.expert_parallel_experts), against the dropless experts on one device; a tiny
Mixtral trained by run_clm_flax.py's step on data=2,expert=4, its checkpoint of step 2 resumed on data=4 (4 devices,
no token exchanged); and the same Mixtral's greedy generation (the sampler generate_flax.py decodes with) on the
expert=2,tensor=2. Prints, as one JSON line, for each mesh whether its compiled step holds an all-to-all and how far
its loss and gradients are from one device's, relative to their largest magnitude; the losses and largest weight
difference of the uninterrupted and the resumed runs; and whether the generation's prefill holds an all-to-all and
its tokens are one device's.

Run by tests/end_to_end/test_expert_parallel.py in a process of its own with 8 forced CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python checks/expert_parallel_check.py
"""

import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run_clm_flax  # noqa: E402
from flax_lm.devices.mesh import BATCH_AXES, MESH_AXES  # noqa: E402
from flax_lm.generation import sampling  # noqa: E402
from flax_lm.models.mixtral.model import FlaxMixtralForCausalLM  # noqa: E402
from flax_lm.models.shared import moe  # noqa: E402
from flax_lm.run.checkpoints import open_checkpoints, restore_checkpoint, save_checkpoint  # noqa: E402
from flax_lm.training.train_state import (  # noqa: E402
    abstract_model_params,
    abstract_train_state,
    create_train_state,
    parameter_shardings,
)

TOKENS, WIDTH, INNER, EXPERTS, TOP_K = 64, 16, 24, 8, 2
# The expert axis alone over 4 devices, and mixed with fsdp and tensor over 8 (the mesh's axes: data, fsdp, expert,
# tensor; the first devices of the process); with data in the Mixtral below.
MESHES = {"expert=4": (1, 1, 4, 1), "fsdp=2,expert=2,tensor=2": (1, 2, 2, 2)}
# The checkpoint's move: saved at step 2 of 3 on data=2,expert=4, resumed on data=4, whose step 3 exchanges no token
# and computes what the uninterrupted run's step 3 does with the exchange.
SAVED_ON, RESUMED_ON = {"data=2,expert=4": (2, 1, 4, 1)}, {"data=4": (4, 1, 1, 1)}
STEPS, SAVED_STEP = 3, 2
ROWS, LENGTH, VOCAB = 8, 8, 128
# Greedy generation with the experts split over the expert axis, mixed with tensor (generate_flax.py's meshes: whole
# rows on every device): 3 prompts, a batch of 4 rows, whose tokens the expert axis exchanges.
GENERATION_MESH, PROMPTS, NEW_TOKENS = (1, 1, 2, 2), [[5, 9, 17], [3], [40, 41, 42, 43]], 4
MIXTRAL = transformers.MixtralConfig(
    vocab_size=VOCAB, max_position_embeddings=LENGTH, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, bos_token_id=0,
    eos_token_id=1, output_router_logits=True, router_aux_loss_coef=0.1,
)  # fmt: skip


def inputs():
    """Rows, router logits and kernels; the router sends the first half of the rows to experts 0 and 1 (the first
    device's on expert=4: the most one device can receive from those devices), the others at random."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((TOKENS, EXPERTS))
    logits[: TOKENS // 2, :2] += 10.0
    kernels = tuple(
        jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.float32)
        for shape in ((EXPERTS, WIDTH, INNER), (EXPERTS, WIDTH, INNER), (EXPERTS, INNER, WIDTH))
    )
    return jnp.asarray(rng.standard_normal((TOKENS, WIDTH)), jnp.float32), jnp.asarray(logits, jnp.float32), kernels


def loss_and_gradients(experts):
    """The loss (a sum of squares of the experts' output) and its gradients of the rows, logits and kernels."""

    def loss(x, logits, kernels):
        expert_ids, weights = moe.route(logits, TOP_K, renormalize=True)
        y = experts(x, expert_ids, weights, *kernels, "silu")
        return jnp.sum(y * y)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def mesh_of(shape: tuple) -> jax.sharding.Mesh:
    """The first devices of the process on the mesh of `shape` (sizes of data, fsdp, expert, tensor)."""
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def relative_difference(got, expected) -> float:
    return float(jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected)))


def main():
    arguments = inputs()
    expected = loss_and_gradients(moe.dropless_experts)(*arguments)
    results = {}
    for name, shape in MESHES.items():
        mesh = mesh_of(shape)
        assert moe.exchanges_tokens(mesh, TOKENS)
        step = loss_and_gradients(partial(moe.expert_parallel_experts, mesh=mesh))
        compiled = step.lower(*arguments).compile()
        got = compiled(*arguments)
        differences = jax.tree.leaves(jax.tree.map(relative_difference, got, expected))
        results[name] = {
            "devices": mesh.size,
            "all_to_all": "all-to-all" in compiled.as_text(),
            "loss_difference": differences[0],
            "largest_gradient_difference": max(differences[1:]),
        }
    with tempfile.TemporaryDirectory() as output_dir:
        (saved_on, shape), (resumed_on, resumed_shape) = *SAVED_ON.items(), *RESUMED_ON.items()
        uninterrupted = train(mesh_of(shape), output_dir, first_step=1)
        resumed = train(mesh_of(resumed_shape), output_dir, first_step=SAVED_STEP + 1)
    differences = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), resumed["params"], uninterrupted["params"])
    results["resumed"] = {
        saved_on: {"losses": uninterrupted["losses"], "all_to_all": uninterrupted["all_to_all"]},
        resumed_on: {"losses": resumed["losses"], "all_to_all": resumed["all_to_all"]},
        "largest_weight_difference": max(jax.tree.leaves(differences)),
    }
    results["generation"] = generation(resumed["params"])
    print(json.dumps(results))


def generation(params) -> dict:
    """{"all_to_all": whether the prefill on GENERATION_MESH exchanges tokens, "same_tokens": whether the tokens
    decoded there are one device's} of the tiny Mixtral's greedy decoding of PROMPTS with the weights `params`."""
    dummy = jnp.zeros((1, LENGTH), jnp.int32)
    samplings = [sampling.Sampling(NEW_TOKENS)] * len(PROMPTS)
    one_device = sampling.make_sampler(FlaxMixtralForCausalLM(MIXTRAL), MIXTRAL.eos_token_id)
    expected = sampling.decode_rows(one_device, params, PROMPTS, samplings)
    model = FlaxMixtralForCausalLM(MIXTRAL, mesh=mesh_of(GENERATION_MESH))
    split_params = jax.device_put(params, parameter_shardings(abstract_model_params(model, dummy, False), model.mesh))
    sampler = sampling.make_sampler(model, MIXTRAL.eos_token_id)
    got = sampling.decode_rows(sampler, split_params, PROMPTS, samplings)
    # The prefill as DecodingBatch calls it, lowered again (not compiled) to read its collectives.
    prompt_ids, prompt_mask = sampling.left_padded(PROMPTS)
    settings = sampling.batch_settings(samplings, len(prompt_ids), VOCAB)
    variant = {
        "do_sample": False,
        "candidates": sampling.candidates_to_sort(samplings, VOCAB),
        **sampling.processing_variant(samplings),
    }
    capacity = sampling.shape_bucket(NEW_TOKENS, 8)
    prefill = sampler.prefill.lower(split_params, prompt_ids, prompt_mask, settings, capacity=capacity, **variant)
    return {"all_to_all": "all_to_all" in prefill.as_text(), "same_tokens": got == expected}


def train(mesh, output_dir: str, first_step: int):
    """{"losses": of the steps from `first_step` to STEPS, "params": the final ones, "all_to_all": whether the
    compiled step holds one} of run_clm_flax.py's train step on `mesh`: from the first step, saving the checkpoint of
    SAVED_STEP in `output_dir`, else resumed from it."""
    model = FlaxMixtralForCausalLM(MIXTRAL, remat_policy=None, mesh=mesh)
    args = run_clm_flax.TrainingArguments(output_dir=output_dir, learning_rate=1e-2)
    schedule = run_clm_flax.learning_rate_schedule(args.optimizer_settings(), 10)
    optimizer = run_clm_flax.create_optimizer(args.optimizer_settings(), schedule)
    dummy = jnp.zeros((1, LENGTH), jnp.int32)
    abstract = abstract_train_state(model, optimizer, mesh, dummy)
    if first_step == 1:
        state = create_train_state(model, optimizer, abstract, 0, dummy)
    else:
        state, progress, _ = restore_checkpoint("auto", output_dir, abstract, ["step"])
        assert progress["step"] == SAVED_STEP
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, BATCH_AXES))
    step = jax.jit(
        run_clm_flax.make_train_step(model, optimizer, schedule, 0),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
    )
    rng, losses, compiled = np.random.default_rng(0), [], None
    checkpoints = open_checkpoints(output_dir, 1)
    for step_number in range(1, STEPS + 1):
        input_ids = rng.integers(3, VOCAB, size=(1, ROWS, LENGTH), dtype=np.int32)  # every step's, to skip them
        if step_number < first_step:
            continue
        batch = jax.device_put({"input_ids": input_ids}, batch_sharding)
        compiled = compiled or step.lower(state, batch).compile()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss_sum"] / metrics["token_count"]))
        if step_number == SAVED_STEP and first_step == 1:
            save_checkpoint(checkpoints, state, {"step": SAVED_STEP})
    checkpoints.wait_until_finished()
    params = jax.tree.map(np.asarray, state.params)
    return {"losses": losses, "params": params, "all_to_all": "all-to-all" in compiled.as_text()}


if __name__ == "__main__":
    main()
