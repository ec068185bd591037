"""What the Flax models share: activations by their Hugging Face config names, when attention runs as cuDNN's
kernel, dense layers and the tied output layer multiplied as one matrix, the layout of activations over a device
mesh, and the segments of documents packed end to end into one sequence."""

import math
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from flax_lm.mesh import LOGICAL_AXIS_RULES

ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def use_cudnn_attention(dtype) -> bool:
    """Whether attention runs as cuDNN's fused (flash) kernel: on NVIDIA GPUs in half precision (cuDNN has no
    float32 kernel, and jax.nn.dot_product_attention does not choose it by itself); elsewhere it is written out."""
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def constrain(x, mesh: jax.sharding.Mesh | None, logical_axes: tuple):
    """`x` laid out over `mesh` by the logical names of its axes (flax_lm.mesh.LOGICAL_AXIS_RULES; None: whole on
    every device); `x` as it is without a mesh. The models pin their activations so: left to itself, XLA may
    choose to replicate an activation that a tensor-parallel layer means to split. An axis that its mesh axes do not
    divide stays whole (a decoding step's one position, a batch of one prompt)."""
    if mesh is None:
        return x
    rules = dict(LOGICAL_AXIS_RULES)
    spec = []
    for size, name in zip(x.shape, logical_axes):
        mesh_axes = rules.get(name) if name else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        ways = math.prod(mesh.shape[axis] for axis in mesh_axes) if mesh_axes else 1
        spec.append(mesh_axes if mesh_axes and size % ways == 0 else None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


class RowsDense(nn.Dense):
    """nn.Dense (same parameters) applied to its input's positions as the rows of one matrix, (rows, in) x (in, out).
    Multiplied with the batch and length axes kept apart, the backward pass's weight gradient contracts over both,
    and XLA:CPU first copies the output's gradient transposed: about a tenth of a small model's step."""

    def __call__(self, inputs):
        rows = inputs.reshape(-1, inputs.shape[-1])
        return super().__call__(rows).reshape(*inputs.shape[:-1], self.features)


@jax.custom_vjp
def logits_product(rows, weights):
    """(rows, vocab) float32 logits of `rows` (rows, width) times the output layer's `weights` (width, vocab),
    accumulated in float32 and returned unrounded for the loss. The gradient goes back through the product in the
    inputs' dtype, as under PyTorch's autocast: in bfloat16 a float32 gradient would make the output layer's two
    backward products float32 ones, the largest of a small model's step (GPT-2 124M on an H200: 17 of 74 ms)."""
    return jnp.dot(rows, weights, preferred_element_type=jnp.float32)


def _logits_product_forward(rows, weights):
    return logits_product(rows, weights), (rows, weights)


def _logits_product_backward(residuals, logits_gradient):
    rows, weights = residuals
    logits_gradient = logits_gradient.astype(rows.dtype)
    rows_gradient = jnp.dot(logits_gradient, weights.T, preferred_element_type=jnp.float32)
    weights_gradient = jnp.dot(rows.T, logits_gradient, preferred_element_type=jnp.float32)
    return rows_gradient.astype(rows.dtype), weights_gradient.astype(weights.dtype)


logits_product.defvjp(_logits_product_forward, _logits_product_backward)


def logits_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """A dot_general for an untied output layer's nn.Dense (rows, width) x (width, vocab): logits_product."""
    if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or lhs.ndim != 2:
        raise ValueError("logits_dot_general multiplies a (rows, width) matrix by a (width, vocab) kernel")
    return logits_product(lhs, rhs)


def tied_logits(hidden, embedding):
    """(batch, length, vocab) float32 logits of an output layer that is the token `embedding` (vocab, width),
    transposed; over the positions as one matrix, as RowsDense multiplies (see logits_product)."""
    batch, length, width = hidden.shape
    return logits_product(hidden.reshape(batch * length, width), embedding.T).reshape(batch, length, -1)


def look_up(table, row_axis: str | None, ids, mesh: jax.sharding.Mesh | None, dtype):
    """The rows of `table` (an nn.Embed; `row_axis`: the logical name of its rows) at `ids`, in `dtype`."""
    # The table whole along its embedding (gathered over fsdp, as for any layer's weights), still split by rows over
    # the tensor axis: each device looks up the ids in its rows, and one sum over the axis adds the rest. Left to
    # itself, XLA would look up in a table split along both and then move the result whole.
    embedding = constrain(table.embedding, mesh, (row_axis, None))
    return jnp.take(embedding, ids, axis=0).astype(dtype)


def same_segment(segment_ids):
    """(batch, length, length): whether query position q and key position k are of the same segment."""
    return segment_ids[:, :, None] == segment_ids[:, None, :]


def segments_and_positions(input_ids, separator_id: int, counted=None):
    """Segment ids and positions for a block of documents packed end to end: each `separator_id` (the token between
    documents) starts a segment, and a token's position is the number of tokens before it in its segment, of those
    where `counted` (batch, length) is true if it is given (RoBERTa does not count padding)."""
    starts = input_ids == separator_id
    segment_ids = jnp.cumsum(starts, axis=1)
    counted = jnp.ones(input_ids.shape, jnp.int32) if counted is None else counted.astype(jnp.int32)
    before = jnp.cumsum(counted, axis=1) - counted  # counted tokens before each position in the row
    return segment_ids, before - jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
