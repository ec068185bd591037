#!/usr/bin/env python3
"""Pretrain a RoBERTa masked language model with JAX/Flax, from scratch or from an existing checkpoint.
The model is a Flax (linen) RoBERTa whose parameters map one-to-one onto the PyTorch `RobertaForMaskedLM`
of `transformers`, so the `model.safetensors` this script writes loads with
`AutoModelForMaskedLM.from_pretrained` and a RoBERTa checkpoint from the Hugging Face Hub can be loaded
here to continue pretraining. Inputs are masked on the host with numpy: of the chosen tokens, 80% become
the mask token, 10% a random token and 10% stay as they are.
"""

import logging
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from flax import traverse_util

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """A mistake in the user's arguments or files; reported as one line, without a traceback."""


# ----------------------------------------------------------------------------------------------------
# Model: RoBERTa in Flax, parameter names one-to-one with the Hugging Face checkpoint
# ----------------------------------------------------------------------------------------------------

# Copied from run_clm_flax.ACTIVATIONS
ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def check_model_config(config):
    """Raise UsageError if `config` asks for a RoBERTa variant this model does not implement."""
    if config.is_decoder or config.add_cross_attention:
        raise UsageError("the config makes RoBERTa a decoder (is_decoder or add_cross_attention); "
                         "masked language modelling needs an encoder, so set both to false")
    position_embedding_type = getattr(config, "position_embedding_type", "absolute")
    if position_embedding_type != "absolute":
        raise UsageError(f"position_embedding_type {position_embedding_type!r} in the config is not supported; "
                         "only 'absolute' is")
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACTIVATIONS:
        raise UsageError(f"hidden_act {config.hidden_act!r} in the config is not supported; "
                         f"use one of {', '.join(ACTIVATIONS)}")
    if config.hidden_size % config.num_attention_heads != 0:
        raise UsageError(f"hidden_size {config.hidden_size} in the config is not a multiple of "
                         f"num_attention_heads {config.num_attention_heads}")
    if config.pad_token_id is None:
        raise UsageError("the config has no pad_token_id; RoBERTa needs one to number the positions")
    if not config.tie_word_embeddings:
        raise UsageError("tie_word_embeddings is false in the config; this model always shares the "
                         "output projection with the word embeddings")


def embedding_init(stddev, padding_idx):
    """Normal initializer that leaves the padding row at zero, as PyTorch's nn.Embedding(padding_idx=...) does."""
    def init(key, shape, dtype=jnp.float32):
        table = jax.random.normal(key, shape, dtype) * stddev
        return table.at[padding_idx].set(0)
    return init


class RobertaModule(nn.Module):
    """Base of every part of the model: the config, the two dtypes and factories for its layers.

    `dtype` is the dtype of the computation (e.g. bfloat16), `param_dtype` the dtype the parameters are
    stored in. Every parameter gets logical axis names so that a mesh can shard it later.
    """
    config: transformers.RobertaConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def dense(self, features, kernel_axes, bias_axes, name):
        kernel_init = nn.initializers.normal(self.config.initializer_range)
        return nn.Dense(
            features, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            kernel_init=nn.with_logical_partitioning(kernel_init, kernel_axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), bias_axes),
        )

    def layer_norm(self, name):
        return nn.LayerNorm(
            epsilon=self.config.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        )

    def embed(self, num_embeddings, axes, padding_idx=None, name=None):
        stddev = self.config.initializer_range
        init = nn.initializers.normal(stddev) if padding_idx is None else embedding_init(stddev, padding_idx)
        return nn.Embed(num_embeddings, self.config.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                        embedding_init=nn.with_logical_partitioning(init, axes), name=name)

    def child(self, module_class, name):
        """A submodule that shares this module's config and dtypes."""
        return module_class(self.config, self.dtype, self.param_dtype, name=name)


