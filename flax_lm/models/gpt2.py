"""GPT-2 in Flax, with parameter names and layouts one-to-one with the Hugging Face PyTorch checkpoint
(GPT2LMHeadModel), a key/value cache for decoding, and a sampler whose decoding loop is compiled once per shape,
each row of a batch decoded by its own settings."""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.experimental import multihost_utils
from transformers import GPT2Config

from flax_lm.errors import UsageError
from flax_lm.models.common import ACTIVATIONS, attention_implementation, same_segment, segments_and_positions

logger = logging.getLogger(__name__)

# The transformers class whose checkpoint layout the parameters map onto, named in an exported config.json.
HF_ARCHITECTURE = "GPT2LMHeadModel"
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True


def check_model_config(config):
    if config.model_type != "gpt2":
        raise UsageError(
            f"this script trains GPT-2 but the config is of model type '{config.model_type}'; "
            "use a gpt2 config (create_config.py --preset gpt2-tiny) or run_mlm_flax.py for roberta"
        )
    if config.n_embd % config.n_head:
        raise UsageError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}; fix the config")
    if config.activation_function not in ACTIVATIONS:
        raise UsageError(
            f"activation_function '{config.activation_function}' is not supported; use one of {', '.join(ACTIVATIONS)}"
        )
    if getattr(config, "add_cross_attention", False):
        raise UsageError("add_cross_attention is not supported by this script; set it to false in the config")


