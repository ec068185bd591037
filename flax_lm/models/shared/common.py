"""What the Flax models share: activations by their Hugging Face config names, causal attention (written out, as
cuDNN's kernel, and over a key/value cache for decoding; sliding windows and soft-capped logits), dense layers and the
output layer multiplied as one matrix, the layout of activations over a device mesh, and the segments of documents
packed end to end into one sequence. Then what the rotary decoders (llama.py, gemma.py, olmo2.py) share: rotary
positions, RMSNorm, the gated MLP, the embedding, final norm and output layer around their layers, and the mapping of
their parameters onto the Hugging Face checkpoint layout."""

import logging
import math
from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from flax_lm.devices.mesh import LOGICAL_AXIS_RULES, check_tensor_split
from flax_lm.errors import UsageError

logger = logging.getLogger(__name__)

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


def causal_attention(query, key, value, scale: float, dropout=None, segment_ids=None, window=None, softcap=None):
    """Causal attention of query (batch, length, heads, head_dim) over key and value (batch, length, key/value heads,
    head_dim); each key/value head serves heads // key/value heads query heads (grouped-query attention; as many:
    multi-head). With `segment_ids` (batch, length), a token attends only to the earlier tokens of its own segment;
    with `window`, only to the `window` latest tokens, itself included (a sliding-window layer); with `softcap`, the
    attention logits are capped smoothly at +-softcap (softcap * tanh(logits / softcap), Gemma 2's).
    `dropout` (a function of the attention weights) is applied to the weights, which jax.nn.dot_product_attention
    cannot do: with it, or with a cap, or off NVIDIA GPUs in half precision, attention is written out (XLA:CPU also
    runs that faster than the function's own XLA version); else it is cuDNN's fused kernel."""
    if dropout is None and softcap is None and use_cudnn_attention(query.dtype):
        visible = None if segment_ids is None else same_segment(segment_ids)[:, None]
        return fused_attention(query, key, value, scale, visible, causal=True, window=window)
    length = query.shape[1]
    visible = causal_visibility(jnp.arange(length), jnp.arange(length), window)[None]
    if segment_ids is not None:
        visible = visible & same_segment(segment_ids)
    return attention_written_out(query, key, value, scale, visible, dropout, softcap)


def fused_attention(query, key, value, scale: float, visible=None, causal=False, window=None, implementation="cudnn"):
    """jax.nn.dot_product_attention with the arguments of fused_attention_arguments: cuDNN's fused kernel by default;
    `implementation="xla"` computes the same attention with XLA's operations, anywhere."""
    arguments = fused_attention_arguments(query, key, visible, window)
    return jax.nn.dot_product_attention(
        query, key, value, scale=scale, is_causal=causal, implementation=implementation, **arguments
    )


def fused_attention_arguments(query, key, visible=None, window=None) -> dict:
    """The mask and window arguments of jax.nn.dot_product_attention in the form its cuDNN kernel accepts, for query
    (batch, queries, heads, head_dim) and key (batch, keys, key/value heads, head_dim). `visible`: None (every key
    visible, or only causality, which is_causal gives) or a bool array broadcastable to (batch, 1, queries, keys),
    True where the query may see the key: a padding mask (batch, 1, 1, keys), documents' segments (batch, 1, queries,
    keys). cuDNN takes a mask as an additive bias of the full (queries, keys) shape only (a (batch, 1, 1, keys) one
    is refused: "Bias must have same seq length as QKV, got 1 and ..."), and the function takes no segment ids; so
    the mask is spread over the queries. `window`: each query sees only the `window` latest keys, itself included."""
    arguments = {}
    if visible is not None:
        arguments["mask"] = jnp.broadcast_to(visible, (query.shape[0], 1, query.shape[1], key.shape[1]))
    if window is not None:
        arguments["local_window_size"] = (window - 1, 0)
    return arguments


