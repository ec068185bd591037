"""The training state, created directly with its sharding, and the parts of a train step that do not depend on
the model or the loss: gradient accumulation, and an update applied only where it is finite."""

from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from flax_lm.devices.mesh import LOGICAL_AXIS_RULES


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def abstract_model_params(model, dummy_input, unbox: bool = True):
    """Shapes and dtypes of the model's parameters, without computing them. Unboxed: plain arrays;
    boxed: each carries its logical axis names."""
    variables = jax.eval_shape(partial(model.init, deterministic=True), jax.random.key(0), dummy_input)
    return nn.meta.unbox(variables["params"]) if unbox else variables["params"]


def parameter_shardings(boxed_params, mesh):
    """Where each parameter lives on `mesh`, by the logical axis names it carries
    (flax_lm.devices.mesh.LOGICAL_AXIS_RULES)."""
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_params), mesh, LOGICAL_AXIS_RULES)


def abstract_train_state(model, optimizer, mesh, dummy_input) -> TrainState:
    """Shape, dtype and sharding of every leaf of the training state, computed without allocating it."""
    boxed_params = abstract_model_params(model, dummy_input, unbox=False)
    param_shardings = parameter_shardings(boxed_params, mesh)
    abstract_params = nn.meta.unbox(boxed_params)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Optimizer state that mirrors a parameter (Adam's moments, Muon's and Lion's momentum) is sharded like it; the
    # rest (step counts, Adafactor's factored statistics, whose shapes differ) is replicated. Where the parameters are
    # split into groups (optax.partition), a group's state holds a MaskedNode, no array, for each of the others.
    opt_state_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda leaf, param, sharding: (
            leaf if isinstance(leaf, optax.MaskedNode) else (sharding if leaf.shape == param.shape else replicated)
        ),
        abstract_opt_state,
        abstract_params,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda leaf: isinstance(leaf, optax.MaskedNode),
    )
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_state_shardings)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=abstract_opt_state)
    return jax.tree_util.tree_map(lambda shape, sharding: shape.update(sharding=sharding), shapes, shardings)