class RobertaEmbeddings(RobertaModule):
    """Word + position + token type embeddings, then LayerNorm and dropout."""

    def setup(self):
        config = self.config
        self.word_embeddings = self.embed(config.vocab_size, ("vocab", "embed"), config.pad_token_id)
        self.position_embeddings = self.embed(config.max_position_embeddings, ("positions", "embed"),
                                              config.pad_token_id)
        self.token_type_embeddings = self.embed(config.type_vocab_size, (None, "embed"))
        self.LayerNorm = self.layer_norm("LayerNorm")
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def __call__(self, input_ids, token_type_ids, deterministic):
        # RoBERTa (after fairseq) numbers real tokens pad+1, pad+2, ... and gives padding the position
        # pad itself, so a sequence of length L needs max_position_embeddings >= L + pad + 1.
        pad = self.config.pad_token_id
        is_token = (input_ids != pad).astype(jnp.int32)
        position_ids = jnp.cumsum(is_token, axis=1) * is_token + pad
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))  # (batch, seq, hidden)
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)


def attention_with_dropout(query, key, value, mask, dropout):
    """Softmax attention with dropout on the attention probabilities, written out step by step.

    query, key, value: (batch, seq, heads, head_dim); mask: (batch, 1, 1, seq) bool or None;
    dropout: a callable applied to the (batch, heads, seq, seq) probabilities.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(query.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = dropout(jax.nn.softmax(scores, axis=-1)).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


class RobertaSelfAttention(RobertaModule):
    """Multi-head self-attention: the query, key and value projections and the attention itself."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        config = self.config
        num_heads = config.num_attention_heads
        head_dim = config.hidden_size // num_heads
        batch, seq, _ = hidden_states.shape

        def project(name):
            x = self.dense(config.hidden_size, ("embed", "heads"), ("heads",), name)(hidden_states)
            return x.reshape(batch, seq, num_heads, head_dim)

        query, key, value = project("query"), project("key"), project("value")
        if not deterministic and config.attention_probs_dropout_prob > 0:
            # jax.nn.dot_product_attention cannot drop attention probabilities, so training with
            # attention dropout takes the explicit path; evaluation and dropout-free training use the
            # library function, the place where JAX plugs in fused attention kernels.
            dropout = partial(nn.Dropout(config.attention_probs_dropout_prob), deterministic=False)
            out = attention_with_dropout(query, key, value, mask, dropout)
        else:
            # Softmax runs in float32 inside, whatever the dtype of query and key.
            out = jax.nn.dot_product_attention(query, key, value, mask=mask)
        return out.reshape(batch, seq, config.hidden_size)


