#!/usr/bin/env python3
"""Generate text with a GPT-2 in JAX/Flax: from prompts on the command line, in a file or on stdin, or as an
HTTP server.

Loads any GPT-2 model directory with config.json, model.safetensors and tokenizer files, as run_clm_flax.py
and transformers write them (or a hub name). Prompts are decoded together in batches, left-padded to a
common length; a key/value cache makes each new token cost one position, and the whole decoding loop is one
compiled XLA program per shape (batch, prompt length and new tokens are rounded up to powers of two, so a
few shapes serve all requests). Decoding is greedy by default (--temperature 0), or draws with a
temperature, top-k and top-p, reproducibly from --seed; it stops at the end-of-text token.

    ./generate_flax.py --model_name_or_path gpt2-run --prompt "def main(" --prompt "import " --max_new_tokens 40
    ./generate_flax.py --model_name_or_path gpt2-run --prompt_file prompts.txt --temperature 0.8 --top_p 0.95
    ./generate_flax.py --model_name_or_path gpt2-run --serve --port 8000
    curl -s localhost:8000 -d '{"prompt": "def main(", "max_new_tokens": 40, "temperature": 0.8, "seed": 1}'

The model code is run_clm_flax.py's, copied: a model trained there decodes here exactly as it evaluated.
"""

import json
import logging
import math
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.experimental import multihost_utils
from safetensors import SafetensorError
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoTokenizer, GPT2Config, HfArgumentParser

logger = logging.getLogger(__name__)


# Copied from run_clm_flax.UsageError
class UsageError(Exception):
    """A problem the user must fix (an argument, a file, a diverged run): reported as one line, no traceback."""


class RequestError(Exception):
    """A request the server refuses: answered 400 with this one line."""


# ----------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        metadata={
            "help": "A GPT-2 model: a directory with config.json, model.safetensors and tokenizer files, or a hub "
            "name."
        }
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the weights and the computation: bfloat16 halves the memory, and is fast on TPUs and "
            "recent GPUs (on CPUs usually slower than float32). Logits are always float32.",
            "choices": ["float32", "bfloat16"],
        },
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models are cached."})
    token: str | None = field(
        default=None, metadata={"help": "Hugging Face hub token for private models. Never logged."}
    )
    allow_pickle_weights: bool = field(
        default=False,
        metadata={
            "help": "Also load a model that has only pytorch_model.bin (a pickle; needs PyTorch). Only for files "
            "you trust; safetensors needs no such opt-in."
        },
    )


@dataclass
class GenerationArguments:
    prompt: list[str] = field(
        default_factory=list,
        metadata={"help": "A prompt to continue; give it several times for several prompts.", "action": "extend"},
    )
    prompt_file: str | None = field(
        default=None,
        metadata={"help": "A text file of prompts, one per line; - reads them from stdin (as does giving no prompt)."},
    )
    max_new_tokens: int = field(
        default=50,
        metadata={"help": "Tokens to generate after each prompt, at most (fewer at the end-of-text token)."},
    )
    temperature: float = field(
        default=0.0,
        metadata={
            "help": "0 takes the most likely token (greedy decoding); above 0, tokens are drawn, the more "
            "freely the higher."
        },
    )
    top_k: int = field(default=0, metadata={"help": "Draw from the k most likely tokens only; 0 for all of them."})
    top_p: float = field(
        default=1.0,
        metadata={"help": "Draw from the most likely tokens whose probabilities add up to top_p (nucleus sampling)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the draws: the same seed gives the same texts."})
    batch_size: int = field(
        default=8, metadata={"help": "Prompts decoded together; also the most prompts one HTTP request may carry."}
    )
    json_output: bool = field(
        default=False,
        metadata={"help": "Print one JSON line per prompt (prompt, text, token counts) instead of the texts."},
    )


