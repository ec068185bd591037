"""What the LayerNorm decoders (gptj/, gpt_neox/, opt/) build their own layers and stacks from: LayerNorm, dropout
where the config sets it (which the RMSNorm decoders of common.py do not have), causal attention with dropout on its
weights or over the key/value cache, the token embedding, the layers of a stack (recomputed in the backward pass
under the remat policy) run in turn with the cache gathered from them, the tokens' positions, and the output layer.
What sets each family apart (its rotation, its residuals, OPT's positions and projections) stays in its model.py, as
do the names of its modules, which are its checkpoint's."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_lm.models.shared.common import (
    DecoderPart,
    KeyValueCache,
    RowsDense,
    causal_attention,
    logits_dot_general,
    segments_and_positions,
    tied_logits,
)


class LayerNormPart(DecoderPart):
    """Base of the LayerNorm decoders' parts: DecoderPart's, with LayerNorm, dropout and what their stacks share."""

    def layer_norm(self, name: str | None, epsilon: float, affine: bool = True) -> nn.LayerNorm:
        """torch.nn.LayerNorm; without a weight and a bias where not `affine` (OPT's layer_norm_elementwise_affine)."""
        return nn.LayerNorm(
            epsilon=epsilon,
            use_scale=affine,
            use_bias=affine,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def dropout(self, x, rate: float, deterministic: bool):
        """x with dropout at `rate` when training (not `deterministic`), from a compact method: it makes an nn.Dropout
        there (a stack made in setup holds one of its own instead)."""
        return x if deterministic or not rate else nn.Dropout(rate, deterministic=False)(x)

    def attend_with_dropout(self, query, key, value, scale: float, rate: float, deterministic: bool, cache,
                            layer_index: int, segment_ids):  # fmt: skip
        """(output (batch, length, heads * head_dim), the layer's new (keys, values) when decoding with `cache`, else
        None), as DecoderPart.attend; when training without a cache, dropout at `rate` on the attention weights."""
        if cache is not None or deterministic or not rate:
            return self.attend(query, key, value, scale, cache, layer_index, segment_ids)
        y = causal_attention(query, key, value, scale, nn.Dropout(rate, deterministic=False), segment_ids)
        return y.reshape(*y.shape[:2], -1), None

    def embedding(self, rows: int, width: int, std: float, names: tuple = ("vocab", "embed")) -> nn.Embed:
        """A table of `rows` embeddings of `width`, drawn from N(0, std)."""
        init = nn.with_logical_partitioning(nn.initializers.normal(std), names)
        return nn.Embed(rows, width, embedding_init=init, dtype=self.dtype, param_dtype=self.param_dtype)

    def stacked_layers(self, layer_class, count: int, deterministic_argnum: int) -> list:
        """`count` layers of `layer_class`, numbered by their layer_index, for setup to assign to a list attribute
        (which names them NAME_0, NAME_1, ...: the checkpoint's NAME.0, NAME.1, ...). Under the remat policy each is
        recomputed in the backward pass; argument `deterministic_argnum` of its call (self is 0), a Python bool that
        selects code rather than an array, stays static."""
        if self.remat_policy:
            policy = getattr(jax.checkpoint_policies, self.remat_policy)
            layer_class = nn.remat(layer_class, policy=policy, static_argnums=(deterministic_argnum,))
        return [self.child(layer_class, None, layer_index=index) for index in range(count)]

    def output_logits(self, hidden, embedding: nn.Embed, std: float, use_bias: bool = False):
        """float32 logits (batch, length, vocab_size) of `hidden`: the token `embedding` transposed where the config
        ties them, else an output layer of its own (lm_head, drawn from N(0, std); its parameters' name keeps it with
        AdamW under --optim muon), with a bias where `use_bias`."""
        config = self.config
        if config.tie_word_embeddings:
            logits = tied_logits(hidden, embedding.embedding.astype(self.dtype))
        else:
            logits = RowsDense(
                config.vocab_size,
                use_bias=use_bias,
                kernel_init=nn.with_logical_partitioning(nn.initializers.normal(std), ("embed", "vocab")),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=logits_dot_general,
                name="lm_head",
            )(hidden)
        return self.constrain(logits, ("batch", None, "vocab")).astype(jnp.float32)


def token_positions(input_ids, cache: KeyValueCache | None, separator_id):
    """(positions (batch, length), segment ids or None) of the tokens: counted in the cache's rows when decoding, from
    each document's start with `separator_id`, else from the row's start."""
    if cache is not None:
        return cache.positions(input_ids.shape[1]), None
    if separator_id is not None:
        segment_ids, positions = segments_and_positions(input_ids, separator_id)
        return positions, segment_ids
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1])[None, :], input_ids.shape), None


def run_layers(layers: list, x, cache: KeyValueCache | None, *arguments):
    """(x through `layers` in turn, each called (x, *arguments) -> (x, its new (keys, values) when decoding, else
    None); `cache` with every layer's new keys and values, advanced past x's positions, or None without one)."""
    layer_caches = []
    for layer in layers:
        x, layer_cache = layer(x, *arguments)
        layer_caches.append(layer_cache)
    if cache is not None:
        keys, values = zip(*layer_caches)
        cache = cache.replace(keys=keys, values=values, index=cache.index + x.shape[1])
    return x, cache