class RobertaResidualOutput(RobertaModule):
    """Dense, dropout, then LayerNorm of the residual sum; ends both the attention and the MLP."""

    @nn.compact
    def __call__(self, hidden_states, residual, deterministic, kernel_axes):
        x = self.dense(self.config.hidden_size, kernel_axes, ("embed",), "dense")(hidden_states)
        x = nn.Dropout(self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        return self.layer_norm("LayerNorm")(x + residual)


class RobertaAttention(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        attended = self.child(RobertaSelfAttention, "self")(hidden_states, mask, deterministic)
        return self.child(RobertaResidualOutput, "output")(attended, hidden_states, deterministic,
                                                           kernel_axes=("heads", "embed"))


class RobertaIntermediate(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states):
        x = self.dense(self.config.intermediate_size, ("embed", "mlp"), ("mlp",), "dense")(hidden_states)
        return ACTIVATIONS[self.config.hidden_act](x)  # (batch, seq, intermediate)


class RobertaLayer(RobertaModule):
    """One post-LayerNorm transformer block: attention, then the MLP, each followed by residual + LayerNorm."""

    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        x = self.child(RobertaAttention, "attention")(hidden_states, mask, deterministic)
        h = self.child(RobertaIntermediate, "intermediate")(x)
        return self.child(RobertaResidualOutput, "output")(h, x, deterministic, kernel_axes=("mlp", "embed"))


class RobertaEncoder(RobertaModule):
    @nn.compact
    def __call__(self, hidden_states, mask, deterministic):
        for i in range(self.config.num_hidden_layers):
            hidden_states = self.child(RobertaLayer, f"layer_{i}")(hidden_states, mask, deterministic)
        return hidden_states


class RobertaModel(RobertaModule):
    """Embeddings and encoder, without a head: returns hidden states (batch, seq, hidden)."""

    def setup(self):
        self.embeddings = self.child(RobertaEmbeddings, "embeddings")
        self.encoder = self.child(RobertaEncoder, "encoder")

    def __call__(self, input_ids, attention_mask, token_type_ids, deterministic):
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].astype(bool)  # (batch, 1, 1, seq): True = may attend
        x = self.embeddings(input_ids, token_type_ids, deterministic)
        return self.encoder(x, mask, deterministic)


class RobertaLMHead(RobertaModule):
    """Dense + GELU + LayerNorm, then scores against the (shared) word embeddings plus a bias."""

    @nn.compact
    def __call__(self, hidden_states, word_embeddings):
        x = self.dense(self.config.hidden_size, ("embed", None), ("embed",), "dense")(hidden_states)
        x = self.layer_norm("layer_norm")(ACTIVATIONS["gelu"](x))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                          (self.config.vocab_size,), self.param_dtype)
        # Accumulate in float32 so that bfloat16 compute still gives float32 logits for the loss.
        logits = jnp.einsum("bsh,vh->bsv", x, word_embeddings.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return logits + bias.astype(jnp.float32)  # (batch, seq, vocab)


class FlaxRobertaForMaskedLM(RobertaModule):
    """RoBERTa encoder with its masked-language-modelling head; returns float32 logits (batch, seq, vocab).

    The parameter tree mirrors the PyTorch names of `transformers.RobertaForMaskedLM`
    (see `hf_name`): e.g. params["roberta"]["encoder"]["layer_0"]["attention"]["self"]["query"]["kernel"]
    is `roberta.encoder.layer.0.attention.self.query.weight`, transposed.
    """

    def setup(self):
        check_model_config(self.config)
        self.roberta = self.child(RobertaModel, "roberta")
        self.lm_head = self.child(RobertaLMHead, "lm_head")

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, deterministic: bool = True):
        hidden_states = self.roberta(input_ids, attention_mask, token_type_ids, deterministic)
        # The output projection is the word embedding table itself (tied weights, as in RoBERTa).
        word_embeddings = self.roberta.embeddings.word_embeddings.embedding  # (vocab, hidden)
        return self.lm_head(hidden_states, word_embeddings)


# ----------------------------------------------------------------------------------------------------
# Checkpoint conversion to and from the PyTorch layout of transformers
# ----------------------------------------------------------------------------------------------------

# Tensors a RobertaForMaskedLM checkpoint may hold that this model does not need: the decoder weight and
# bias are tied to the word embeddings and lm_head.bias (save_pretrained leaves them out), the pooler
# belongs to RobertaModel, and older checkpoints saved the constant position_ids/token_type_ids buffers.
IGNORED_HF_TENSORS = ("lm_head.decoder.weight", "lm_head.decoder.bias", "roberta.embeddings.position_ids",
                      "roberta.embeddings.token_type_ids")
IGNORED_HF_PREFIXES = ("roberta.pooler.",)


def hf_name(path):
    """PyTorch name of the Flax parameter at `path`, e.g. ("roberta", "encoder", "layer_0", ..., "kernel")."""
    *modules, leaf = path
    # "layer_3" is the Flax name of PyTorch's "layer.3"; "layer_norm" stays as it is.
    modules = [f"layer.{m[6:]}" if m.startswith("layer_") and m[6:].isdigit() else m for m in modules]
    leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight"}.get(leaf, leaf)
    return ".".join([*modules, leaf])


def param_shapes(config):
    """{flax path: shape} of the model's parameters in creation order, computed without allocating them."""
    model = FlaxRobertaForMaskedLM(config)
    paths = []

    def init_flat():
        params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
        flat = traverse_util.flatten_dict(params)  # Partitioned boxes are leaves here
        # Recorded here because jax's tree functions (eval_shape, unbox) return dicts with sorted keys.
        paths.extend(flat)
        return [nn.meta.unbox(leaf) for leaf in flat.values()]

    return {path: tuple(leaf.shape) for path, leaf in zip(paths, jax.eval_shape(init_flat))}