def causal_visibility(query_positions, key_positions, window=None):
    """(..., queries, keys): whether each query sees each key: a key at its position or before, and with `window`,
    fewer than `window` positions before (transformers' sliding window: the key is among the window latest)."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def attention_written_out(query, key, value, scale: float, visible, dropout=None, softcap=None):
    """Attention of query (batch, queries, heads, head_dim) over key and value (batch, keys, key/value heads,
    head_dim) where `visible` (batch, queries, keys) allows, the logits capped at +-`softcap` if it is given."""
    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        # Query head h uses key/value head h // groups, as transformers repeats them. Repeated, the heads take the
        # multi-head products below, which XLA:CPU runs faster than products over the groups as an axis of their own.
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    weights = jax.nn.softmax(jnp.where(visible[:, None], logits, jnp.finfo(jnp.float32).min), axis=-1)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value)


def cached_attention(
    query, key, value, scale: float, cache: KeyValueCache, layer_index: int, mesh=None, window=None, softcap=None
):
    """Attention of new tokens, written to the cache at `cache.index`, over the cached ones and themselves; returns
    the output and the layer's new (keys, values). With `mesh`, the cache is split by heads over its tensor axis, as
    the attention is. `window` and `softcap` as for causal_attention; the window counts the row's own tokens, so that
    left padding changes no row."""

    # query: (batch, new, heads, head_dim); key, value: (batch, new, key/value heads, head_dim); the layer's cached
    # keys and values: (batch, slots, key/value heads, head_dim)
    def write(cached, new_entries):
        return jax.lax.dynamic_update_slice_in_dim(cached, new_entries.astype(cached.dtype), cache.index, axis=1)

    keys, values = write(cache.keys[layer_index], key), write(cache.values[layer_index], value)
    keys, values = (constrain(cached, mesh, ("batch", None, "heads", None)) for cached in (keys, values))
    new, slots = query.shape[1], keys.shape[1]
    query_slots = cache.index + jnp.arange(new)
    visible = cache.mask[:, None, :] & causal_visibility(query_slots, jnp.arange(slots))[None]
    if window is not None:
        slot_positions = jnp.cumsum(cache.mask, axis=1)  # the row's tokens up to each slot: distances in tokens
        query_positions = jax.lax.dynamic_slice_in_dim(slot_positions, cache.index, new, axis=1)
        visible = visible & (query_positions[:, :, None] - slot_positions[:, None, :] < window)
    # A padding slot's query sees nothing; the softmax then spreads evenly, harmlessly, as nobody reads it.
    if softcap is not None:
        return attention_written_out(query, keys, values, scale, visible, softcap=softcap), (keys, values)
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


# ---------------------------------------------------------------------------------------------------------------------
# The decoders of the Llama, Gemma and OLMo 2 modules: what their blocks share (rotary positions, RMSNorm, the gated
# MLP, the embedding, final norm and output layer around the layers), and their Hugging Face checkpoint layout.


def rope_parameters(config) -> dict:
    """The config's rotary settings as transformers 5 keeps them (rope_parameters), or as older configs wrote them
    (rope_theta beside an optional rope_scaling)."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        parameters = dict(parameters)
    else:
        parameters = dict(getattr(config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    parameters["rope_type"] = parameters.get("rope_type", parameters.get("type", "default"))
    return parameters


# The rope_type values rotary_frequencies computes: the plain rotary frequencies, all of them divided by a factor
# ("linear"), or Llama 3.1's scaling of the low frequencies ("llama3").
ROPE_TYPES = ("default", "linear", "llama3")


def check_rope(rope: dict, module_file: str, where: str = "rope_parameters"):
    """Refuse rotary settings that rotary_frequencies does not compute, naming them."""
    if rope["rope_type"] not in ROPE_TYPES:
        raise UsageError(
            f"{where} rope_type '{rope['rope_type']}' is not implemented by {module_file} (it computes "
            f"{', '.join(ROPE_TYPES)}); use one of those, or implement it in rotary_frequencies of a copy of "
            "flax_lm/models/common.py"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(
            f"{where} partial_rotary_factor is not implemented by {module_file}; remove it from the config"
        )


def rotary_frequencies(rope: dict, head_dim: int) -> np.ndarray:
    """(head_dim // 2,) float32 angular frequencies of the rotary positions of `rope` (rope_parameters): dimension
    pair i turns by position * frequency[i], as transformers computes them for the rope types of ROPE_TYPES."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    frequencies = (1.0 / (np.float32(rope["rope_theta"]) ** exponents)).astype(np.float32)
    if rope["rope_type"] == "linear":
        frequencies = frequencies / np.float32(rope["factor"])
    elif rope["rope_type"] == "llama3":
        # Wavelengths shorter than the original context / high_freq_factor keep their frequency, those longer than
        # it / low_freq_factor are slowed by `factor`, and those between are blended smoothly.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original_context = rope["original_max_position_embeddings"]
        wavelengths = 2 * math.pi / frequencies
        smooth = (original_context / wavelengths - low) / (high - low)
        blended = (1 - smooth) * frequencies / factor + smooth * frequencies
        frequencies = np.where(wavelengths > original_context / low, frequencies / factor, frequencies)
        between = (wavelengths <= original_context / low) & (wavelengths >= original_context / high)
        frequencies = np.where(between, blended, frequencies).astype(np.float32)
    return frequencies


def rotate(x, positions, frequencies):
    """x (batch, length, heads, head_dim) turned by the rotary angles of `positions` (batch, length): the first
    and second halves of each head are the two coordinates of head_dim // 2 pairs (transformers' rotate_half)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies)  # (batch, length, head_dim // 2)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    turned = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return turned.astype(x.dtype)


def head_dim_of(config) -> int:
    """The width of an attention head: the config's head_dim, which Qwen 3 and Gemma set apart from the width, else
    the width over the heads (Qwen 2, OLMo 2)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> list:
    """The sliding window of each layer (None: the layer sees every earlier token): config.sliding_window on the layers
    that layer_types names "sliding_attention" (Qwen 2 and 3, Gemma 2 and 3), on every layer where the config has no
    layer_types (Mistral), on none without one (Llama)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def refuse_foreign_keys(config, keys: tuple, architecture: str):
    """Refuse config keys that the decoders here would compute but `architecture` ignores (a sliding window on a
    Llama, soft-capping on a Qwen): an export would name a class that computes another model."""
    for key in keys:
        if getattr(config, key, None) is not None:
            raise UsageError(
                f"{key} is not part of {architecture}, which ignores it; remove it from the config, or use the "
                "model_type whose class has it (mistral or qwen2/qwen3 for sliding windows, gemma2 for soft-capping)"
            )


def check_decoder_config(config, module_file: str, mesh=None, activation_key: str = "hidden_act"):
    """Refuse what the decoders of common.py do not compute (attention dropout, a key/value head count that does not
    divide the heads, unknown layer types or activations), or what `mesh`'s tensor axis cannot split."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise UsageError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{config.num_key_value_heads}; fix the config"
        )
    activation = getattr(config, activation_key)
    if activation not in ACTIVATIONS:
        raise UsageError(f"{activation_key} '{activation}' is not supported; use one of {', '.join(ACTIVATIONS)}")
    if getattr(config, "attention_dropout", 0.0):
        raise UsageError(f"attention_dropout {config.attention_dropout} is not implemented by {module_file}; set 0.0")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UsageError(f"layer_types '{unknown[0]}' is not implemented by {module_file}; use full_attention or "
                             "sliding_attention")  # fmt: skip
        if len(layer_types) != config.num_hidden_layers:
            raise UsageError(f"layer_types names {len(layer_types)} layers but num_hidden_layers is "
                             f"{config.num_hidden_layers}; fix the config")  # fmt: skip
    if any(window is not None and window < 1 for window in layer_windows(config)):
        raise UsageError(f"sliding_window {config.sliding_window} must be a positive number of tokens, or null")
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (num_attention_heads)": config.num_attention_heads,
                "key/value heads (num_key_value_heads)": config.num_key_value_heads,
                "MLP width (intermediate_size)": config.intermediate_size,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), computed in float32, times a learned weight: as transformers' LlamaRMSNorm (the
    weight multiplies the normalized x rounded to the model's dtype), or, with `weight_in_float32`, as OLMo 2's and
    Gemma's (it multiplies before the rounding); with `unit_offset`, Gemma's, which stores the weight less one."""

    epsilon: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    unit_offset: bool = False
    weight_in_float32: bool = False
    logical_axis: str | None = "embed"

    @nn.compact
    def __call__(self, x):
        initializer = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight_init = nn.with_logical_partitioning(initializer, (self.logical_axis,))
        weight = self.param("weight", weight_init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normalized = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        if self.unit_offset:
            return (normalized * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
        if self.weight_in_float32:
            return (weight.astype(jnp.float32) * normalized).astype(self.dtype)
        return weight.astype(self.dtype) * normalized.astype(self.dtype)


class DecoderPart(nn.Module):
    """Base of the decoders' parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them. With `mesh`, the
    activations are laid out over it too (see constrain). NORM_STYLE: the RMSNorm fields of the family's norms."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each layer in the backward pass
    mesh: jax.sharding.Mesh | None = None

    NORM_STYLE = {}

    def child(self, module_class, name: str | None, **fields):
        return module_class(
            self.config, self.dtype, self.param_dtype, self.remat_policy, self.mesh, name=name, **fields
        )

    def constrain(self, x, logical_axes: tuple):
        return constrain(x, self.mesh, logical_axes)

    def dense(self, features: int, names: tuple, use_bias: bool, name: str) -> RowsDense:
        """An nn.Linear of the checkpoint: weights drawn from N(0, initializer_range), zero bias."""
        return RowsDense(
            features,
            use_bias=use_bias,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(self.config.initializer_range), names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def rms_norm(self, name: str, logical_axis: str | None = "embed") -> RMSNorm:
        return RMSNorm(
            self.config.rms_norm_eps, self.dtype, self.param_dtype, **self.NORM_STYLE, logical_axis=logical_axis,
            name=name,
        )  # fmt: skip

    def head_projections(self, x, use_bias: bool):
        """The query, key and value projections of x (batch, length, width), each (batch, length, heads, head_dim)."""
        config = self.config
        batch, length, _ = x.shape
        head_dim = head_dim_of(config)

        def project(heads_count: int, name: str):
            y = self.dense(heads_count * head_dim, ("embed", "heads"), use_bias, name)(x)
            return self.constrain(y.reshape(batch, length, heads_count, head_dim), ("batch", None, "heads", None))

        return (
            project(config.num_attention_heads, "q_proj"),
            project(config.num_key_value_heads, "k_proj"),
            project(config.num_key_value_heads, "v_proj"),
        )

    def attend(self, query, key, value, scale, cache, layer_index, segment_ids, window=None, softcap=None):
        """(output (batch, length, heads * head_dim), the layer's new (keys, values) when decoding, else None)."""
        layer_cache = None
        if cache is not None:
            y, layer_cache = cached_attention(query, key, value, scale, cache, layer_index, self.mesh, window, softcap)
        else:
            y = causal_attention(query, key, value, scale, None, segment_ids, window, softcap)
        return y.reshape(*y.shape[:2], -1), layer_cache


class GatedMLP(DecoderPart):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama, Qwen, Mistral, OLMo 2), GeGLU with gelu (Gemma)."""

    activation: str = "silu"
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        inner, bias = self.config.intermediate_size, self.use_bias
        gate = self.dense(inner, ("embed", "mlp"), bias, "gate_proj")(x)
        up = self.dense(inner, ("embed", "mlp"), bias, "up_proj")(x)
        hidden = self.constrain(ACTIVATIONS[self.activation](gate) * up, ("batch", None, "mlp"))
        y = self.dense(self.config.hidden_size, ("mlp", "embed"), bias, "down_proj")(hidden)
        return self.constrain(y, ("batch", "length", None))


class DecoderStack(DecoderPart):
    """The token embedding (times sqrt(width) with `scaled_embedding`, as Gemma's), the layers (`layer_class`, called
    (x, positions, cache, segment_ids) -> (x, layer cache)) and the final norm."""

    layer_class: Any = None
    scaled_embedding: bool = False

    def setup(self):
        config = self.config
        init = nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), ("vocab", "embed"))
        self.embed_tokens = nn.Embed(
            config.vocab_size, config.hidden_size, embedding_init=init, dtype=self.dtype, param_dtype=self.param_dtype
        )
        layer = self.layer_class
        if self.remat_policy:
            layer = nn.remat(layer, policy=getattr(jax.checkpoint_policies, self.remat_policy))
        # A list attribute names its modules layers_0, layers_1, ...: the checkpoint's layers.0, layers.1, ...
        self.layers = [self.child(layer, None, layer_index=index) for index in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.rms_norm_eps, self.dtype, self.param_dtype, **self.layer_class.NORM_STYLE)

    def __call__(self, input_ids, cache: KeyValueCache | None = None, separator_id=None):
        # input_ids: (batch, length) -> hidden states (batch, length, hidden_size), and the cache with them added
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        segment_ids = None
        if cache is not None:
            positions = cache.positions(input_ids.shape[1])
        elif separator_id is not None:
            segment_ids, positions = segments_and_positions(input_ids, separator_id)
        else:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1])[None, :], input_ids.shape)
        x = look_up(self.embed_tokens, "vocab", input_ids, self.mesh, self.dtype)
        if self.scaled_embedding:
            # In the model's dtype, as transformers rounds it (sqrt(2304) is 48.0 in bfloat16).
            x = x * jnp.asarray(self.config.hidden_size**0.5, self.dtype)
        x = self.constrain(x, ("batch", "length", None))
        layer_caches = []
        for layer in self.layers:
            x, layer_cache = layer(x, positions, cache, segment_ids)
            layer_caches.append(layer_cache)
        if cache is not None:
            keys, values = zip(*layer_caches)
            cache = cache.replace(keys=keys, values=values, index=cache.index + input_ids.shape[1])
        return self.norm(x), cache

    def attend(self, hidden):
        logits = tied_logits(hidden, self.embed_tokens.embedding.astype(self.dtype))
        return self.constrain(logits, ("batch", None, "vocab"))


class CausalDecoderLM(DecoderPart):
    """A decoder with its language-model head (tied to the embedding, or lm_head); returns float32 logits (batch,
    length, vocab_size), capped smoothly at +-config.final_logit_softcapping where the config sets it (Gemma).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).

    With `document_separator_id` (the token that starts each document: BOS), the input is taken for documents packed
    end to end: a token attends only to its own document, and rotary positions restart at each separator, so that
    each document is computed as if alone (Megatron-LM's --reset-attention-mask --reset-position-ids).

    A family's model class sets LAYER_CLASS (its decoder layer) and SCALED_EMBEDDING.
    """

    document_separator_id: int | None = None

    LAYER_CLASS = None
    SCALED_EMBEDDING = False

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        # `deterministic` is accepted as every model of the scripts takes it: these decoders have no dropout here.
        model = self.child(DecoderStack, "model", layer_class=self.LAYER_CLASS, scaled_embedding=self.SCALED_EMBEDDING)
        hidden, cache = model(input_ids, cache, self.document_separator_id)
        if self.config.tie_word_embeddings:
            logits = model.attend(hidden)
        else:
            logits = RowsDense(
                self.config.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(self.config.initializer_range), ("embed", "vocab")
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=logits_dot_general,
                name="lm_head",
            )(hidden)
            logits = self.constrain(logits, ("batch", None, "vocab"))
        logits = logits.astype(jnp.float32)
        if (cap := getattr(self.config, "final_logit_softcapping", None)) is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits if cache is None else (logits, cache)

    def empty_cache(self, prompt_mask, new_tokens: int) -> KeyValueCache:
        """The cache to decode the prompts of `prompt_mask` (batch, prompt length) and `new_tokens` more with."""
        config = self.config
        return KeyValueCache.empty(
            config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config), prompt_mask, new_tokens,
            self.dtype,
        )  # fmt: skip


def hf_name(flax_path: tuple) -> str:
    """('model', 'layers_3', 'self_attn', 'q_proj', 'kernel') -> 'model.layers.3.self_attn.q_proj.weight'."""
    *modules, leaf = flax_path
    modules = [
        f"layers.{module[7:]}" if module.startswith("layers_") and module[7:].isdigit() else module
        for module in modules
    ]
    return ".".join([*modules, "weight" if leaf in ("kernel", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """A decoder's Flax parameters as the PyTorch state dict of its transformers class (float32 numpy, HF names and
    layouts): every dense kernel, stored (in, out) here, is an nn.Linear weight (out, in) there."""
    state_dict = {}
    for path, value in flatten_dict(params).items():
        value = np.asarray(value, dtype=np.float32)
        state_dict[hf_name(path)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
    return state_dict


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone (arrays or
    jax.ShapeDtypeStruct): nothing is read or allocated. It follows to_hf_state_dict; change both together."""
    return {
        hf_name(path): tuple(value.shape[::-1] if path[-1] == "kernel" else value.shape)
        for path, value in flatten_dict(params).items()
    }


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes
    and placed as they are laid out (their sharding; without one, on the default device); the checkpoint's tensors may
    be of any float dtype (bfloat16, as most checkpoints are published). Each tensor is read (from a memory-mapped
    file, see flax_lm.models.huggingface.load_safetensors), converted and placed on its own, so that the host never
    holds a converted copy of all the weights beside the placed one."""
    params, used = {}, set()
    for path, expected in flatten_dict(abstract_params).items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"the checkpoint has no tensor {name}; it does not match the model config")
        value = state_dict[name]
        if path[-1] == "kernel":
            value = value.T
        if value.shape != expected.shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {value.shape} but the config needs {expected.shape}; "
                "pass the config the checkpoint was trained with"
            )
        params[path] = jax.device_put(np.asarray(value, dtype=expected.dtype), getattr(expected, "sharding", None))
        used.add(name)
    # The rotary frequencies some checkpoints carry are computed from the config here; a tied lm_head is the embedding.
    ignored = [
        name
        for name in state_dict
        if name not in used and not name.endswith(".rotary_emb.inv_freq") and name != "lm_head.weight"
    ]
    if ignored:
        logger.warning(
            "Ignoring %d checkpoint tensors the model does not use: %s", len(ignored), ", ".join(ignored[:5])
        )
    return unflatten_dict(params)


def linear_shapes(name: str, fan_in: int, fan_out: int, bias: bool) -> dict:
    """The tensors of a transformers nn.Linear, which stores its weight (out, in)."""
    return {f"{name}.weight": (fan_out, fan_in)} | ({f"{name}.bias": (fan_out,)} if bias else {})


def decoder_shapes(config, layer_shapes) -> dict[str, tuple[int, ...]]:
    """The tensors of a decoder of `config` as save_pretrained writes them (a tied lm_head left out): the embedding,
    those `layer_shapes(prefix)` gives for each layer, the final norm and the output layer."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for index in range(config.num_hidden_layers):
        shapes |= layer_shapes(f"model.layers.{index}")
    shapes["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes
