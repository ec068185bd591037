"""T5 in Flax: an encoder-decoder (T5 v1.1 and the original, ByT5's byte vocabularies) with parameter names and
layouts one-to-one with transformers' T5ForConditionalGeneration. What sets it apart from the decoders of this
package: relative position buckets (a learned bias per head added to the attention scores, held by the first block
of each stack and shared by the others) in place of position embeddings, unscaled attention, RMS norms before each
sublayer, an MLP of ReLU (the original) or gated GELU (v1.1, `feed_forward_proj: gated-gelu`), and an output layer
that is the shared embedding times d_model**-0.5 (the original) or a layer of its own, unscaled (v1.1: transformers'
config says `scale_decoder_outputs: false`, which a `tie_word_embeddings: false` sets).

The API, for training (run_t5_mlm_flax.py) and decoding (flax_lm/generation/seq2seq.py); `model = MODEL_CLASS(config,
dtype, param_dtype, remat_policy, mesh)`, ids int32, masks bool or 0/1 (1: a token, 0: padding):

    model.apply({"params": params}, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                deterministic=True, rngs={"dropout": key})
        -> float32 logits (batch, target length, vocab_size), as T5ForConditionalGeneration(...).logits;
        decoder_input_ids are the labels shifted right (shift_right(labels, config.decoder_start_token_id)), the
        decoder attends causally; either mask may be None (every token is real). model.init(key, input_ids) reads
        input_ids as both, for the parameters' shapes.
    model.apply({"params": params}, input_ids, attention_mask, method="encode")
        -> the encoder's output (batch, source length, d_model), in the compute dtype.
    model.apply({"params": params}, encoder_output, attention_mask, max_target_length, method="start_decoding")
        -> a DecoderCache: the cross-attention keys and values of every decoder layer, computed once from the
        encoder's output, and room for `max_target_length` decoder tokens of self-attention keys and values.
    model.apply({"params": params}, decoder_input_ids, cache, method="decode")
        -> (float32 logits (batch, new tokens, vocab_size), the cache with those tokens added): the tokens that
        follow the cached ones, the first call with the decoder start token (config.decoder_start_token_id, pad).

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    ACTIVATIONS,
    RMSNorm,
    RowsDense,
    constrain,
    logits_dot_general,
    look_up,
    tied_logits,
)
from flax_lm.models.shared.hf_state_dict import params_of, shapes_of, state_dict_of

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"t5": "T5ForConditionalGeneration"}
# Neither a causal LM (run_clm_flax.py) nor a masked one (run_mlm_flax.py): an encoder-decoder, which
# run_t5_mlm_flax.py trains and generate_flax.py decodes through flax_lm/generation/seq2seq.py.
GENERATES_TEXT = False
ENCODER_DECODER = True

MODULE_FILE = "flax_lm/models/t5/model.py"
# The MLPs transformers' T5 computes, by config.feed_forward_proj: the activation and whether a gate multiplies it.
FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_new", True), "gated-relu": ("relu", True)}


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a T5 variant this model does not implement, or one that the tensor axis
    of `mesh` cannot split."""
    if config.model_type not in HF_ARCHITECTURES:
        raise UsageError(f"{MODULE_FILE} was given a config of model type '{config.model_type}'")
    if config.feed_forward_proj not in FEED_FORWARD:
        raise UsageError(
            f"feed_forward_proj {config.feed_forward_proj!r} in the config is not supported by {MODULE_FILE}; use "
            f"one of {', '.join(FEED_FORWARD)}"
        )
    for name in ("d_model", "d_kv", "d_ff", "num_heads", "num_layers", "num_decoder_layers", "vocab_size"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} in the config must be a whole number of 1 or more, not {value!r}")
    buckets, distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
    if buckets < 4 or distance <= buckets // 4:
        raise UsageError(
            f"relative_attention_num_buckets {buckets} and relative_attention_max_distance {distance} in the config "
            "leave no logarithmic buckets; T5 uses 32 and 128"
        )
    if decoder_start_id(config) is None:
        raise UsageError("the config has no decoder_start_token_id nor pad_token_id; T5 starts decoding from pad (0)")
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (num_heads)": config.num_heads,
                "MLP width (d_ff)": config.d_ff,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