def to_hf_state_dict(params, config):
    """Unboxed Flax params -> {PyTorch name: float32 numpy array} for RobertaForMaskedLM's model.safetensors.

    Dense kernels are (in, out) in Flax and (out, in) in PyTorch, so they are transposed. The tied
    lm_head.decoder tensors are left out, as save_pretrained does.
    """
    flat_params = traverse_util.flatten_dict(params)
    state_dict = {}
    for path, shape in param_shapes(config).items():
        array = np.asarray(flat_params[path], dtype=np.float32)
        if array.shape != shape:  # params are built from the config, so this is a bug, not a user's mistake
            raise ValueError(f"parameter {'/'.join(path)} has shape {array.shape}, the config needs {shape}")
        if path[-1] == "kernel":
            array = array.T
        state_dict[hf_name(path)] = np.ascontiguousarray(array)
    return state_dict


def from_hf_state_dict(state_dict, config):
    """{PyTorch name: array} of a RobertaForMaskedLM checkpoint -> unboxed Flax params (float32 numpy).

    Accepts checkpoints with or without the tied lm_head.decoder tensors and the pooler. Raises
    UsageError naming the first tensor that is missing, unexpected or of the wrong shape for `config`.
    """
    check_model_config(config)
    expected = param_shapes(config)
    flat_params = {}
    for path, shape in expected.items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"checkpoint has no tensor {name}; is it a RobertaForMaskedLM checkpoint?")
        array = np.asarray(state_dict[name], dtype=np.float32)
        is_kernel = path[-1] == "kernel"
        needed_shape = shape[::-1] if is_kernel else shape  # in the PyTorch layout
        if array.shape != needed_shape:
            raise UsageError(f"checkpoint tensor {name} has shape {array.shape} but the config needs "
                             f"{needed_shape}; pass the matching --config_name")
        if is_kernel:
            array = array.T
        flat_params[path] = np.ascontiguousarray(array)
    used_names = {hf_name(path) for path in expected}
    for name in state_dict:
        if name not in used_names and name not in IGNORED_HF_TENSORS and not name.startswith(IGNORED_HF_PREFIXES):
            raise UsageError(f"checkpoint tensor {name} is not part of RobertaForMaskedLM with this config; "
                             "pass the matching --config_name")
    return traverse_util.unflatten_dict(flat_params)


# ----------------------------------------------------------------------------------------------------
# Masking (on the host, per batch)
# ----------------------------------------------------------------------------------------------------


def mask_tokens(input_ids, special_tokens_mask, mask_token_id, vocab_size, mlm_probability, rng):
    """Choose positions to predict and corrupt them the BERT way.

    input_ids: (batch, seq) int; special_tokens_mask: (batch, seq) bool, True for special tokens and
    padding, which are never chosen; rng: np.random.Generator, so a seed reproduces the batch.
    Each other position is chosen with probability mlm_probability; of the chosen, 80% become
    mask_token_id, 10% a random id in [0, vocab_size) and 10% stay as they are (so the model cannot
    learn that only masked positions matter).
    Returns (masked input_ids, labels = the original ids, label_weights: float32, 1.0 where chosen).
    """
    shape = input_ids.shape
    chosen = (rng.random(shape) < mlm_probability) & ~special_tokens_mask
    action = rng.random(shape)  # below 0.8: mask, 0.8 to 0.9: random token, above 0.9: keep
    random_ids = rng.integers(0, vocab_size, shape, dtype=input_ids.dtype)
    masked = np.where(chosen & (action < 0.8), mask_token_id, input_ids)
    masked = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, masked).astype(input_ids.dtype)
    return masked, input_ids.copy(), chosen.astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------


def masked_lm_loss_sums(logits, labels, label_weights):
    """Sum of cross-entropy, number of correct predictions and number of counted positions.

    logits: (batch, seq, vocab); labels: (batch, seq) int; label_weights: (batch, seq), 1.0 where the
    position counts. Returns three float32 scalars; summing them over batches and dividing once on the
    host gives exact averages whatever the number of masked positions per batch.
    """
    logits = logits.astype(jnp.float32)
    label_weights = label_weights.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # (batch, seq)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return (loss * label_weights).sum(), (correct * label_weights).sum(), label_weights.sum()