class KeyValueCache(flax.struct.PyTreeNode):
    """The keys and values of every layer for the tokens decoded so far, so that a new token costs one position.

    Prompts of different lengths are left-padded to a common length: `mask` marks the slots that hold a token
    of the row, and a token's position is the number of such slots before it, so padding changes no row.
    """

    keys: tuple  # one (batch, slots, n_head, head_dim) array per layer
    values: tuple
    mask: jax.Array  # (batch, slots) bool: the slot holds a token of the row, not padding
    index: jax.Array  # int32: the slot the next token is written to

    @classmethod
    def empty(cls, config, prompt_mask, new_tokens: int, dtype):
        """A cache for the prompts of `prompt_mask` (batch, prompt length) followed by `new_tokens` tokens."""
        batch = prompt_mask.shape[0]
        slots = prompt_mask.shape[1] + new_tokens
        shape = (batch, slots, config.n_head, config.n_embd // config.n_head)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layer))
        mask = jnp.concatenate([prompt_mask.astype(bool), jnp.ones((batch, new_tokens), bool)], axis=1)
        return cls(keys=zeros, values=zeros, mask=mask, index=jnp.zeros((), jnp.int32))


class GPT2Module(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them."""

    config: GPT2Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each block in the backward pass

    def child(self, module_class, name: str | None, **fields):
        return module_class(self.config, self.dtype, self.param_dtype, self.remat_policy, name=name, **fields)

    def dense(self, features: int, names: tuple, stddev: float, name: str) -> nn.Dense:
        """Weights drawn from N(0, stddev), zero bias, kernel laid out (in, out) as in the checkpoint's Conv1D."""
        return nn.Dense(
            features,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(stddev), names),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def layer_norm(self, name: str | None) -> nn.LayerNorm:
        return nn.LayerNorm(
            epsilon=self.config.layer_norm_epsilon,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )


class CausalSelfAttention(GPT2Module):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None). With `segment_ids`
        (batch, length), a token attends only to the earlier tokens of its own segment."""
        config = self.config
        batch, length, width = x.shape
        head_dim = width // config.n_head
        residual_stddev = config.initializer_range / math.sqrt(2 * config.n_layer)

        qkv = self.dense(3 * width, ("embed", "heads"), config.initializer_range, "c_attn")(x)
        query, key, value = (t.reshape(batch, length, config.n_head, head_dim) for t in jnp.split(qkv, 3, axis=-1))
        scale = 1 / math.sqrt(head_dim) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= self.layer_index + 1

        layer_cache = None
        if cache is not None:
            y, layer_cache = cached_attention(query, key, value, scale, cache, self.layer_index)
        elif deterministic or config.attn_pdrop == 0:
            if segment_ids is None:
                implementation = attention_implementation(query.dtype)
                y = jax.nn.dot_product_attention(
                    query, key, value, scale=scale, is_causal=True, implementation=implementation
                )
            else:  # XLA's attention: cuDNN's fused kernel is not given a mask here
                same = same_segment(segment_ids)[:, None]
                y = jax.nn.dot_product_attention(query, key, value, mask=same, scale=scale, is_causal=True)
        else:
            # jax.nn.dot_product_attention has no dropout on the attention weights, which GPT-2 trains with.
            dropout = nn.Dropout(config.attn_pdrop, deterministic=False)
            y = attention_with_dropout(query, key, value, scale, dropout, segment_ids)
        y = self.dense(width, ("heads", "embed"), residual_stddev, "c_proj")(y.reshape(batch, length, width))
        return nn.Dropout(config.resid_pdrop)(y, deterministic), layer_cache


def attention_with_dropout(query, key, value, scale, dropout: nn.Dropout, segment_ids=None):
    """Causal attention written out, for training with dropout on the attention weights."""
    # query, key, value: (batch, length, heads, head_dim)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    length = query.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    if segment_ids is not None:
        causal = causal & same_segment(segment_ids)[:, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(jnp.float32).min), axis=-1)
    weights = dropout(weights).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


def cached_attention(query, key, value, scale, cache: KeyValueCache, layer_index: int):
    """Attention of new tokens, written to the cache at `cache.index`, over the cached ones and themselves."""

    # query, key, value: (batch, new, heads, head_dim); the layer's cached keys: (batch, slots, heads, head_dim)
    def write(cached, new_entries):
        return jax.lax.dynamic_update_slice_in_dim(cached, new_entries.astype(cached.dtype), cache.index, axis=1)

    keys, values = write(cache.keys[layer_index], key), write(cache.values[layer_index], value)
    new, slots = query.shape[1], keys.shape[1]
    query_slots = cache.index + jnp.arange(new)
    visible = cache.mask[:, None, :] & (jnp.arange(slots)[None, None, :] <= query_slots[None, :, None])
    # A padding slot's query sees nothing; the softmax then spreads evenly, harmlessly, as nobody reads it.
    y = jax.nn.dot_product_attention(query, keys, values, mask=visible[:, None], scale=scale)
    return y, (keys, values)


class MLP(GPT2Module):
    @nn.compact
    def __call__(self, x, deterministic: bool):
        config = self.config
        inner = config.n_inner or 4 * config.n_embd
        residual_stddev = config.initializer_range / math.sqrt(2 * config.n_layer)
        x = self.dense(inner, ("embed", "mlp"), config.initializer_range, "c_fc")(x)
        x = ACTIVATIONS[config.activation_function](x)
        x = self.dense(config.n_embd, ("mlp", "embed"), residual_stddev, "c_proj")(x)
        return nn.Dropout(config.resid_pdrop)(x, deterministic)


class Block(GPT2Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None, segment_ids=None):
        attention = self.child(CausalSelfAttention, "attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.layer_norm("ln_1")(x), deterministic, cache, segment_ids)
        x = x + y
        x = x + self.child(MLP, "mlp")(self.layer_norm("ln_2")(x), deterministic)
        return x, layer_cache


class GPT2Model(GPT2Module):
    """Embeddings, the blocks and the final LayerNorm; `attend` reuses the token embedding as output layer."""

    def setup(self):
        config = self.config

        def embed(rows: int, names: tuple) -> nn.Embed:
            init = nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), names)
            return nn.Embed(rows, config.n_embd, embedding_init=init, dtype=self.dtype, param_dtype=self.param_dtype)

        self.wte = embed(config.vocab_size, ("vocab", "embed"))
        self.wpe = embed(config.n_positions, ("positions", "embed"))
        self.dropout = nn.Dropout(config.embd_pdrop)
        block = Block
        if self.remat_policy:
            # Argument 2 (deterministic) is a Python bool that selects code, not an array.
            block = nn.remat(Block, policy=getattr(jax.checkpoint_policies, self.remat_policy), static_argnums=(2,))
        # A list attribute names its modules h_0, h_1, ...: the checkpoint's h.0, h.1, ...
        self.h = [self.child(block, None, layer_index=index) for index in range(config.n_layer)]
        self.ln_f = self.layer_norm(None)

    def __call__(self, input_ids, deterministic: bool, cache: KeyValueCache | None = None, separator_id=None):
        # input_ids: (batch, length) -> hidden states (batch, length, n_embd), and the cache with them added
        segment_ids = None
        if cache is None and separator_id is not None:
            segment_ids, positions = segments_and_positions(input_ids, separator_id)
        elif cache is None:
            positions = jnp.arange(input_ids.shape[1])[None, :]
        else:
            # Each row counts its own tokens; padding slots get position 0, and nothing reads them.
            row_positions = jnp.maximum(jnp.cumsum(cache.mask, axis=1) - 1, 0)
            positions = jax.lax.dynamic_slice_in_dim(row_positions, cache.index, input_ids.shape[1], axis=1)
        x = self.dropout(self.wte(input_ids) + self.wpe(positions), deterministic)
        layer_caches = []
        for block in self.h:
            x, layer_cache = block(x, deterministic, cache, segment_ids)
            layer_caches.append(layer_cache)
        if cache is not None:
            keys, values = zip(*layer_caches)
            cache = cache.replace(keys=keys, values=values, index=cache.index + input_ids.shape[1])
        return self.ln_f(x), cache

    def attend(self, hidden):
        # The output layer is the token embedding, transposed; products accumulate and come out in float32.
        # Multiplied as one (batch x length, n_embd) matrix: XLA then computes the embedding's gradient from the
        # logits' gradient as it is laid out, where with three dimensions it makes a transposed copy of it.
        embedding = self.wte.embedding.astype(self.dtype)
        batch, length, width = hidden.shape
        logits = jnp.dot(hidden.reshape(batch * length, width), embedding.T, preferred_element_type=jnp.float32)
        return logits.reshape(batch, length, -1)


class FlaxGPT2LMHeadModel(GPT2Module):
    """GPT-2 with its language-model head; returns float32 logits (batch, length, vocab_size).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).

    With `document_separator_id` (the end-of-text token), the input is taken for documents packed end to end,
    each separator starting the next: a token attends only to its own document, and positions restart at each
    separator, so that each document is computed as if alone after the separator (Megatron-LM's
    --reset-attention-mask --reset-position-ids).
    """

    document_separator_id: int | None = None

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        transformer = self.child(GPT2Model, "transformer")
        hidden, cache = transformer(input_ids, deterministic, cache, self.document_separator_id)
        if self.config.tie_word_embeddings:
            logits = transformer.attend(hidden)
        else:
            logits = nn.Dense(
                self.config.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(self.config.initializer_range), ("embed", "vocab")
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=partial(jax.lax.dot_general, preferred_element_type=jnp.float32),
                name="lm_head",
            )(hidden)
        logits = logits.astype(jnp.float32)
        return logits if cache is None else (logits, cache)


def hf_name(flax_path: tuple) -> str:
    """('transformer', 'h_3', 'attn', 'c_attn', 'kernel') -> 'transformer.h.3.attn.c_attn.weight'."""
    *modules, leaf = flax_path
    modules = [f"h.{module[2:]}" if module.startswith("h_") and module[2:].isdigit() else module for module in modules]
    return ".".join([*modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


def to_hf_state_dict(params) -> dict[str, np.ndarray]:
    """Flax parameters as the PyTorch GPT2LMHeadModel state dict (float32 numpy, HF names and layouts).

    GPT-2's Conv1D stores weights (in, out) like a Flax kernel, so only the untied lm_head (an
    nn.Linear, stored (out, in)) is transposed.
    """
    state_dict = {}
    for path, value in flatten_dict(params).items():
        value = np.asarray(value, dtype=np.float32)
        name = hf_name(path)
        state_dict[name] = np.ascontiguousarray(value.T if name == "lm_head.weight" else value)
    return state_dict


def hf_shapes(params) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors to_hf_state_dict makes of `params`, from their shapes alone (arrays or
    jax.ShapeDtypeStruct): nothing is read or allocated. It follows to_hf_state_dict; change both together."""
    shapes = {}
    for path, value in flatten_dict(params).items():
        name = hf_name(path)
        shapes[name] = tuple(value.shape[::-1] if name == "lm_head.weight" else value.shape)
    return shapes


def hf_architecture_shapes(config) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors of a GPT2LMHeadModel of `config` (one check_model_config accepts) as
    save_pretrained writes them, without a tied lm_head: what exported weights must be for transformers to load
    them. From the config alone, so that it holds whatever is done to the Flax model."""
    width = config.n_embd
    inner = config.n_inner if config.n_inner is not None else 4 * width

    def conv1d(name: str, fan_in: int, fan_out: int) -> dict:  # GPT-2's Conv1D stores its weight (in, out)
        return {f"{name}.weight": (fan_in, fan_out), f"{name}.bias": (fan_out,)}

    def layer_norm(name: str) -> dict:
        return {f"{name}.weight": (width,), f"{name}.bias": (width,)}

    shapes = {
        "transformer.wte.weight": (config.vocab_size, width),
        "transformer.wpe.weight": (config.n_positions, width),
    }
    for index in range(config.n_layer):
        block = f"transformer.h.{index}"
        shapes |= layer_norm(f"{block}.ln_1")
        shapes |= conv1d(f"{block}.attn.c_attn", width, 3 * width) | conv1d(f"{block}.attn.c_proj", width, width)
        shapes |= layer_norm(f"{block}.ln_2")
        shapes |= conv1d(f"{block}.mlp.c_fc", width, inner) | conv1d(f"{block}.mlp.c_proj", inner, width)
    shapes |= layer_norm("transformer.ln_f")
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, width)  # an nn.Linear: (out, in)
    return shapes


# Buffers some GPT-2 checkpoints carry (the causal mask); they are not parameters.
IGNORED_CHECKPOINT_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def from_hf_state_dict(state_dict: dict, abstract_params) -> dict:
    """The inverse of to_hf_state_dict, shaped like `abstract_params` (from jax.eval_shape of init).

    Accepts GPT2LMHeadModel checkpoints and bare GPT2Model ones (names without 'transformer.').
    """
    if not any(name.startswith("transformer.") for name in state_dict):
        state_dict = {f"transformer.{name}": value for name, value in state_dict.items()}
    params, used = {}, set()
    for path, expected in flatten_dict(abstract_params).items():
        name = hf_name(path)
        if name not in state_dict:
            raise UsageError(f"the checkpoint has no tensor {name}; it does not match the model config")
        value = np.asarray(state_dict[name], dtype=np.float32)
        if name == "lm_head.weight":
            value = value.T
        if value.shape != expected.shape:
            raise UsageError(
                f"checkpoint tensor {name} has shape {value.shape} but the config needs {expected.shape}; "
                "pass the config the checkpoint was trained with"
            )
        params[path] = value.astype(expected.dtype)
        used.add(name)
    ignored = [name for name in state_dict if name not in used and not name.endswith(IGNORED_CHECKPOINT_SUFFIXES)]
    ignored = [name for name in ignored if name != "lm_head.weight"]  # tied to wte when tie_word_embeddings
    if ignored:
        logger.warning(
            "Ignoring %d checkpoint tensors the model does not use: %s", len(ignored), ", ".join(ignored[:5])
        )
    return unflatten_dict(params)


# ----------------------------------------------------------------------------------------------------
# Sampling: decoding with the key/value cache, each row by its own settings, in compiled chunks of steps
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How one row is decoded: greedy at temperature 0, else drawn (see next_tokens). Its draws depend only on
    `seed`, `prompt_index` (the prompt's place among those decoded under one seed, so that they draw differently)
    and the step, never on the rows beside it."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    prompt_index: int = 0

    def problem(self, prefix: str) -> str | None:
        """What is wrong with these settings (named with `prefix`, "--" on a command line), or None."""
        if self.max_new_tokens < 1:
            return f"{prefix}max_new_tokens must be at least 1"
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            return f"{prefix}temperature must be 0 (greedy) or positive"
        if not 0 <= self.top_k < 2**31:
            return f"{prefix}top_k must be 0 (all tokens) or positive, below 2**31"
        if not 0 < self.top_p <= 1:
            return f"{prefix}top_p must be in (0, 1]"
        if not 0 <= self.seed < 2**31:
            return f"{prefix}seed must be in [0, 2**31)"
        return None


class RowSettings(flax.struct.PyTreeNode):
    """The Sampling of each row as arrays (batch,): data to the compiled program, so that rows with different
    settings share it."""

    max_new_tokens: jax.Array  # int32; 0 for the rows that only fill the batch
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    seed: jax.Array  # int32
    prompt_index: jax.Array  # int32

    @classmethod
    def of(cls, samplings: list[Sampling]):
        def column(name: str, dtype):
            return np.asarray([getattr(sampling, name) for sampling in samplings], dtype)

        return cls(
            max_new_tokens=column("max_new_tokens", np.int32),
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            seed=column("seed", np.int32),
            prompt_index=column("prompt_index", np.int32),
        )


class DecodingState(flax.struct.PyTreeNode):
    """What the decoding carries from one call of `decode` to the next."""

    cache: KeyValueCache
    settings: RowSettings
    last_token: jax.Array  # (batch,) int32
    tokens: jax.Array  # (batch, capacity) int32: the new tokens so far, then padding
    counts: jax.Array  # (batch,) int32: new tokens per row, the end-of-text token included
    finished: jax.Array  # (batch,) bool
    step: jax.Array  # int32: the column of `tokens` the next token goes to


def next_tokens(logits, row_keys, temperature, top_k, top_p, do_sample: bool, candidates: int):
    """One token per row from float32 logits (batch, vocab_size), each row by its own settings (arrays (batch,)):
    the most likely where the temperature is 0; else drawn as transformers does: logits divided by the
    temperature, cut to the `top_k` most likely (0: all), then to the most likely whose probabilities add up to
    `top_p`. `do_sample` (some row draws) and `candidates` (how many of the most likely tokens some row's cut
    needs to see; 0 where no row cuts) only leave out work that no row needs: a row's token is the same."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not do_sample:
        return greedy
    drawing = temperature > 0
    logits = logits / jnp.where(drawing, temperature, 1.0)[:, None]
    if candidates:
        logits = cut_to_most_likely(logits, top_k, top_p, candidates)
    # Every row draws over the whole vocabulary in its order, so that its draw is the same in any batch.
    drawn = jax.vmap(jax.random.categorical)(row_keys, logits)
    return jnp.where(drawing, drawn, greedy).astype(jnp.int32)