def scales_output(config) -> bool:
    """Whether the output layer is the shared embedding, the decoder's output scaled by d_model**-0.5 (the original
    T5); else it is lm_head, unscaled (v1.1). transformers' T5Config keeps this as scale_decoder_outputs, set from
    tie_word_embeddings (which it then sets true whatever it was)."""
    return getattr(config, "scale_decoder_outputs", config.tie_word_embeddings)


def decoder_start_id(config) -> int:
    """The token the decoder starts from: config.decoder_start_token_id where it is set, else pad (0), as T5's."""
    start = getattr(config, "decoder_start_token_id", None)
    return config.pad_token_id if start is None else start


def probe_length(config) -> int:
    """The length of the rows that compare an edited copy of this module with transformers' class
    (flax_lm.models.model_code): one past the longest distance the position buckets tell apart, so that every bucket
    of both directions takes part."""
    return config.relative_attention_max_distance + 1


def shift_right(labels, decoder_start_token_id: int, pad_token_id: int = 0):
    """The decoder's input for `labels` (batch, target length): the start token, then the labels but the last, the
    ignored ones (-100) as padding; as transformers' T5 makes it."""
    shifted = jnp.concatenate([jnp.full_like(labels[:, :1], decoder_start_token_id), labels[:, :-1]], axis=1)
    return jnp.where(shifted == -100, pad_token_id, shifted)


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """The bucket (int32, same shape) of each distance key position - query position, as Mesh TensorFlow's T5 (and
    transformers') puts them: half the buckets for each direction when bidirectional (the decoder sees only the
    past), in each half exact buckets for the nearest half of them, logarithmically wider ones up to `max_distance`,
    and the last bucket for all farther."""
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    # In float32, as transformers computes it, so that a distance at a bucket's edge falls in the same bucket.
    scaled = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large)


@jax.custom_vjp
def add_position_bias(scores, bias):
    """scores (batch, heads, queries, keys) + bias (1, heads, queries, keys), float32. The bias's gradient, the
    scores' gradient summed over the batch, is taken as a product with a vector of ones: the sum over that leading
    axis that the broadcast's own gradient makes took XLA:CPU 60 times as long (5% of a small T5's train step)."""
    return scores + bias


def _add_position_bias_forward(scores, bias):
    return scores + bias, None


def _add_position_bias_backward(_, gradient):
    ones = jnp.ones(gradient.shape[:1], gradient.dtype)
    bias_gradient = jnp.einsum("b,bhqk->hqk", ones, gradient, precision=jax.lax.Precision.HIGHEST)
    return gradient, bias_gradient[None]


add_position_bias.defvjp(_add_position_bias_forward, _add_position_bias_backward)

# Dropout keeps a value where a 16-bit random number is below round(keep probability x 2**16): two numbers from each
# 32 random bits, half the hashing of jax.random.bernoulli's one float from 32 bits (a small T5's train step on a CPU
# takes 4% less time). The kept values are scaled by the probability that threshold gives (0.9 -> 58982 / 65536).
DROPOUT_LEVELS = 2**16


