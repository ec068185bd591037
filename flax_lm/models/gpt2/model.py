"""GPT-2 in Flax, with parameter names and layouts one-to-one with the Hugging Face PyTorch checkpoint
(GPT2LMHeadModel), and a key/value cache for decoding (flax_lm.generation.sampling decodes with it).

The block options of the fast small-model recipes are config fields here too, off by default (BLOCK_OPTIONS):
QK-norm, attention and final-logit soft-capping and sliding-window layers, computed as common.py computes them for
the families that have them. GPT2LMHeadModel has none of them, so an export of a model that uses one does not name it
(export_refusal).

A model module: flax_lm/models/README.md says what one holds, and how an experiment trains a copy of its own."""

import logging
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers import GPT2Config

from flax_lm.devices.mesh import check_tensor_split
from flax_lm.errors import UsageError
from flax_lm.models.shared.common import (
    ACTIVATIONS,
    KeyValueCache,
    RMSNorm,
    RowsDense,
    cached_attention,
    causal_attention,
    constrain,
    layer_windows,
    logits_dot_general,
    look_up,
    segments_and_positions,
    tied_logits,
)

logger = logging.getLogger(__name__)

# The config.model_type this module computes -> the transformers class whose checkpoint layout the parameters map
# onto, named in an exported config.json.
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}
# A causal LM: its exported directory carries a generation_config.json, as transformers writes for one.
GENERATES_TEXT = True

# The block options GPT2LMHeadModel does not have: config field -> (what it is, the model type whose transformers class
# computes it and so exports it). None (False for qk_norm) or absent, the model is GPT-2's.
BLOCK_OPTIONS = {
    "qk_norm": ("QK-norm", "qwen3"),
    "attn_logit_softcapping": ("attention soft-capping", "gemma2"),
    "final_logit_softcapping": ("final-logit soft-capping", "gemma2"),
    "sliding_window": ("sliding-window layers", "qwen3"),
    "layer_types": ("sliding-window layers", "qwen3"),
}


def block_options_in_use(config) -> list[str]:
    """The BLOCK_OPTIONS fields `config` sets, in their order."""
    return [name for name in BLOCK_OPTIONS if getattr(config, name, None) not in (None, False)]


def export_refusal(config) -> str | None:
    """Why an export of `config`'s model cannot name GPT2LMHeadModel (which would compute another model from its
    weights), or None where it can."""
    if used := block_options_in_use(config):
        option, model_type = BLOCK_OPTIONS[used[0]]
        return (
            f"the config sets {used[0]} ({option}), which GPT2LMHeadModel does not compute; a model type whose class "
            f"has it ({model_type}) exports it"
        )
    return None


def check_model_config(config, mesh: jax.sharding.Mesh | None = None):
    """Raise UsageError if `config` asks for a GPT-2 variant this model does not implement, or one that the tensor
    axis of `mesh` cannot split."""
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
    check_block_options(config)
    if mesh is not None:
        check_tensor_split(
            mesh,
            {
                "attention heads (n_head)": config.n_head,
                "MLP width (n_inner)": config.n_inner or 4 * config.n_embd,
                "vocabulary (vocab_size)": config.vocab_size,
            },
        )