def create_train_state(model, optimizer, abstract_state: TrainState, seed: int, dummy_input, loaded_params=None):
    """The training state, created directly with its sharding: parameters are initialised (or placed,
    when loaded from a checkpoint) on the devices that hold them, never first in full on one device."""
    shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)

    def init(params):
        if params is None:
            params = nn.meta.unbox(model.init(jax.random.key(seed), dummy_input, deterministic=True)["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    if loaded_params is not None:
        loaded_params = jax.device_put(loaded_params, shardings.params)
    return jax.jit(init, out_shardings=shardings)(loaded_params)


def apply_finite_update(state: TrainState, grads, loss_sum, optimizer) -> tuple[TrainState, dict]:
    """`state` one step on, with the update of `grads` applied if it is finite; and the gradient norm and
    whether the update was finite, as metrics."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
    old = (state.params, state.opt_state)

    def update():
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    # A non-finite update is never applied: the step counter moves on, the weights stay as they were. XLA:CPU runs
    # only the branch taken, and a small model's step spends 3% less time than selecting between old and new for
    # every array; a GPU would stop to read the condition on its host, so accelerators select.
    if jax.default_backend() == "cpu":
        params, opt_state = jax.lax.cond(finite, update, lambda: old)
    else:
        params, opt_state = jax.tree_util.tree_map(lambda new, kept: jnp.where(finite, new, kept), update(), old)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, {"grad_norm": grad_norm, "finite": finite}


def apply_mean_update(state: TrainState, summed_grads, count, loss_sum, optimizer) -> tuple[TrainState, dict]:
    """apply_finite_update of the mean gradients: `summed_grads` over `count` (the tokens the loss sums over, of the
    whole batch however it was split into micro-batches), cast back to the parameters' dtype, as the float32 count
    would otherwise turn bfloat16 gradients, and with them the optimizer state, into float32."""
    grads = jax.tree_util.tree_map(lambda grad, param: (grad / count).astype(param.dtype), summed_grads, state.params)
    return apply_finite_update(state, grads, loss_sum, optimizer)


def trained_mask(params, is_trained) -> Any:
    """`params` with each leaf replaced by `is_trained(path, param)`: whether training updates it."""
    return jax.tree_util.tree_map_with_path(lambda path, param: bool(is_trained(path, param)), params)


def accumulate_gradients(loss_and_sums, params, batch, step_rng, is_trained=None):
    """Gradients of the loss summed over the micro-batches of `batch` (every array is (gradient_accumulation_steps,
    micro_batch, ...)), and the metric sums summed too: `loss_and_sums(params, micro_batch, dropout_rng)` gives one
    micro-batch's summed loss and a dict of its metric sums (float32 scalars). Only the parameters
    `is_trained(path, param)` picks (all by default) are differentiated: the gradient of a frozen one is never
    computed, and is zeros, which no update or gradient norm counts."""
    mask = trained_mask(params, is_trained or (lambda path, param: True))
    if all(jax.tree_util.tree_leaves(mask)):
        return summed_gradients(loss_and_sums, params, batch, step_rng)
    frozen = jax.tree_util.tree_map(lambda param, trained: None if trained else param, params, mask)

    def loss_of_trained(trained_params, micro_batch, dropout_rng):
        return loss_and_sums(joined(mask, trained_params, frozen), micro_batch, dropout_rng)

    trained = jax.tree_util.tree_map(lambda param, trained: param if trained else None, params, mask)
    grads, sums = summed_gradients(loss_of_trained, trained, batch, step_rng)
    return joined(mask, grads, jax.tree_util.tree_map(jnp.zeros_like, frozen)), sums


def step_gradients(loss_and_sums, state: TrainState, batch, dropout_key, is_trained=None):
    """accumulate_gradients of the step `state` is at, its dropout drawn from `dropout_key` folded with the step alone,
    so that a resumed run draws the masks the interrupted one would have."""
    step_rng = jax.random.fold_in(dropout_key, state.step)
    return accumulate_gradients(loss_and_sums, state.params, batch, step_rng, is_trained)


def joined(mask, trained, frozen):
    """One tree of the leaves of `trained` where `mask` is True and of `frozen` where it is False (each tree None
    at the other's leaves)."""
    return jax.tree_util.tree_map(lambda is_trained, mine, other: mine if is_trained else other, mask, trained, frozen)


def summed_gradients(loss_and_sums, params, batch, step_rng):
    """accumulate_gradients for every leaf of `params`."""
    gradients = jax.value_and_grad(loss_and_sums, has_aux=True)
    num_micro_batches = jax.tree_util.tree_leaves(batch)[0].shape[0]
    first_micro_batch = jax.tree_util.tree_map(lambda values: values[0], batch)
    if num_micro_batches == 1:
        (_, sums), grads = gradients(params, first_micro_batch, step_rng)
        return grads, sums

    def accumulate(totals, index):
        micro_batch = jax.tree_util.tree_map(lambda values: values[index], batch)
        (_, sums), grads = gradients(params, micro_batch, jax.random.fold_in(step_rng, index))
        return jax.tree_util.tree_map(jnp.add, totals, (grads, sums)), None

    # Summed in float32 whatever the parameters' dtype: in bfloat16, small contributions would round away.
    zeros = (
        jax.tree_util.tree_map(lambda param: jnp.zeros_like(param, dtype=jnp.float32), params),
        jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(loss_and_sums, params, first_micro_batch, step_rng)[1]),
    )
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, jnp.arange(num_micro_batches))
    return grads, sums


def repeat_train_step(train_step, steps_per_call: int):
    """`train_step(state, batch)` made into `train_steps(state, batches, count)`, which runs the first `count` batches
    of `batches` (every array (steps_per_call, ...)) one step each in one compiled loop, and returns the state and
    the metrics of every step stacked (steps_per_call, ...; those after `count` are zeros). Between small steps,
    returning to Python costs as much as the step's own arithmetic. The count is an argument rather than a shape, so
    calls of every count run the same compiled step: a run resumed at any step gives the uninterrupted run's weights
    bit for bit."""
    if steps_per_call == 1:  # no loop around the step

        def train_one_step(state, batches, count):
            state, metrics = train_step(state, jax.tree_util.tree_map(lambda values: values[0], batches))
            return state, jax.tree_util.tree_map(lambda value: value[None], metrics)

        return train_one_step

    # Jitted, the step is traced once for both the metrics' shapes below and the loop's body (XLA inlines it): a
    # third of a second less before a small model's first step.
    train_step = jax.jit(train_step)

    def train_steps(state, batches, count):
        def step(index, state_and_metrics):
            state, all_metrics = state_and_metrics
            batch = jax.tree_util.tree_map(
                lambda values: jax.lax.dynamic_index_in_dim(values, index, 0, False), batches
            )
            state, metrics = train_step(state, batch)
            all_metrics = jax.tree_util.tree_map(
                lambda stacked, value: stacked.at[index].set(value), all_metrics, metrics
            )
            return state, all_metrics

        first_batch = jax.tree_util.tree_map(lambda values: values[0], batches)
        metric_shapes = jax.eval_shape(train_step, state, first_batch)[1]
        no_metrics = jax.tree_util.tree_map(
            lambda shape: jnp.zeros((steps_per_call, *shape.shape), shape.dtype), metric_shapes
        )
        return jax.lax.fori_loop(0, count, step, (state, no_metrics))

    return train_steps


def train_step_compiler_options() -> dict:
    """XLA options for compiling the train step. On CPU, XLA's default scheduler orders the work for
    concurrency and so keeps alive the activations that gradient checkpointing means to free (GPT-2 124M,
    2 x 1024 tokens, remat nothing_saveable: 7.5 GiB of temporaries either way); its memory-optimised
    scheduler frees them (2.7 GiB), at no measured cost in speed."""
    if jax.default_backend() == "cpu":
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return {}