def keep_mask(key, keep_probability: float, shape: tuple) -> tuple[jax.Array, float]:
    """A bool mask of `shape`, each value True with probability about `keep_probability`, and that probability."""
    threshold = round(keep_probability * DROPOUT_LEVELS)
    *leading, last = shape
    bits = jax.random.bits(key, (*leading, (last + 1) // 2), jnp.uint32)
    low, high = bits & (DROPOUT_LEVELS - 1), bits >> 16
    keep = jnp.concatenate([low < threshold, high < threshold], axis=-1)[..., :last]
    return keep, threshold / DROPOUT_LEVELS


class DecoderCache(flax.struct.PyTreeNode):
    """What decoding carries from one token to the next: each decoder layer's self-attention keys and values of the
    target tokens so far, and its cross-attention keys and values of the encoder's output (computed once)."""

    keys: tuple  # one (batch, max target length, heads, d_kv) array per decoder layer
    values: tuple
    cross_keys: tuple  # one (batch, source length, heads, d_kv) array per decoder layer
    cross_values: tuple
    encoder_mask: jax.Array  # (batch, source length) bool: a source token, not padding
    index: jax.Array  # int32: the target position the next token is written to


class T5Part(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored in,
    and layers whose parameters carry logical axis names, so that a mesh can shard them."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each block in the backward pass
    mesh: jax.sharding.Mesh | None = None

    def constrain(self, x, logical_axes: tuple):
        return constrain(x, self.mesh, logical_axes)

    def dense(self, features: int, names: tuple, fan_in: int) -> RowsDense:
        """An nn.Linear without bias, drawn as transformers draws T5's: N(0, initializer_factor / sqrt(fan_in)); named
        by the attribute setup assigns it to."""
        std = self.config.initializer_factor * fan_in**-0.5
        return RowsDense(
            features,
            use_bias=False,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(std), names),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )

    def rms_norm(self) -> RMSNorm:
        """T5LayerNorm: RMS normalization times a weight, without bias or mean."""
        return RMSNorm(self.config.layer_norm_epsilon, self.dtype, self.param_dtype)

    def dropout(self, x, deterministic: bool):
        """Dropout at config.dropout_rate, drawn from the "dropout" rng (written out: the parts are built in setup,
        where no nn.Dropout can be made on the fly)."""
        rate = self.config.dropout_rate
        if deterministic or rate == 0:
            return x
        keep, kept_probability = keep_mask(self.make_rng("dropout"), 1 - rate, x.shape)
        return jnp.where(keep, x / kept_probability, 0).astype(x.dtype)


class T5Attention(T5Part):
    """Multi-head attention without scaling of the scores, to which the position bias (1, heads, queries, keys), if
    any, is added; `relative_bias` (the first block's self-attention) holds the relative_attention_bias table, whose
    biases every block uses."""

    relative_bias: bool = False
    bidirectional: bool = True

    def setup(self):
        config = self.config
        inner, width = config.num_heads * config.d_kv, config.d_model
        self.q = self.dense(inner, ("embed", "heads"), width * config.d_kv)
        self.k = self.dense(inner, ("embed", "heads"), width)
        self.v = self.dense(inner, ("embed", "heads"), width)
        self.o = self.dense(width, ("heads", "embed"), inner)
        if self.relative_bias:
            init = nn.initializers.normal(config.initializer_factor * width**-0.5)
            self.relative_attention_bias = nn.Embed(
                config.relative_attention_num_buckets,
                config.num_heads,
                embedding_init=nn.with_logical_partitioning(init, (None, "heads")),
                dtype=jnp.float32,
                param_dtype=self.param_dtype,
            )

    def heads(self, x, projection):
        y = projection(x)
        y = y.reshape(*x.shape[:2], self.config.num_heads, self.config.d_kv)
        return self.constrain(y, ("batch", None, "heads", None))

    def key_values(self, source):
        """The keys and values of `source` (batch, length, d_model), each (batch, length, heads, d_kv)."""
        return self.heads(source, self.k), self.heads(source, self.v)

    def position_bias(self, query_positions, key_length: int):
        """(1, heads, queries, keys) float32: the learned bias of each query position (queries,) over key positions
        0, 1, ..., key_length - 1."""
        config = self.config
        relative = jnp.arange(key_length)[None, :] - query_positions[:, None]
        buckets = relative_position_bucket(
            relative, self.bidirectional, config.relative_attention_num_buckets, config.relative_attention_max_distance
        )
        return jnp.transpose(self.relative_attention_bias(buckets), (2, 0, 1))[None]

    def __call__(self, x, keys, values, bias, visible, deterministic: bool):
        """x (batch, queries, d_model) attends to keys, values (batch, keys, heads, d_kv) where `visible` (batch,
        queries or 1, keys) allows; `bias` None (cross-attention) or the position bias."""
        query = self.heads(x, self.q)
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, keys, preferred_element_type=jnp.float32)
        if bias is not None:
            scores = add_position_bias(scores, bias)
        scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)
        weights = self.dropout(jax.nn.softmax(scores, axis=-1), deterministic)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(values.dtype), values)
        y = self.o(y.reshape(*x.shape[:2], -1))
        return self.constrain(y, ("batch", "length", None))


