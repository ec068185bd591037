"""What the Flax models share: activations by their Hugging Face config names, causal attention (written out, as
cuDNN's kernel, and over a key/value cache for decoding), dense layers and the output layer multiplied as one
matrix, the layout of activations over a device mesh, and the segments of documents packed end to end into one
sequence."""

import math
from functools import partial

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from flax_lm.devices.mesh import LOGICAL_AXIS_RULES

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


class KeyValueCache(flax.struct.PyTreeNode):
    """The keys and values of every layer for the tokens decoded so far, so that a new token costs one position.

    Prompts of different lengths are left-padded to a common length: `mask` marks the slots that hold a token
    of the row, and a token's position is the number of such slots before it, so padding changes no row.
    """

    keys: tuple  # one (batch, slots, key/value heads, head_dim) array per layer
    values: tuple
    mask: jax.Array  # (batch, slots) bool: the slot holds a token of the row, not padding
    index: jax.Array  # int32: the slot the next token is written to

    @classmethod
    def empty(cls, layers: int, key_value_heads: int, head_dim: int, prompt_mask, new_tokens: int, dtype):
        """A cache for the prompts of `prompt_mask` (batch, prompt length) followed by `new_tokens` tokens."""
        batch = prompt_mask.shape[0]
        slots = prompt_mask.shape[1] + new_tokens
        zeros = tuple(jnp.zeros((batch, slots, key_value_heads, head_dim), dtype) for _ in range(layers))
        mask = jnp.concatenate([prompt_mask.astype(bool), jnp.ones((batch, new_tokens), bool)], axis=1)
        return cls(keys=zeros, values=zeros, mask=mask, index=jnp.zeros((), jnp.int32))

    def positions(self, new_tokens: int):
        """(batch, new_tokens) positions of the tokens written next: each row counts its own tokens; padding slots get
        position 0, and nothing reads them."""
        row_positions = jnp.maximum(jnp.cumsum(self.mask, axis=1) - 1, 0)
        return jax.lax.dynamic_slice_in_dim(row_positions, self.index, new_tokens, axis=1)


def causal_attention(query, key, value, scale: float, dropout=None, segment_ids=None):
    """Causal attention of query (batch, length, heads, head_dim) over key and value (batch, length, key/value heads,
    head_dim); each key/value head serves heads // key/value heads query heads (grouped-query attention; as many:
    multi-head). With `segment_ids` (batch, length), a token attends only to the earlier tokens of its own segment.
    `dropout` (a function of the attention weights) is applied to the weights, which jax.nn.dot_product_attention
    cannot do: with it, or with segments, or off NVIDIA GPUs in half precision, attention is written out (XLA:CPU
    also runs that faster than the function's own XLA version); else it is cuDNN's fused kernel."""
    if dropout is None and segment_ids is None and use_cudnn_attention(query.dtype):
        return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=True, implementation="cudnn")
    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        # Query head h uses key/value head h // groups, as transformers repeats them. Repeated, the heads take the
        # multi-head products below, which XLA:CPU runs faster than products over the groups as an axis of their own.
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    length = query.shape[1]
    visible = jnp.tril(jnp.ones((length, length), dtype=bool))
    if segment_ids is not None:
        visible = visible & same_segment(segment_ids)[:, None]
    weights = jax.nn.softmax(jnp.where(visible, logits, jnp.finfo(jnp.float32).min), axis=-1)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value)


def cached_attention(query, key, value, scale: float, cache: KeyValueCache, layer_index: int, mesh=None):
    """Attention of new tokens, written to the cache at `cache.index`, over the cached ones and themselves; returns
    the output and the layer's new (keys, values). With `mesh`, the cache is split by heads over its tensor axis, as
    the attention is."""

    # query: (batch, new, heads, head_dim); key, value: (batch, new, key/value heads, head_dim); the layer's cached
    # keys and values: (batch, slots, key/value heads, head_dim)
    def write(cached, new_entries):
        return jax.lax.dynamic_update_slice_in_dim(cached, new_entries.astype(cached.dtype), cache.index, axis=1)

    keys, values = write(cache.keys[layer_index], key), write(cache.values[layer_index], value)
    keys, values = (constrain(cached, mesh, ("batch", None, "heads", None)) for cached in (keys, values))
    new, slots = query.shape[1], keys.shape[1]
    query_slots = cache.index + jnp.arange(new)
    visible = cache.mask[:, None, :] & (jnp.arange(slots)[None, None, :] <= query_slots[None, :, None])
    # A padding slot's query sees nothing; the softmax then spreads evenly, harmlessly, as nobody reads it.
    output = jax.nn.dot_product_attention(query, keys, values, mask=visible[:, None], scale=scale)
    return output, (keys, values)


def constrain(x, mesh: jax.sharding.Mesh | None, logical_axes: tuple):
    """`x` laid out over `mesh` by the logical names of its axes (flax_lm.devices.mesh.LOGICAL_AXIS_RULES; None: whole
    on every device); `x` as it is without a mesh. The models pin their activations so: left to itself, XLA may choose
    to replicate an activation that a tensor-parallel layer means to split. An axis that its mesh axes do not divide
    stays whole (a decoding step's one position, a batch of one prompt)."""
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