@dataclass
class ServerArguments:
    serve: bool = field(
        default=False,
        metadata={"help": "Answer HTTP POST requests instead of reading prompts; see the module docstring."},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on; 0.0.0.0 for every interface."})
    port: int = field(default=8000, metadata={"help": "Port to listen on; 0 picks a free one (printed)."})
    max_new_tokens_limit: int = field(
        default=256, metadata={"help": "The most new tokens a request may ask for per prompt."}
    )


def parse_arguments() -> tuple[ModelArguments, GenerationArguments, ServerArguments]:
    parser = HfArgumentParser((ModelArguments, GenerationArguments, ServerArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        if not os.path.isfile(sys.argv[1]):
            raise UsageError(f"arguments file {sys.argv[1]} does not exist")
        try:
            return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
        except (ValueError, json.JSONDecodeError) as error:
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    *arguments, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UsageError(f"unknown argument {unknown[0]}; see --help for the arguments this script takes")
    return tuple(arguments)


def sampling_settings_problem(settings: dict, prefix: str) -> str | None:
    """What is wrong with max_new_tokens, temperature, top_k, top_p (named with `prefix`), or None."""
    if settings["max_new_tokens"] < 1:
        return f"{prefix}max_new_tokens must be at least 1"
    if not (settings["temperature"] >= 0 and math.isfinite(settings["temperature"])):
        return f"{prefix}temperature must be 0 (greedy) or positive"
    if settings["top_k"] < 0:
        return f"{prefix}top_k must be 0 (all tokens) or positive"
    if not 0 < settings["top_p"] <= 1:
        return f"{prefix}top_p must be in (0, 1]"
    return None


def check_arguments(generation_args, server_args):
    settings = {name: getattr(generation_args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p")}
    if problem := sampling_settings_problem(settings, "--"):
        raise UsageError(problem)
    if generation_args.batch_size < 1:
        raise UsageError("--batch_size must be at least 1")
    if server_args.serve:
        if generation_args.prompt or generation_args.prompt_file:
            raise UsageError("--serve takes its prompts from HTTP requests; leave out --prompt and --prompt_file")
        if not 0 <= server_args.port < 65536:
            raise UsageError(f"--port {server_args.port} is not a port number; use 1 to 65535, or 0 for any free one")
        if server_args.max_new_tokens_limit < generation_args.max_new_tokens:
            raise UsageError("--max_new_tokens (the default of requests) exceeds --max_new_tokens_limit; lower it")
    elif generation_args.prompt and generation_args.prompt_file:
        raise UsageError("give prompts with --prompt or --prompt_file, not both")


def read_prompts(generation_args) -> list[str]:
    if generation_args.prompt:
        return generation_args.prompt
    if generation_args.prompt_file in (None, "-"):
        if generation_args.prompt_file is None and sys.stdin.isatty():
            raise UsageError("no prompts: pass --prompt TEXT, --prompt_file FILE, or pipe prompts in, one per line")
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(generation_args.prompt_file, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --prompt_file {generation_args.prompt_file}: {error}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError("the prompts are empty: write one prompt per line")
    return prompts


# ----------------------------------------------------------------------------------------------------
# Model: GPT-2 in Flax, copied from run_clm_flax.py (parameter names one-to-one with the checkpoint)
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


# Copied from run_clm_flax.KeyValueCache
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


# Copied from run_clm_flax.GPT2Module
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


# Copied from run_clm_flax.CausalSelfAttention
class CausalSelfAttention(GPT2Module):
    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None):
        """(output, this layer's new (keys, values) when decoding with `cache`, else None)."""
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
            y = jax.nn.dot_product_attention(
                query, key, value, scale=scale, is_causal=True, implementation=attention_implementation(query.dtype)
            )
        else:
            # jax.nn.dot_product_attention has no dropout on the attention weights, which GPT-2 trains with.
            y = attention_with_dropout(query, key, value, scale, nn.Dropout(config.attn_pdrop, deterministic=False))
        y = self.dense(width, ("heads", "embed"), residual_stddev, "c_proj")(y.reshape(batch, length, width))
        return nn.Dropout(config.resid_pdrop)(y, deterministic), layer_cache


# Copied from run_clm_flax.attention_implementation
def attention_implementation(dtype) -> str | None:
    """cuDNN's fused (flash) attention on NVIDIA GPUs in half precision, XLA's attention elsewhere.

    jax.nn.dot_product_attention does not choose cuDNN by itself, and cuDNN has no float32 kernel.
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return None


# Copied from run_clm_flax.attention_with_dropout
def attention_with_dropout(query, key, value, scale, dropout: nn.Dropout):
    """Causal attention written out, for training with dropout on the attention weights."""
    # query, key, value: (batch, length, heads, head_dim)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    length = query.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(jnp.float32).min), axis=-1)
    weights = dropout(weights).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


# Copied from run_clm_flax.cached_attention
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


# Copied from run_clm_flax.MLP
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


# Copied from run_clm_flax.Block
class Block(GPT2Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    layer_index: int = 0

    @nn.compact
    def __call__(self, x, deterministic: bool, cache: KeyValueCache | None = None):
        attention = self.child(CausalSelfAttention, "attn", layer_index=self.layer_index)
        y, layer_cache = attention(self.layer_norm("ln_1")(x), deterministic, cache)
        x = x + y
        x = x + self.child(MLP, "mlp")(self.layer_norm("ln_2")(x), deterministic)
        return x, layer_cache


# Copied from run_clm_flax.GPT2Model
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

    def __call__(self, input_ids, deterministic: bool, cache: KeyValueCache | None = None):
        # input_ids: (batch, length) -> hidden states (batch, length, n_embd), and the cache with them added
        if cache is None:
            positions = jnp.arange(input_ids.shape[1])[None, :]
        else:
            # Each row counts its own tokens; padding slots get position 0, and nothing reads them.
            row_positions = jnp.maximum(jnp.cumsum(cache.mask, axis=1) - 1, 0)
            positions = jax.lax.dynamic_slice_in_dim(row_positions, cache.index, input_ids.shape[1], axis=1)
        x = self.dropout(self.wte(input_ids) + self.wpe(positions), deterministic)
        layer_caches = []
        for block in self.h:
            x, layer_cache = block(x, deterministic, cache)
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


# Copied from run_clm_flax.FlaxGPT2LMHeadModel
class FlaxGPT2LMHeadModel(GPT2Module):
    """GPT-2 with its language-model head; returns float32 logits (batch, length, vocab_size).

    Given a KeyValueCache (decoding), the input is the tokens that follow the cached ones, and the result is
    (logits, the cache with them added).
    """

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, cache: KeyValueCache | None = None):
        transformer = self.child(GPT2Model, "transformer")
        hidden, cache = transformer(input_ids, deterministic, cache)
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


# Copied from run_clm_flax.hf_name
def hf_name(flax_path: tuple) -> str:
    """('transformer', 'h_3', 'attn', 'c_attn', 'kernel') -> 'transformer.h.3.attn.c_attn.weight'."""
    *modules, leaf = flax_path
    modules = [f"h.{module[2:]}" if module.startswith("h_") and module[2:].isdigit() else module for module in modules]
    return ".".join([*modules, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


# Buffers some GPT-2 checkpoints carry (the causal mask); they are not parameters.
# Copied from run_clm_flax.IGNORED_CHECKPOINT_SUFFIXES
IGNORED_CHECKPOINT_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# Copied from run_clm_flax.from_hf_state_dict
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


# Copied from run_clm_flax.read_safetensors_checkpoint
def read_safetensors_checkpoint(name_or_path: str, model_args) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors (or its shards) from a local directory or the hub."""
    import huggingface_hub

    def fetch(filename):
        """The file's local path, or None where there is no such file."""
        if os.path.isdir(name_or_path):
            path = os.path.join(name_or_path, filename)
            return path if os.path.isfile(path) else None
        try:
            return huggingface_hub.hf_hub_download(
                name_or_path, filename, cache_dir=model_args.cache_dir, token=model_args.token
            )
        except huggingface_hub.errors.EntryNotFoundError:
            return None
        except (huggingface_hub.errors.HfHubHTTPError, OSError, ValueError) as error:
            raise UsageError(f"cannot download {filename} of {name_or_path}: {error}") from None

    def read(path):
        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            reason = str(error).splitlines()[0]
            raise UsageError(f"{path} is not a readable safetensors file ({reason}); save it again") from None

    index_name = "model.safetensors.index.json"
    if (index_path := fetch(index_name)) is not None:
        try:
            with open(index_path) as index_file:
                shard_names = sorted(set(json.load(index_file)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{index_path} is not a safetensors index (JSON with a weight_map)") from None
        state_dict = {}
        for shard_name in shard_names:
            if (shard_path := fetch(shard_name)) is None:
                raise UsageError(f"{name_or_path} has no {shard_name}, a shard its {index_name} names")
            state_dict.update(read(shard_path))
        return state_dict
    if (path := fetch("model.safetensors")) is not None:
        return read(path)
    if (pickle_path := fetch("pytorch_model.bin")) is None:
        raise UsageError(f"{name_or_path} has no model.safetensors")
    if not model_args.allow_pickle_weights:
        raise UsageError(
            f"{name_or_path} holds only pytorch_model.bin, a pickle that can run code when loaded; convert it to "
            "model.safetensors, or pass --allow_pickle_weights if you trust the file"
        )
    try:
        import torch
    except ImportError:
        raise UsageError("reading pytorch_model.bin needs PyTorch: pip install torch") from None
    # weights_only refuses anything in the pickle but tensors and plain containers, before running any of it.
    try:
        state_dict = torch.load(pickle_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):
        raise UsageError(
            f"{pickle_path} cannot be loaded as plain tensors: it holds other objects (none of them was run) or is "
            "damaged; convert it to model.safetensors where you trust it"
        ) from None
    if not (isinstance(state_dict, dict) and all(isinstance(tensor, torch.Tensor) for tensor in state_dict.values())):
        raise UsageError(f"{pickle_path} is not a state dict of named tensors; convert it to model.safetensors")
    return {name: tensor.float().numpy() for name, tensor in state_dict.items()}


# Copied from run_clm_flax.abstract_model_params
def abstract_model_params(model, dummy_input, unbox: bool = True):
    """Shapes and dtypes of the model's parameters, without computing them. Unboxed: plain arrays;
    boxed: each carries its logical axis names."""
    variables = jax.eval_shape(partial(model.init, deterministic=True), jax.random.key(0), dummy_input)
    return nn.meta.unbox(variables["params"]) if unbox else variables["params"]


def load_model(model_args):
    """(model, parameters on the default device, tokenizer) of a GPT-2 model directory or hub name."""
    source = model_args.model_name_or_path

    def load(loader):
        try:
            return loader.from_pretrained(source, cache_dir=model_args.cache_dir, token=model_args.token)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot load --model_name_or_path {source}: {str(error).splitlines()[0]}") from None

    config, tokenizer = load(AutoConfig), load(AutoTokenizer)
    if config.model_type != "gpt2":
        raise UsageError(f"this script generates with GPT-2 but {source} is a '{config.model_type}' model")
    if config.activation_function not in ACTIVATIONS:
        raise UsageError(f"{source} uses activation_function '{config.activation_function}', which is not supported")
    dtype = jnp.dtype(model_args.dtype)
    model = FlaxGPT2LMHeadModel(config, dtype=dtype, param_dtype=dtype)
    abstract_params = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))
    params = from_hf_state_dict(read_safetensors_checkpoint(source, model_args), abstract_params)
    return model, jax.device_put(params), tokenizer


# ----------------------------------------------------------------------------------------------------
# Sampling: the whole decoding loop compiled once per shape, with a key/value cache
# ----------------------------------------------------------------------------------------------------


# Copied from run_clm_flax.next_tokens
def next_tokens(logits, row_keys, temperature, top_p, top_k: int, do_sample: bool, use_top_p: bool):
    """One token per row from float32 logits (batch, vocab_size): the most likely, or drawn as transformers does:
    logits divided by the temperature, cut to the `top_k` most likely (0: all), then to the most likely whose
    probabilities add up to `top_p`."""
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    candidate_ids = None
    if top_k or use_top_p:
        # Sorted, most likely first: a full sort of the vocabulary only when top_p is set without top_k.
        logits, candidate_ids = jax.lax.top_k(logits, top_k or logits.shape[-1])
    if use_top_p:
        probabilities = jax.nn.softmax(logits, axis=-1)
        mass_before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the most likely token always stays
        logits = jnp.where(mass_before < top_p, logits, -jnp.inf)
    choices = jax.vmap(jax.random.categorical)(row_keys, logits)
    if candidate_ids is None:
        return choices.astype(jnp.int32)
    return jnp.take_along_axis(candidate_ids, choices[:, None], axis=-1)[:, 0].astype(jnp.int32)


# Copied from run_clm_flax.make_sampler
def make_sampler(model, eos_token_id: int | None):
    """A jitted function generating up to `max_new_tokens` tokens after left-padded prompts.

    It is compiled once per (batch, prompt length, capacity) and per top_k / greedy / top_p-or-not; the
    temperature, top_p, seed and max_new_tokens are arguments, so changing them does not compile again.
    Returns (new tokens (batch, capacity), the count of new tokens per row, the end-of-text token included).
    """
    eos = -1 if eos_token_id is None else eos_token_id
    pad = max(eos, 0)  # what finished rows write

    @partial(jax.jit, static_argnames=("capacity", "top_k", "do_sample", "use_top_p"))
    def sample(
        params,
        prompt_ids,
        prompt_mask,
        row_count,
        seed,
        max_new_tokens,
        temperature,
        top_p,
        *,
        capacity: int,
        top_k: int,
        do_sample: bool,
        use_top_p: bool,
    ):
        # prompt_ids, prompt_mask: (batch, prompt length), left-padded; rows from row_count on only fill the batch.
        batch = prompt_ids.shape[0]
        variables = {"params": params}
        cache = KeyValueCache.empty(model.config, prompt_mask, capacity, model.dtype)
        logits, cache = model.apply(variables, prompt_ids, cache=cache)
        seed_key = jax.random.key(seed)

        def choose(step, last_logits):
            # A key per row and step: a row's text does not depend on the other rows of the batch.
            step_key = jax.random.fold_in(seed_key, step)
            row_keys = jax.vmap(lambda row: jax.random.fold_in(step_key, row))(jnp.arange(batch))
            return next_tokens(last_logits, row_keys, temperature, top_p, top_k, do_sample, use_top_p)

        token = choose(0, logits[:, -1])
        tokens = jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(token)
        counts = jnp.ones((batch,), jnp.int32)
        finished = (token == eos) | (jnp.arange(batch) >= row_count)

        def not_done(loop_state):
            step, _, _, _, _, finished = loop_state
            return (step < max_new_tokens) & ~jnp.all(finished)

        def decode_one(loop_state):
            step, token, cache, tokens, counts, finished = loop_state
            logits, cache = model.apply(variables, token[:, None], cache=cache)
            token = jnp.where(finished, pad, choose(step, logits[:, 0]))
            tokens = tokens.at[:, step].set(token)
            counts = counts + ~finished
            return step + 1, token, cache, tokens, counts, finished | (token == eos)

        loop_state = (1, token, cache, tokens, counts, finished)
        _, _, _, tokens, counts, _ = jax.lax.while_loop(not_done, decode_one, loop_state)
        return tokens, counts

    return sample


# Copied from run_clm_flax.shape_bucket
def shape_bucket(size: int, smallest: int) -> int:
    """The power of two at least `size` and `smallest`: shapes from a few buckets, so few compilations."""
    return max(smallest, 1 << (size - 1).bit_length())


# Copied from run_clm_flax.generate_ids
def generate_ids(
    sampler,
    params,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """The new tokens after each prompt (non-empty lists of ids), ending with the end-of-text token where the
    model wrote it. Temperature 0 is greedy decoding."""
    batch = shape_bucket(len(prompts), 1)
    prompt_length = shape_bucket(max(map(len, prompts)), 8)
    prompt_ids = np.zeros((batch, prompt_length), np.int32)
    prompt_mask = np.zeros((batch, prompt_length), bool)
    prompt_mask[len(prompts) :, -1] = True  # rows that only fill the batch hold one token
    for row, ids in enumerate(prompts):
        prompt_ids[row, prompt_length - len(ids) :] = ids
        prompt_mask[row, prompt_length - len(ids) :] = True
    tokens, counts = sampler(
        params,
        prompt_ids,
        prompt_mask,
        len(prompts),
        seed,
        max_new_tokens,
        float(temperature),
        float(top_p),
        capacity=shape_bucket(max_new_tokens, 8),
        top_k=int(top_k),
        do_sample=temperature > 0,
        use_top_p=top_p < 1,
    )
    # On several processes every one takes part in the sampling and gets the result.
    tokens, counts = (
        (np.asarray(tokens), np.asarray(counts))
        if tokens.is_fully_addressable
        else multihost_utils.process_allgather((tokens, counts), tiled=True)
    )
    return [tokens[row, : counts[row]].tolist() for row in range(len(prompts))]


class Generator:
    """One loaded model answering batches of prompts; a lock lets the server's threads take turns."""

    def __init__(self, model, params, tokenizer, batch_size: int):
        self.model, self.params, self.tokenizer, self.batch_size = model, params, tokenizer, batch_size
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.eos_token_id = eos_token_id
        self.sampler = make_sampler(model, eos_token_id)
        self.lock = threading.Lock()

    def encode(self, prompts: list[str], max_new_tokens: int, where: str) -> list[list[int]]:
        """Token ids of each prompt; an empty one starts from the end-of-text token. Refuses prompts that leave
        no room for max_new_tokens within the model's positions (`where` names the prompt for the message)."""
        start = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_token_id
        encoded = []
        for number, prompt in enumerate(prompts, 1):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] or [start]
            if len(ids) + max_new_tokens > self.model.config.n_positions:
                raise ValueError(
                    f"{where} {number} has {len(ids)} tokens, which with max_new_tokens {max_new_tokens} exceeds the "
                    f"model's {self.model.config.n_positions} positions; shorten it or lower max_new_tokens"
                )
            encoded.append(ids)
        return encoded

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        where: str = "prompt",
    ) -> list[dict]:
        """For each prompt: its continuation, the count of prompt and new tokens, and why it stopped."""
        prompt_ids = self.encode(prompts, max_new_tokens, where)
        results = []
        for first in range(0, len(prompt_ids), self.batch_size):
            batch = prompt_ids[first : first + self.batch_size]
            with self.lock:
                # Each batch draws from its own seed, so that no two prompts share their draws.
                new_ids = generate_ids(
                    self.sampler, self.params, batch, max_new_tokens, temperature, top_k, top_p, seed + first
                )
            for ids, new in zip(batch, new_ids):
                stopped = bool(new) and new[-1] == self.eos_token_id
                results.append(
                    {
                        "text": self.tokenizer.decode(new[:-1] if stopped else new, skip_special_tokens=False),
                        "prompt_tokens": len(ids),
                        "new_tokens": len(new),
                        "finish_reason": "eos" if stopped else "length",
                    }
                )
        return results


# ----------------------------------------------------------------------------------------------------
# HTTP server
# ----------------------------------------------------------------------------------------------------

MAX_REQUEST_BYTES = 1 << 20
SETTING_TYPES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}
REQUEST_FIELDS = {"prompt", "prompts", *SETTING_TYPES}
REQUEST_EXAMPLE = '{"prompt": "Once", "max_new_tokens": 20, "temperature": 0.8, "top_k": 0, "top_p": 1, "seed": 0}'


def parse_request(body: bytes, generation_args, server_args) -> dict:
    """The prompts and settings of a request body, the command line's settings filling in what it leaves out."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not JSON: {error}") from None
    if not isinstance(request, dict):
        raise RequestError(f"the body must be a JSON object such as {REQUEST_EXAMPLE}")
    if unknown := sorted(set(request) - REQUEST_FIELDS):
        raise RequestError(f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(REQUEST_FIELDS))}")
    if ("prompt" in request) == ("prompts" in request):
        raise RequestError('give either "prompt" (a string) or "prompts" (a list of strings)')
    prompts = [request["prompt"]] if "prompt" in request else request["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
        raise RequestError('"prompt" must be a string and "prompts" a non-empty list of strings')
    if len(prompts) > generation_args.batch_size:
        raise RequestError(
            f"{len(prompts)} prompts in one request; the server takes at most {generation_args.batch_size}"
        )
    settings = {"prompts": prompts}
    for name, kind in SETTING_TYPES.items():
        value = request.get(name, getattr(generation_args, name))
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (kind is int and not float(value).is_integer()):
            raise RequestError(f'"{name}" must be {"an integer" if kind is int else "a number"}, not {value!r}')
        settings[name] = kind(value)
    if problem := sampling_settings_problem(settings, ""):
        raise RequestError(problem)
    if settings["max_new_tokens"] > server_args.max_new_tokens_limit:
        raise RequestError(
            f"max_new_tokens {settings['max_new_tokens']} exceeds this server's limit of "
            f"{server_args.max_new_tokens_limit}"
        )
    if not 0 <= settings["seed"] < 2**31:
        raise RequestError("seed must be in [0, 2**31)")
    return settings


def make_request_handler(generator: Generator, generation_args, server_args):
    class GenerationRequestHandler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.reply(200, {"model": generator.model.config.name_or_path, "usage": f"POST {REQUEST_EXAMPLE}"})

        def do_POST(self):
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_REQUEST_BYTES:
                    raise RequestError(f"the body has {length} bytes; the server takes at most {MAX_REQUEST_BYTES}")
                settings = parse_request(self.rfile.read(length), generation_args, server_args)
                prompts = settings.pop("prompts")
                start = time.perf_counter()
                try:
                    results = generator.generate(prompts, **settings, where="prompt")
                except ValueError as error:
                    raise RequestError(str(error)) from None
            except RequestError as error:
                self.reply(400, {"error": str(error)})
                return
            except Exception:  # the server stays up for the next request
                logger.exception("Failed to answer a request")
                self.reply(500, {"error": "the server failed to answer this request; see its log"})
                return
            logger.info(
                "%d prompts, %d new tokens in %.2f s",
                len(prompts),
                sum(r["new_tokens"] for r in results),
                time.perf_counter() - start,
            )
            self.reply(
                200,
                {
                    "texts": [result["text"] for result in results],
                    "prompt_tokens": [result["prompt_tokens"] for result in results],
                    "new_tokens": [result["new_tokens"] for result in results],
                    "finish_reasons": [result["finish_reason"] for result in results],
                },
            )

        def reply(self, status: int, content: dict):
            body = json.dumps(content).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            logger.info("%s %s", self.address_string(), format % args)

    return GenerationRequestHandler


def serve(generator: Generator, generation_args, server_args):
    try:
        server = ThreadingHTTPServer(
            (server_args.host, server_args.port), make_request_handler(generator, generation_args, server_args)
        )
    except OSError as error:
        raise UsageError(f"cannot listen on --host {server_args.host} --port {server_args.port}: {error}") from None
    host, port = server.server_address[:2]
    print(f"Serving {generator.model.config.name_or_path} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def main():
    model_args, generation_args, server_args = parse_arguments()
    check_arguments(generation_args, server_args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    # JAX logs at INFO each accelerator backend it fails to find (libtpu on every GPU or CPU machine).
    logging.getLogger("jax").setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    prompts = None if server_args.serve else read_prompts(generation_args)

    model, params, tokenizer = load_model(model_args)
    generator = Generator(model, params, tokenizer, generation_args.batch_size)
    logger.info(
        "Loaded %s: %.1fM parameters in %s on %s",
        model_args.model_name_or_path,
        sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) / 1e6,
        model_args.dtype,
        jax.devices()[0],
    )
    settings = {name: getattr(generation_args, name) for name in SETTING_TYPES}
    if server_args.serve:
        # Compile the most common shape before the first request arrives.
        generator.generate([""], **settings)
        serve(generator, generation_args, server_args)
        return

    start = time.perf_counter()
    try:
        results = generator.generate(prompts, **settings, where="--prompt" if generation_args.prompt else "line")
    except ValueError as error:
        raise UsageError(str(error)) from None
    new_tokens = sum(result["new_tokens"] for result in results)
    elapsed = time.perf_counter() - start
    logger.info(
        "%d new tokens in %.2f s (%.1f tokens/s, compilation included)", new_tokens, elapsed, new_tokens / elapsed
    )
    for prompt, result in zip(prompts, results):
        if generation_args.json_output:
            print(json.dumps({"prompt": prompt, **result}))
        else:
            print(prompt + result["text"], end="\n\n")


if __name__ == "__main__":
    try:
        main()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