class T5LayerFF(T5Part):
    """x + wo(act(wi(norm(x)))), or with a gate: x + wo(act(wi_0(norm(x))) * wi_1(norm(x)))."""

    def setup(self):
        self.layer_norm = self.rms_norm()
        self.DenseReluDense = T5DenseActDense(self.config, self.dtype, self.param_dtype, mesh=self.mesh)

    def __call__(self, x, deterministic: bool):
        y = self.DenseReluDense(self.layer_norm(x), deterministic)
        return x + self.dropout(y, deterministic)


class T5DenseActDense(T5Part):
    """The MLP, named as the checkpoint names it whatever its activation: wi (or the gate wi_0 and wi_1), then wo."""

    def setup(self):
        config = self.config
        activation, self.gated = FEED_FORWARD[config.feed_forward_proj]
        self.activation = ACTIVATIONS[activation]
        if self.gated:
            self.wi_0 = self.dense(config.d_ff, ("embed", "mlp"), config.d_model)
            self.wi_1 = self.dense(config.d_ff, ("embed", "mlp"), config.d_model)
        else:
            self.wi = self.dense(config.d_ff, ("embed", "mlp"), config.d_model)
        self.wo = self.dense(config.d_model, ("mlp", "embed"), config.d_ff)

    def __call__(self, x, deterministic: bool):
        if self.gated:
            hidden = self.activation(self.wi_0(x)) * self.wi_1(x)
        else:
            hidden = self.activation(self.wi(x))
        hidden = self.dropout(self.constrain(hidden, ("batch", None, "mlp")), deterministic)
        return self.constrain(self.wo(hidden), ("batch", "length", None))


class T5LayerSelfAttention(T5Part):
    """A block's layer.0: its norm and self-attention, which T5Block calls apart (a decoder's keys and values go
    through its cache)."""

    relative_bias: bool = False
    bidirectional: bool = True

    def setup(self):
        self.layer_norm = self.rms_norm()
        self.SelfAttention = T5Attention(
            self.config, self.dtype, self.param_dtype, mesh=self.mesh, relative_bias=self.relative_bias,
            bidirectional=self.bidirectional,
        )  # fmt: skip


class T5LayerCrossAttention(T5Part):
    """A decoder block's layer.1: its norm and its attention over the encoder's output (keys and values made once)."""

    def setup(self):
        self.layer_norm = self.rms_norm()
        self.EncDecAttention = T5Attention(self.config, self.dtype, self.param_dtype, mesh=self.mesh)


