"""What only a GPU can answer about cuDNN's fused attention, the weight initialisation's compile time and FP8 products;
prints one JSON line per check. Run on an NVIDIA GPU from the repository root (a minute or two):
    python checks/gpu_check.py
    python checks/gpu_check.py --dry_run    # on a CPU: tiny shapes, written-out attention, to check the script runs

1. attention: for each kind of mask (RoBERTa padded rows and packed documents, GPT-2 documents, Gemma 3's window), the
   logits and gradients of tiny models in bfloat16 with cuDNN's kernel against the written-out attention.
2. init: seconds to compile flax's `init` and `initial_params` for RoBERTa-base and GPT-2 124M.
3. fp8: an FP8 product of GPT-2's MLP shape (32 x 1024 rows) forward and backward against bfloat16: error, time,
   and whether XLA made it an FP8 cuBLAS call.
"""

import contextlib
import json
import operator
import sys
import time
from functools import partial
from pathlib import Path

import flax
import flax.core.scope
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flax_lm.models.gemma import model as gemma  # noqa: E402
from flax_lm.models.gpt2 import model as gpt2  # noqa: E402
from flax_lm.models.roberta import model as roberta  # noqa: E402
from flax_lm.models.shared import common  # noqa: E402
from flax_lm.training.fp8 import fp8_product, fp8_supported  # noqa: E402

SEPARATOR = 2


# An experiment, not the library's initialisation: whether drawing each group of like parameters in one vectorised call
# (flax's values bit for bit) shortens the compile of `init` on a GPU, where RoBERTa-base's compiled for three minutes.
# On a CPU it gained nothing. It stands in for flax's Scope.param while it runs.
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


MODELS = ["roberta-padded", "roberta-documents", "gpt2-documents", "gemma3-window"]