def cut_to_most_likely(logits, top_k, top_p, candidates: int):
    """The logits with -inf outside each row's top_k most likely tokens, then outside the most likely of those
    whose probabilities add up to its top_p; tokens that tie with the last one kept are kept too, as in
    transformers' top-k. `candidates`: how many of the most likely tokens to sort, at least every row's top_k
    (all of them where a row has top_p without top_k)."""
    sorted_logits, _ = jax.lax.top_k(logits, candidates)
    rank = jnp.arange(candidates)[None, :]
    in_top_k = rank < jnp.where(top_k > 0, top_k, candidates)[:, None]
    sorted_logits = jnp.where(in_top_k, sorted_logits, -jnp.inf)
    probabilities = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the most likely token always stays
    kept = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1)
    cuts = (top_k > 0) | (top_p < 1)
    return jnp.where(~cuts[:, None] | (logits >= threshold[:, None]), logits, -jnp.inf)


def candidates_to_sort(samplings: list[Sampling], vocab_size: int) -> int:
    """The `candidates` of next_tokens for these rows: a power of two, so that few programs serve all top_k."""
    cutting = [s for s in samplings if s.temperature > 0 and (s.top_k or s.top_p < 1)]
    if not cutting:
        return 0
    if any(not s.top_k for s in cutting):
        return vocab_size
    return min(vocab_size, shape_bucket(max(s.top_k for s in cutting), 1))