class T5Block(T5Part):
    """An encoder block (self-attention, MLP) or a decoder block (causal self-attention, cross-attention, MLP), each
    sublayer x + dropout(sublayer(norm(x)))."""

    is_decoder: bool = False
    first: bool = False

    def setup(self):
        parts = (self.config, self.dtype, self.param_dtype, None, self.mesh)
        # A list attribute names its modules layer_0, layer_1, ...: the checkpoint's layer.0, layer.1, ...
        layers = [T5LayerSelfAttention(*parts, relative_bias=self.first, bidirectional=not self.is_decoder)]
        if self.is_decoder:
            layers.append(T5LayerCrossAttention(*parts))
        self.layer = [*layers, T5LayerFF(*parts)]

    def __call__(self, x, bias, visible, cross, deterministic: bool, cache_slot=None):
        """`cross`: None (an encoder block) or (keys, values, visible) of the encoder's output. With
        `cache_slot` ((keys, values) of this layer's cache, and the index to write x's at), x is the tokens that
        follow the cached ones; returns (x, the layer's (keys, values) or None)."""
        self_attention = self.layer[0]
        normalized = self_attention.layer_norm(x)
        keys, values = self_attention.SelfAttention.key_values(normalized)
        layer_cache = None
        if cache_slot is not None:
            (cached_keys, cached_values), index = cache_slot
            keys = jax.lax.dynamic_update_slice_in_dim(cached_keys, keys.astype(cached_keys.dtype), index, axis=1)
            values = jax.lax.dynamic_update_slice_in_dim(cached_values, values.astype(cached_keys.dtype), index, 1)
            layer_cache = (keys, values)
        y = self_attention.SelfAttention(normalized, keys, values, bias, visible, deterministic)
        x = x + self.dropout(y, deterministic)
        if cross is not None:
            cross_keys, cross_values, cross_visible = cross
            cross_attention = self.layer[1]
            normalized = cross_attention.layer_norm(x)
            no_position_bias = None  # T5's cross-attention has none
            y = cross_attention.EncDecAttention(
                normalized, cross_keys, cross_values, no_position_bias, cross_visible, deterministic
            )
            x = x + self.dropout(y, deterministic)
        return self.layer[-1](x, deterministic), layer_cache

    def cross_key_values(self, encoder_output):
        return self.layer[1].EncDecAttention.key_values(encoder_output)

    def position_bias(self, query_positions, key_length: int):
        return self.layer[0].SelfAttention.position_bias(query_positions, key_length)


class T5Stack(T5Part):
    """The encoder or the decoder: the blocks, the first of which holds the relative position biases, and the final
    norm. The token embedding is the model's, shared by both."""

    is_decoder: bool = False

    def setup(self):
        config = self.config
        count = config.num_decoder_layers if self.is_decoder else config.num_layers
        block = T5Block
        if self.remat_policy:
            # Argument 5 (deterministic) is a Python bool that selects code, not an array.
            block = nn.remat(T5Block, policy=getattr(jax.checkpoint_policies, self.remat_policy), static_argnums=(5,))
        parts = (config, self.dtype, self.param_dtype, None, self.mesh)
        # The checkpoint's block.0, block.1, ...
        self.block = [block(*parts, is_decoder=self.is_decoder, first=index == 0) for index in range(count)]
        self.final_layer_norm = self.rms_norm()

    def __call__(self, x, visible, query_positions, deterministic: bool, cross_sources=None, cache=None):
        """x (batch, length, d_model) embedded tokens at `query_positions` (length,); `visible` (batch, length,
        keys). A decoder's `cross_sources`: per layer (keys, values) of the encoder's output, and its mask (batch,
        source length). Returns (the stack's output, the layers' new self-attention (keys, values) with `cache`)."""
        x = self.constrain(self.dropout(x, deterministic), ("batch", "length", None))
        key_length = visible.shape[-1]
        bias = self.block[0].position_bias(query_positions, key_length)
        caches = []
        for index, block in enumerate(self.block):
            cross = None
            if cross_sources is not None:
                layer_sources, encoder_mask = cross_sources
                cross = (*layer_sources[index], encoder_mask[:, None, :])
            cache_slot = None if cache is None else ((cache.keys[index], cache.values[index]), cache.index)
            x, layer_cache = block(x, bias, visible, cross, deterministic, cache_slot)
            caches.append(layer_cache)
        return self.dropout(self.final_layer_norm(x), deterministic), caches

    def cross_key_values(self, encoder_output) -> tuple:
        return tuple(block.cross_key_values(encoder_output) for block in self.block)