def check_block_options(config):
    """Refuse block options (BLOCK_OPTIONS) of values the model cannot compute, naming the field and the fix."""
    if getattr(config, "qk_norm", None) not in (None, True, False):
        raise UsageError(f"qk_norm must be true or false, not {config.qk_norm!r}; fix it with --set qk_norm=true")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(config, name, None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise UsageError(f"{name} must be a positive number (e.g. --set {name}=30.0) or null, not {cap!r}")
    window = getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UsageError(f"sliding_window must be a positive number of tokens or null, not {window!r}")
    # transformers' config checks the layer types themselves, one per layer; a window is what they need besides.
    if getattr(config, "layer_types", None) is not None and window is None:
        raise UsageError("layer_types is set but sliding_window is not; set one, e.g. --set sliding_window=64")


class GPT2Module(nn.Module):
    """Base of the model's parts: the config, the dtype of the computation, the dtype the parameters are stored
    in, and layers whose parameters carry logical axis names, so that a mesh can shard them. With `mesh`, the
    activations are laid out over it too (see constrain)."""

    config: GPT2Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat_policy: str | None = None  # a jax.checkpoint_policies name: recompute each block in the backward pass
    mesh: jax.sharding.Mesh | None = None

    def child(self, module_class, name: str | None, **fields):
        return module_class(
            self.config, self.dtype, self.param_dtype, self.remat_policy, self.mesh, name=name, **fields
        )

    def constrain(self, x, logical_axes: tuple):
        return constrain(x, self.mesh, logical_axes)

    def dense(self, features: int, names: tuple, stddev: float, name: str) -> RowsDense:
        """Weights drawn from N(0, stddev), zero bias, kernel laid out (in, out) as in the checkpoint's Conv1D."""
        return RowsDense(
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

        query, key, value = self.child(QueryKeyValue, "c_attn")(x)
        if getattr(config, "qk_norm", False):
            # Each query and key head RMS-normalized over head_dim, with a learned weight: Qwen 3's q_norm, k_norm.
            query = self.head_norm("q_norm")(query)
            key = self.head_norm("k_norm")(key)
        window = layer_windows(config)[self.layer_index]
        softcap = getattr(config, "attn_logit_softcapping", None)
        scale = 1 / math.sqrt(head_dim) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= self.layer_index + 1

        layer_cache = None
        if cache is not None:
            y, layer_cache = cached_attention(
                query, key, value, scale, cache, self.layer_index, self.mesh, window, softcap
            )
        else:
            no_dropout = deterministic or config.attn_pdrop == 0
            dropout = None if no_dropout else nn.Dropout(config.attn_pdrop, deterministic=False)
            y = causal_attention(query, key, value, scale, dropout, segment_ids, window, softcap)
        # Split by heads, the projection's rows are split alike: each device sums its heads' share of the
        # output, and one sum over the tensor axis completes it.
        y = self.dense(width, ("heads", "embed"), residual_stddev, "c_proj")(y.reshape(batch, length, width))
        y = self.constrain(y, ("batch", "length", None))
        return nn.Dropout(config.resid_pdrop)(y, deterministic), layer_cache

    def head_norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.config.layer_norm_epsilon, self.dtype, self.param_dtype, logical_axis=None, name=name)


class QueryKeyValue(GPT2Module):
    """The query, key and value of every head, (batch, length, n_head, head_dim) each, from one projection whose
    kernel (n_embd, 3 * n_embd) holds the three side by side, as the checkpoint's c_attn does."""

    @nn.compact
    def __call__(self, x):
        config = self.config
        width, heads = config.n_embd, config.n_head
        kernel_init = nn.with_logical_partitioning(
            nn.initializers.normal(config.initializer_range), ("embed", "heads")
        )
        kernel = self.param("kernel", kernel_init, (width, 3 * width), self.param_dtype)
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("heads",))
        bias = self.param("bias", bias_init, (3 * width,), self.param_dtype)
        # Stored, the kernel's columns are split over the tensor axis in contiguous pieces, which cut across q, k
        # and v; computed, each device takes whole heads of all three.
        kernel = self.constrain(kernel.reshape(width, 3, heads, -1), ("embed", None, "heads", None))
        bias = self.constrain(bias.reshape(3, heads, -1), (None, "heads", None))
        batch, length, _ = x.shape
        rows = x.reshape(batch * length, width).astype(self.dtype)  # one matrix, as RowsDense multiplies
        qkv = self.dense_product(rows, kernel.astype(self.dtype)) + bias.astype(self.dtype)
        qkv = self.constrain(qkv.reshape(batch, length, 3, heads, -1), ("batch", None, None, "heads", None))
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def dense_product(self, rows, kernel):
        """rows (rows, n_embd) times the kernel (n_embd, 3, n_head, head_dim): a method of its own, which --fp8
        multiplies in FP8 as it does the nn.Dense layers (flax_lm/training/fp8.py)."""
        return jnp.einsum("ne,ethd->nthd", rows, kernel)


class MLP(GPT2Module):
    @nn.compact
    def __call__(self, x, deterministic: bool):
        config = self.config
        inner = config.n_inner or 4 * config.n_embd
        residual_stddev = config.initializer_range / math.sqrt(2 * config.n_layer)
        # Split over the tensor axis by columns, then by rows: each device computes its own columns of the inner
        # layer, and one sum over the axis completes the output.
        x = self.dense(inner, ("embed", "mlp"), config.initializer_range, "c_fc")(x)
        x = self.constrain(ACTIVATIONS[config.activation_function](x), ("batch", None, "mlp"))
        x = self.dense(config.n_embd, ("mlp", "embed"), residual_stddev, "c_proj")(x)
        x = self.constrain(x, ("batch", "length", None))
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
        input_ids = self.constrain(input_ids, ("batch", None))  # every device of a tensor group takes its rows
        segment_ids = None
        if cache is None and separator_id is not None:
            segment_ids, positions = segments_and_positions(input_ids, separator_id)
        elif cache is None:
            positions = jnp.arange(input_ids.shape[1])[None, :]
        else:
            positions = cache.positions(input_ids.shape[1])
        x = self.dropout(
            self.look_up(self.wte, "vocab", input_ids) + self.look_up(self.wpe, "positions", positions), deterministic
        )
        x = self.constrain(x, ("batch", "length", None))
        layer_caches = []
        for block in self.h:
            x, layer_cache = block(x, deterministic, cache, segment_ids)
            layer_caches.append(layer_cache)
        if cache is not None:
            keys, values = zip(*layer_caches)
            cache = cache.replace(keys=keys, values=values, index=cache.index + input_ids.shape[1])
        return self.ln_f(x), cache

    def look_up(self, table: nn.Embed, row_axis: str, ids):
        return look_up(table, row_axis, ids, self.mesh, self.dtype)

    def attend(self, hidden):
        logits = tied_logits(hidden, self.wte.embedding.astype(self.dtype))
        return self.constrain(logits, ("batch", None, "vocab"))


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
        head_dim = config.n_embd // config.n_head
        return KeyValueCache.empty(config.n_layer, config.n_head, head_dim, prompt_mask, new_tokens, self.dtype)


# The model class of this module, as the scripts construct it: (config, dtype, param_dtype, remat_policy, mesh,
# document_separator_id=...).
MODEL_CLASS = FlaxGPT2LMHeadModel


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