@dataclass(frozen=True)
class Sampler:
    """The compiled decoding of a model: `prefill` reads the prompts and chooses each row's first token,
    `decode` goes on for some steps. Compiled once per (batch, prompt length, capacity), per greedy or not and
    per count of candidates (see next_tokens); every setting of a row is data, so changing it compiles nothing."""

    prefill: Callable
    decode: Callable
    vocab_size: int


def make_sampler(model, eos_token_id: int | None) -> Sampler:
    eos = -1 if eos_token_id is None else eos_token_id
    pad = max(eos, 0)  # what finished rows write

    def choose(settings: RowSettings, step, logits, do_sample: bool, candidates: int):
        def row_key(seed, prompt_index):
            return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt_index), step)

        row_keys = jax.vmap(row_key)(settings.seed, settings.prompt_index)
        return next_tokens(
            logits, row_keys, settings.temperature, settings.top_k, settings.top_p, do_sample, candidates
        )

    @partial(jax.jit, static_argnames=("capacity", "do_sample", "candidates"))
    def prefill(params, prompt_ids, prompt_mask, settings, *, capacity: int, do_sample: bool, candidates: int):
        # prompt_ids, prompt_mask: (batch, prompt length), left-padded
        batch = prompt_ids.shape[0]
        cache = KeyValueCache.empty(model.config, prompt_mask, capacity, model.dtype)
        logits, cache = model.apply({"params": params}, prompt_ids, cache=cache)
        token = choose(settings, 0, logits[:, -1], do_sample, candidates)
        counts = (settings.max_new_tokens > 0).astype(jnp.int32)
        token = jnp.where(counts > 0, token, pad)
        return DecodingState(
            cache=cache,
            settings=settings,
            last_token=token,
            tokens=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(token),
            counts=counts,
            finished=(token == eos) | (counts >= settings.max_new_tokens),
            step=jnp.ones((), jnp.int32),
        )

    @partial(jax.jit, static_argnames=("do_sample", "candidates"), donate_argnames=("state",))
    def decode(params, state: DecodingState, until_step, ended, *, do_sample: bool, candidates: int):
        """Decodes until step `until_step` or until every row is finished; `ended` (batch,) bool finishes rows
        first, those the caller has no use for any more."""

        def not_done(state):
            return (state.step < until_step) & ~jnp.all(state.finished)

        def decode_one(state):
            logits, cache = model.apply({"params": params}, state.last_token[:, None], cache=state.cache)
            token = choose(state.settings, state.step, logits[:, 0], do_sample, candidates)
            token = jnp.where(state.finished, pad, token)
            counts = state.counts + ~state.finished
            return state.replace(
                cache=cache,
                last_token=token,
                tokens=state.tokens.at[:, state.step].set(token),
                counts=counts,
                finished=state.finished | (token == eos) | (counts >= state.settings.max_new_tokens),
                step=state.step + 1,
            )

        return jax.lax.while_loop(not_done, decode_one, state.replace(finished=state.finished | ended))

    return Sampler(prefill, decode, model.config.vocab_size)