class FlaxT5ForConditionalGeneration(T5Part):
    """T5 with its language-model head; see the module's docstring for the calls."""

    def setup(self):
        config = self.config
        check_model_config(config)
        init = nn.initializers.normal(config.initializer_factor)
        self.shared = nn.Embed(
            config.vocab_size,
            config.d_model,
            embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        parts = (config, self.dtype, self.param_dtype, self.remat_policy, self.mesh)
        self.encoder = T5Stack(*parts, is_decoder=False)
        self.decoder = T5Stack(*parts, is_decoder=True)
        if not scales_output(config):
            self.lm_head = RowsDense(
                config.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(config.initializer_factor), ("embed", "vocab")
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=logits_dot_general,
            )

    @property
    def decoder_start_token_id(self) -> int:
        """The token the decoder starts from (decoder_start_id), for the decoding loop."""
        return decoder_start_id(self.config)

    def embed(self, ids):
        return look_up(self.shared, "vocab", self.constrain(ids, ("batch", None)), self.mesh, self.dtype)

    def encode(self, input_ids, attention_mask=None, deterministic: bool = True):
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        visible = attention_mask.astype(bool)[:, None, :]  # (batch, 1, keys)
        positions = jnp.arange(input_ids.shape[1])
        output, _ = self.encoder(self.embed(input_ids), visible, positions, deterministic)
        return output

    def logits(self, hidden):
        if scales_output(self.config):
            hidden = hidden * jnp.asarray(self.config.d_model**-0.5, self.dtype)
            logits = tied_logits(hidden, self.shared.embedding.astype(self.dtype))
        else:
            logits = self.lm_head(hidden)
        return self.constrain(logits.astype(jnp.float32), ("batch", None, "vocab"))

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        deterministic: bool = True,
    ):
        if decoder_input_ids is None:  # init from one array of ids, as the tools make the parameters' shapes
            decoder_input_ids = input_ids
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        encoder_output = self.encode(input_ids, attention_mask, deterministic)
        length = decoder_input_ids.shape[1]
        positions = jnp.arange(length)
        visible = (positions[None, :, None] >= positions[None, None, :]).astype(bool)  # (1, queries, keys): causal
        if decoder_attention_mask is not None:
            visible = visible & decoder_attention_mask.astype(bool)[:, None, :]
        cross_sources = (self.decoder.cross_key_values(encoder_output), attention_mask.astype(bool))
        hidden, _ = self.decoder(self.embed(decoder_input_ids), visible, positions, deterministic, cross_sources)
        return self.logits(hidden)

    def start_decoding(self, encoder_output, attention_mask, max_target_length: int) -> DecoderCache:
        config = self.config
        batch = encoder_output.shape[0]
        empty = tuple(
            jnp.zeros((batch, max_target_length, config.num_heads, config.d_kv), self.dtype)
            for _ in range(config.num_decoder_layers)
        )
        cross_keys, cross_values = zip(*self.decoder.cross_key_values(encoder_output))
        if attention_mask is None:
            attention_mask = jnp.ones(encoder_output.shape[:2], bool)
        return DecoderCache(
            keys=empty,
            values=empty,
            cross_keys=cross_keys,
            cross_values=cross_values,
            encoder_mask=attention_mask.astype(bool),
            index=jnp.zeros((), jnp.int32),
        )

    def decode(self, decoder_input_ids, cache: DecoderCache):
        new = decoder_input_ids.shape[1]
        slots = cache.keys[0].shape[1]
        positions = cache.index + jnp.arange(new)
        visible = (positions[:, None] >= jnp.arange(slots)[None, :])[None]  # (1, new, slots): the tokens so far
        cross_sources = (tuple(zip(cache.cross_keys, cache.cross_values)), cache.encoder_mask)
        hidden, caches = self.decoder(self.embed(decoder_input_ids), visible, positions, True, cross_sources, cache)
        keys, values = zip(*caches)
        return self.logits(hidden), cache.replace(keys=keys, values=values, index=cache.index + new)


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh).
MODEL_CLASS = FlaxT5ForConditionalGeneration