def model_and_input(name: str, dtype):
    """(model, inputs, params) of a tiny model of each kind of attention, as tests/parity/test_fused_attention.py
    builds them (written again here so that the GPU machine needs neither pytest nor the tests' packages)."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(3, 500, size=(3, 16)).astype(np.int32)
    input_ids[:, [4, 11]] = SEPARATOR
    if name.startswith("roberta"):
        attention_mask = (np.arange(16)[None, :] < np.array([16, 9, 5])[:, None]).astype(np.int32)
        input_ids[attention_mask == 0] = 1
        config = transformers.RobertaConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=SEPARATOR,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        separator = SEPARATOR if name == "roberta-documents" else None
        model = roberta.MODEL_CLASS(config, dtype=dtype, document_separator_id=separator)
        inputs = (jnp.asarray(input_ids), jnp.asarray(attention_mask))
    elif name == "gpt2-documents":
        config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)  # fmt: skip
        model = gpt2.MODEL_CLASS(config, dtype=dtype, document_separator_id=SEPARATOR)
        inputs = (jnp.asarray(input_ids),)
    else:
        config = transformers.Gemma3TextConfig(
            vocab_size=512, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, intermediate_size=64, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        model = gemma.MODEL_CLASS(config, dtype=dtype)
        inputs = (jnp.asarray(input_ids),)
    return model, inputs, jax.jit(model.init)(jax.random.key(0), *inputs)["params"]


def report(**fields):
    print(json.dumps(fields), flush=True)


def relative_difference(value, reference):
    value, reference = np.asarray(value, np.float32), np.asarray(reference, np.float32)
    return float(np.abs(value - reference).max() / max(np.abs(reference).max(), 1e-30))


def logits_and_gradients_of(model, inputs):
    def loss(params):
        return model.apply({"params": params}, *inputs).astype(jnp.float32).mean()

    return lambda params: (model.apply({"params": params}, *inputs), jax.grad(loss)(params))


def check_attention(dry_run: bool):
    for name in MODELS:
        model, inputs, params = model_and_input(name, jnp.float32 if dry_run else jnp.bfloat16)
        logits_and_gradients = logits_and_gradients_of(model, inputs)
        fused = jax.jit(logits_and_gradients)(params)
        cudnn_used = "cudnn" in jax.jit(logits_and_gradients).lower(params).compile().as_text().lower()
        original = common.use_cudnn_attention, roberta.use_cudnn_attention
        common.use_cudnn_attention = roberta.use_cudnn_attention = lambda dtype: False
        try:
            written_out = jax.jit(logits_and_gradients_of(model, inputs))(params)  # traced anew
        finally:
            common.use_cudnn_attention, roberta.use_cudnn_attention = original
        gradient_differences = jax.tree_util.tree_map(relative_difference, fused[1], written_out[1])
        report(
            check="attention",
            model=name,
            cudnn_in_program=cudnn_used,
            logits_relative_difference=relative_difference(fused[0], written_out[0]),
            largest_gradient_relative_difference=max(jax.tree_util.tree_leaves(gradient_differences)),
        )


def flax_init(model, dummy_input):
    return nn.meta.unbox(model.init(jax.random.key(0), dummy_input, deterministic=True))


def check_init(dry_run: bool):
    layers, width, vocab, length = (2, 64, 512, 64) if dry_run else (12, 768, 50304, 512)
    models = {
        "roberta-base": roberta.MODEL_CLASS(
            transformers.RobertaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                                       num_attention_heads=width // 64, intermediate_size=4 * width,
                                       max_position_embeddings=length + 2, type_vocab_size=1, pad_token_id=1),
            dtype=jnp.bfloat16,
        ),
        "gpt2-124M": gpt2.MODEL_CLASS(
            transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=width // 64,
                                    n_positions=2 * length, bos_token_id=0, eos_token_id=0),
            dtype=jnp.bfloat16,
        ),
    }  # fmt: skip
    dummy_input = jnp.zeros((1, length), jnp.int32)
    for name, model in models.items():
        seconds = {}
        for way, init in (
            ("flax_init", partial(flax_init, model, dummy_input)),
            ("initial_params", partial(initial_params, model, 0, dummy_input)),
        ):
            start = time.perf_counter()
            jax.jit(init).lower().compile()
            seconds[way] = round(time.perf_counter() - start, 2)
        report(check="init_compile_seconds", model=name, **seconds)


def check_fp8(dry_run: bool):
    rows, inner, outer = (64, 32, 48) if dry_run else (32 * 1024, 768, 3072)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(inner, outer)) * 0.02, jnp.bfloat16)
    timings = {}
    for name, product in (("bf16", jnp.dot), ("fp8", fp8_product)):
        step = jax.jit(
            jax.value_and_grad(lambda x, w, product=product: product(x, w).astype(jnp.float32).sum(), (0, 1))
        )
        jax.block_until_ready(step(x, w))
        start = time.perf_counter()
        for _ in range(20):
            result = step(x, w)
        jax.block_until_ready(result)
        timings[name] = (time.perf_counter() - start) / 20
    hlo = jax.jit(jax.grad(lambda x, w: fp8_product(x, w).astype(jnp.float32).sum())).lower(x, w).compile().as_text()
    report(
        check="fp8",
        shape=[rows, inner, outer],
        supported=fp8_supported(jax.devices()[0]),
        relative_error=relative_difference(fp8_product(x, w), jnp.dot(x, w, preferred_element_type=jnp.float32)),
        bf16_ms=round(timings["bf16"] * 1e3, 3),
        fp8_ms=round(timings["fp8"] * 1e3, 3),
        fp8_cublas_call="f8" in hlo.lower() and "cublas" in hlo.lower(),
    )


def main():
    dry_run = "--dry_run" in sys.argv[1:]
    if jax.default_backend() != "gpu" and not dry_run:
        sys.exit("error: gpu_check.py measures on an NVIDIA GPU; on a CPU, pass --dry_run to check that it runs")
    check_attention(dry_run)
    check_init(dry_run)
    check_fp8(dry_run)


if __name__ == "__main__":
    main()