def shape_bucket(size: int, smallest: int) -> int:
    """The power of two at least `size` and `smallest`: shapes from a few buckets, so few compilations."""
    return max(smallest, 1 << (size - 1).bit_length())


def on_host(*arrays) -> list[np.ndarray]:
    # On several processes every one takes part in the decoding and gets the result.
    if all(array.is_fully_addressable for array in arrays):
        return [np.asarray(array) for array in arrays]
    return list(multihost_utils.process_allgather(arrays, tiled=True))


class DecodingBatch:
    """Prompts (non-empty lists of ids) decoded together, each by its own Sampling, some steps at a time: between
    calls of `advance` the caller reads each row's new tokens (to send them on) and may end rows. A row's tokens
    end with the end-of-text token where the model wrote it."""

    def __init__(self, sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]):
        self.sampler, self.params, self.rows = sampler, params, len(prompts)
        batch = shape_bucket(len(prompts), 1)
        prompt_length = shape_bucket(max(map(len, prompts)), 8)
        prompt_ids = np.zeros((batch, prompt_length), np.int32)
        prompt_mask = np.zeros((batch, prompt_length), bool)
        prompt_mask[len(prompts) :, -1] = True  # rows that only fill the batch hold one token and decode none
        for row, ids in enumerate(prompts):
            prompt_ids[row, prompt_length - len(ids) :] = ids
            prompt_mask[row, prompt_length - len(ids) :] = True
        settings = RowSettings.of(samplings + [Sampling(max_new_tokens=0)] * (batch - len(prompts)))
        self.variant = {
            "do_sample": any(s.temperature > 0 for s in samplings),
            "candidates": candidates_to_sort(samplings, sampler.vocab_size),
        }
        self.capacity = shape_bucket(max(s.max_new_tokens for s in samplings), 8)
        self.state = sampler.prefill(params, prompt_ids, prompt_mask, settings, capacity=self.capacity, **self.variant)
        self.read = np.zeros(len(prompts), int)  # tokens of each row handed out so far
        self.finished = np.zeros(len(prompts), bool)

    def advance(self, steps: int, ended=()) -> list[list[int]]:
        """Decodes up to `steps` more steps (none once every row is finished) and returns each row's tokens that
        no earlier call returned (the first call: from the first). Rows in `ended` decode no more."""
        ended_rows = np.zeros(self.state.counts.shape, bool)
        ended_rows[list(ended)] = True
        until_step = self.state.step + steps
        self.state = self.sampler.decode(self.params, self.state, until_step, ended_rows, **self.variant)
        tokens, counts, finished = on_host(self.state.tokens, self.state.counts, self.state.finished)
        new = [tokens[row, self.read[row] : counts[row]].tolist() for row in range(self.rows)]
        self.read, self.finished = counts[: self.rows], finished[: self.rows]
        return new


def decode_rows(sampler: Sampler, params, prompts: list[list[int]], samplings: list[Sampling]) -> list[list[int]]:
    """The new tokens after each prompt, decoded together to the end."""
    batch = DecodingBatch(sampler, params, prompts, samplings)
    return batch.advance(batch.capacity)


def generate_ids(
    sampler: Sampler,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """The new tokens after each prompt (non-empty lists of ids), ending with the end-of-text token where the
    model wrote it, all prompts by the same settings. Temperature 0 is greedy decoding."""
    samplings = [Sampling(max_new_tokens, temperature, top_k, top_p, seed, row) for row in range(len(prompts))]
    return decode_rows(sampler, params, prompts, samplings)