def hf_name(flax_path: tuple) -> str:
    """('encoder', 'block_0', 'layer_1', 'DenseReluDense', 'wi_0', 'kernel') ->
    'encoder.block.0.layer.1.DenseReluDense.wi_0.weight'."""
    *modules, leaf = flax_path
    modules = [
        module.replace("_", ".", 1) if module.startswith(("block_", "layer_")) and module[6:].isdigit() else module
        for module in modules
    ]
    return ".".join([*modules, "weight" if leaf in ("kernel", "embedding", "weight") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """The Flax parameters as T5ForConditionalGeneration's state dict (float32 numpy, its names and layouts), as
    save_pretrained writes it: the embedding once, as shared.weight (the encoder's and decoder's embed_tokens are
    it), and lm_head.weight where the output layer is its own."""
    return state_dict_of(params, hf_name)


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone."""
    return shapes_of(params, hf_name)


# What a checkpoint may hold beside the parameters: the stacks' views of shared.weight, and the cross-attention bias
# table that old transformers versions saved in the decoder's first block and never used.
IGNORED_HF_TENSORS = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init), in their dtypes
    and placed as they are laid out. A v1.1 model saved by transformers with its head tied to the embedding (a new
    one: transformers ties until a checkpoint's lm_head differs) has no lm_head.weight: the embedding is the head."""
    params, unused = params_of(state_dict, abstract_params, hf_name, stand_ins={"lm_head.weight": "shared.weight"})
    unexpected = [name for name in unused if name not in IGNORED_HF_TENSORS]
    if unexpected and not (unexpected == ["lm_head.weight"] and scales_output_from(abstract_params)):
        raise UsageError(
            f"checkpoint tensor {unexpected[0]} is not part of T5ForConditionalGeneration with this config; pass the "
            "config the checkpoint was trained with"
        )
    return params


def scales_output_from(params) -> bool:
    """Whether the model of `params` has no lm_head of its own (the original T5), whose checkpoint may still carry
    a copy of the embedding as lm_head.weight."""
    return "lm_head" not in params


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a T5ForConditionalGeneration of `config` (one check_model_config
    accepts) as save_pretrained writes them: shared.weight once, lm_head.weight where the head is its own. From the
    config alone, so that it holds whatever is done to the Flax model."""
    width, inner, heads = config.d_model, config.num_heads * config.d_kv, config.num_heads
    _, gated = FEED_FORWARD[config.feed_forward_proj]

    def linear(name: str, fan_in: int, fan_out: int) -> dict:
        return {f"{name}.weight": (fan_out, fan_in)}

    def attention(name: str, first: bool) -> dict:
        shapes = {}
        for projection in ("q", "k", "v"):
            shapes |= linear(f"{name}.{projection}", width, inner)
        shapes |= linear(f"{name}.o", inner, width)
        if first:
            shapes[f"{name}.relative_attention_bias.weight"] = (config.relative_attention_num_buckets, heads)
        return shapes

    def feed_forward(name: str) -> dict:
        shapes = {f"{name}.layer_norm.weight": (width,)}
        for wi in ("wi_0", "wi_1") if gated else ("wi",):
            shapes |= linear(f"{name}.DenseReluDense.{wi}", width, config.d_ff)
        return shapes | linear(f"{name}.DenseReluDense.wo", config.d_ff, width)

    shapes = {"shared.weight": (config.vocab_size, width)}
    for stack, count in (("encoder", config.num_layers), ("decoder", config.num_decoder_layers)):
        for index in range(count):
            block = f"{stack}.block.{index}"
            shapes |= attention(f"{block}.layer.0.SelfAttention", index == 0)
            shapes[f"{block}.layer.0.layer_norm.weight"] = (width,)
            if stack == "decoder":
                shapes |= attention(f"{block}.layer.1.EncDecAttention", False)
                shapes[f"{block}.layer.1.layer_norm.weight"] = (width,)
            shapes |= feed_forward(f"{block}.layer.{2 if stack == 'decoder' else 1}")
        shapes[f"{stack}.final_layer_norm.weight"] = (width,)
    if not scales_output(config):
        shapes["lm_head.weight"] = (config.vocab_size, width)
    return shapes
