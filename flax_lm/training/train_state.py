"""The training state, created directly with its sharding, and the parts of a train step that do not depend on
the model or the loss: gradient accumulation, and an update applied only where it is finite."""

import contextlib
import operator
from functools import partial
from typing import Any

import flax
import flax.core.scope
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
            params = initial_params(model, seed, dummy_input)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    if loaded_params is not None:
        loaded_params = jax.device_put(loaded_params, shardings.params)
    return jax.jit(init, out_shardings=shardings)(loaded_params)


def initial_params(model, seed: int, dummy_input):
    """The parameters `model.init` gives for `seed`, value for value, computed so that they compile quickly.

    XLA compiles each random operation into code of its own: flax derives every parameter's key with a fold_in and
    draws every parameter with its initialiser, about 0.2 s of compiling each on a CPU (400 for a 12-layer model: 40 s
    there, three minutes on a GPU). Here the keys are derived in one vectorised fold_in, and each initialiser runs
    once per group of parameters it draws alike (the same projection of every layer), vectorised over their keys;
    vectorised, jax.random gives each key the numbers it gives it alone."""
    if getattr(model, "remat_policy", None):
        # Checkpointed layers differ only in what the backward pass keeps: the parameters and their keys are the same
        # without, and flax's lifted remat would trace their keys apart from the model's (drawn one by one below).
        model = model.clone(remat_policy=None)
    root = jax.random.key(seed)
    pending = []  # (path, initialiser with its arguments bound, the data flax folds into the root key)
    with deferred_initialisers(pending, root):
        variables = model.init(root, dummy_input, deterministic=True)
    data = jnp.stack([folded for _, _, folded in pending])
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(root, data)
    groups = {}
    for index, (_, initialiser, _) in enumerate(pending):
        # Initialisers that trace to the same program (same function, constants and shape) share one vectorised call.
        groups.setdefault(str(jax.make_jaxpr(initialiser)(keys[index])), []).append(index)
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(variables["params"]))
    for members in groups.values():
        values = jax.vmap(pending[members[0]][1])(jnp.stack([keys[index] for index in members]))
        # Drawn once: else XLA fuses the draw into each parameter's slice of it, compiling it once per parameter again.
        values = jax.lax.optimization_barrier(values)
        for position, index in enumerate(members):
            flat[pending[index][0]] = jax.tree_util.tree_map(operator.itemgetter(position), values)
    return nn.meta.unbox(flax.traverse_util.unflatten_dict(flat))


class _FoldInRecorder:
    """Stands in for jax.random inside flax's key derivation: notes the key and the data flax folds into it."""

    def __init__(self):
        self.folded = None

    def fold_in(self, key, data):
        self.folded = (key, data)
        return key


@contextlib.contextmanager
def deferred_initialisers(pending: list, root):
    """While active, a parameter flax creates from the key `root` is zeros of its shape, and its initialiser and the
    data flax would fold into `root` for it (the same make_rng call, so every later key is unchanged) are appended to
    `pending`, to be drawn afterwards. The zeros only feed the forward pass that `init` traces, which XLA drops as it
    is unused. A parameter whose key comes from another root (inside a lifted transform) is drawn as flax draws it."""
    original_param, original_random = flax.core.scope.Scope.param, flax.core.scope.random

    def param(scope, name, init_fn, *init_args, unbox=True, **init_kwargs):
        if scope.has_variable("params", name) or not scope.is_mutable_collection("params"):
            return original_param(scope, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
        scope.reserve(name, "params")
        recorder = flax.core.scope.random = _FoldInRecorder()
        try:
            scope.make_rng("params")
        finally:
            flax.core.scope.random = original_random
        if recorder.folded is None:
            raise RuntimeError(f"flax derived the key of parameter {name} without a fold_in; update initial_params")
        initialiser = partial(lambda key, fn, args, kwargs: fn(key, *args, **kwargs), fn=init_fn, args=init_args,
                              kwargs=init_kwargs)  # fmt: skip
        key_root, folded = recorder.folded
        if key_root is root:
            value = jax.tree_util.tree_map(
                lambda shape: jnp.zeros(shape.shape, shape.dtype), jax.eval_shape(initialiser, root)
            )
            pending.append(((*scope.path, name), initialiser, folded))
        else:
            value = initialiser(jax.random.fold_in(key_root, folded))
        scope.put_variable("params", name, value)
        return nn.meta.unbox(value) if unbox else value

    flax.core.scope.Scope.param = param
    try:
        yield
    finally:
        flax.core.scope.Scope.param = original_param


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


def accumulate_gradients(loss_and_sums, params, batch, step_rng):
    """Gradients of the loss summed over the micro-batches of `batch` (every array is (gradient_accumulation_steps,
    micro_batch, ...)), and the metric sums summed too: `loss_and_sums(params, micro_batch, dropout_rng)` gives one
    micro-batch's summed loss and a dict of its metric sums (float32 scalars)."""
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
