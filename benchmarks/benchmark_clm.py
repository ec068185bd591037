#!/usr/bin/env python3
"""Throughput of run_clm_flax.py: training tokens/s and model-FLOPs utilisation, and preprocessing tokens/s.

Training: the script's own train step (the Flax GPT-2, AdamW, gradient clipping, dropout) on random
tokens already on the devices, so the number is the step's speed, not the disk's. Model-FLOPs
utilisation (MFU) divides the model's FLOPs (6 x parameters + attention, per token, as in the PaLM
paper's appendix B; position embeddings excluded) by a matmul peak measured in the same run on the same
devices and dtype, so the ratio says how close the step comes to what this machine's matmuls reach.
The step's matrix products are also timed alone, at the step's own shapes: their share of the peak is
the most MFU such shapes allow, and the rest of the gap is the work between the products (softmax,
layer norms, GELU, the optimizer, layout copies). The peak memory is read after the first step: a GPU's
peak_bytes_in_use, or on a CPU the process's peak resident memory.

Preprocessing: the script's cached_blocks (tokenize, join with EOS, pack into blocks, write the packed
cache) against the raw `tokenizers` batch encoding of the same texts, both timed in this run; and the
same texts read as a stream, tokenized and packed on the fly as --streaming does.

    python benchmarks/benchmark_clm.py                  # the CPU target: 4 layers x 256, vocab 8192
    python benchmarks/benchmark_clm.py --preset nanogpt-laptop  # nanoGPT's baby GPT: 4 x 4 x 128, block 64
    python benchmarks/benchmark_clm.py --preset gpt2    # GPT-2 124M, sequence 1024, bfloat16 (for a GPU)
    python benchmarks/benchmark_clm.py --model_type llama  # a Llama of the preset's shape (SwiGLU, rotary, GQA)
    python benchmarks/benchmark_clm.py --model_type llama --packed_examples  # fine-tuning on packed examples
    python benchmarks/benchmark_clm.py --model_type qwen3_moe --experts 8 --experts_per_token 2  # a Qwen3-MoE

With --model_type llama the preset's layers, width and heads make a Llama whose MLP has 3 x 8/3 of the width (rounded
up to a multiple of 64) where GPT-2's has 2 x 4: about GPT-2's parameters, less its position table. With
--model_type qwen3_moe each layer's MLP is --experts experts of --expert_intermediate_size (default: the Llama's MLP
width over --experts_per_token, so a token meets the Llama's MLP weights), --experts_per_token of them per token by
Qwen3-MoE's renormalised softmax routing, its load-balancing loss (coefficient 0.001) in the loss: MFU counts the
weights a token meets.
"""

import argparse
import glob
import itertools
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from transformers import GPT2Config, LlamaConfig, Qwen3MoeConfig

from flax_lm.command_line.arguments import default_steps_per_call
from flax_lm.data.packed import cached_blocks
from flax_lm.data.source import TextSource
from flax_lm.data.texts import token_arrays
from flax_lm.devices.mesh import create_mesh
from flax_lm.models.model_code import load_model_code
from flax_lm.training.lifecycle import set_up_training
from flax_lm.training.train_state import create_train_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from suite_shared import (  # noqa: E402  (same folder)
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    packed_example_rows,
    peak_resident_bytes,
    seconds_since_process_start,
)

import run_clm_flax  # noqa: E402

PRESETS = {
    # The CPU target: small enough for a 2-core laptop, big enough for matmuls to dominate.
    "cpu-small": dict(layers=4, width=256, heads=4, vocab_size=8192, block_size=128, batch_size=16, dtype="float32"),
    # The "baby GPT" of nanoGPT's README for a laptop (shakespeare_char: 65 characters, 4 layers x 4 heads x 128,
    # block 64, batch 12, no dropout), where the time between the matrix products weighs most.
    "nanogpt-laptop": dict(layers=4, width=128, heads=4, vocab_size=65, block_size=64, batch_size=12, dtype="float32"),
    # GPT-2 124M as published (12 layers, 768 wide, 12 heads, 50257 tokens padded to a multiple of 64).
    "gpt2": dict(layers=12, width=768, heads=12, vocab_size=50304, block_size=1024, batch_size=32, dtype="bfloat16"),
}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="cpu-small")
    parser.add_argument(
        "--model_type", choices=["gpt2", "llama", "qwen3_moe"], default="gpt2", help="the model of the preset's shape"
    )
    parser.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts in each layer")
    parser.add_argument("--experts_per_token", type=int, default=2, help="qwen3_moe: the experts each token reaches")
    parser.add_argument(
        "--expert_intermediate_size", type=int, help="qwen3_moe: an expert's MLP width (default: see above)"
    )
    parser.add_argument("--key_value_heads", type=int, help="llama: key/value heads (default: as many as heads)")
    parser.add_argument("--intermediate_size", type=int, help="llama: the MLP's width (default: 8/3 of the width)")
    for name in ("layers", "width", "heads", "vocab_size", "block_size", "batch_size"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the preset's compute dtype")
    parser.add_argument("--steps", type=int, default=10, help="training steps timed in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timing; the best round counts")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability everywhere (GPT-2 uses 0.1)")
    parser.add_argument("--param_dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--fp8", action="store_true", help="the dense layers' products in FP8, as run_clm_flax.py's flag"
    )
    parser.add_argument(
        "--gradient_checkpointing",
        metavar="POLICY",
        help="recompute activations in the backward pass, as run_clm_flax.py's flag: a jax.checkpoint_policies name",
    )
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--steps_per_call", type=int, help="steps per compiled call, as run_clm_flax.py's flag (default: its default)"
    )
    parser.add_argument("--mesh_shape", help="e.g. data=2,fsdp=2,tensor=2 (default: all devices on data)")
    parser.add_argument("--corpus_megabytes", type=float, default=8.0, help="text used for the preprocessing test")
    parser.add_argument("--skip_training", action="store_true", help="only time the preprocessing")
    parser.add_argument("--skip_preprocessing", action="store_true", help="only time the training step")
    parser.add_argument(
        "--packed_examples",
        action="store_true",
        help="train as run_clm_flax.py --packing --completion_only_loss fine-tunes: on rows of prompt/completion "
        "examples packed whole (random ids), the loss on the completions, each example attending only to itself",
    )
    parser.add_argument(
        "--skip_matmul_peak",
        action="store_true",
        help="leave out the measured matmul peak, the MFU against it, the shapes' ceiling and the memory analysis, "
        "which compile programs of their own (benchmarks/gpu_suite.py counts MFU against the card's published peak)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--profile_dir",
        help="also trace the timed steps' calls once more with jax.profiler into this directory (TensorBoard's "
        "profile plugin reads it; a Perfetto trace, perfetto_trace.json.gz, is written beside it)",
    )
    arguments = parser.parse_args()
    settings = dict(PRESETS[arguments.preset])
    for name in settings:
        if getattr(arguments, name) is not None:
            settings[name] = getattr(arguments, name)
    return arguments, settings


def time_calls(function, *arguments, repeats: int):
    jax.block_until_ready(function(*arguments))  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        result = function(*arguments)
    jax.block_until_ready(result)
    return (time.perf_counter() - start) / repeats


def matmul_peak_flops(dtype) -> float:
    """The best FLOP/s of square matmuls on all devices at once (each device multiplies its own pair)."""
    mesh = create_mesh()
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    on_gpu = jax.devices()[0].platform == "gpu"
    best = 0.0
    for size in (4096, 8192) if on_gpu else (512, 1024, 2048):
        shape = (jax.device_count(), size, size)
        a = jax.device_put(jnp.ones(shape, dtype), sharding)
        b = jax.device_put(jnp.ones(shape, dtype), sharding)
        matmul = jax.jit(lambda a, b: jnp.einsum("dij,djk->dik", a, b, preferred_element_type=dtype))
        seconds = time_calls(matmul, a, b, repeats=10 if on_gpu else 3)
        best = max(best, 2 * size**3 * jax.device_count() / seconds)
    return best


def projection_shapes(config) -> list[tuple[int, int]]:
    """(fan in, fan out) of each matrix product of the layers, as the model multiplies them, and of the LM head."""
    width = config.hidden_size
    if config.model_type == "gpt2":
        inner = config.n_inner or 4 * width
        layer = [(width, 3 * width), (width, width), (width, inner), (inner, width)]
    else:
        heads_width = config.num_attention_heads * config.head_dim
        key_value_width = config.num_key_value_heads * config.head_dim
        layer = [(width, heads_width), (width, key_value_width), (width, key_value_width), (heads_width, width)]
        if config.model_type == "qwen3_moe":  # the router, and each token's experts side by side
            inner = config.num_experts_per_tok * config.moe_intermediate_size
            layer += [(width, config.num_experts)]
        else:
            inner = config.intermediate_size
        layer += [(width, inner), (width, inner), (inner, width)]
    return layer * config.num_hidden_layers + [(width, config.vocab_size)]


def attention_width(config) -> int:
    """The width of the queries of all heads together."""
    if config.model_type == "gpt2":
        return config.hidden_size
    return config.num_attention_heads * config.head_dim


def step_matmul_flops(settings, config, dtype) -> float:
    """FLOP/s of the train step's own matrix products alone, at a data-parallel device's shapes, on all devices at
    once (as the peak is measured: forced CPU devices share the cores): every projection, the attention products
    and the LM head, forward and both gradients, with nothing else in between. Its ratio to the peak is the most
    MFU that matmuls of these shapes allow."""
    tokens = settings["batch_size"] * settings["block_size"] // jax.device_count()
    heads, length = config.num_attention_heads, settings["block_size"]
    head_dim = attention_width(config) // heads
    projections = projection_shapes(config)
    rows = tokens // length
    keys = (jax.random.fold_in(jax.random.key(0), number) for number in itertools.count())

    every_device = jax.sharding.NamedSharding(create_mesh(), jax.sharding.PartitionSpec("data"))

    def normal(*shape):  # one array of `shape` on each device
        return jax.device_put(jax.random.normal(next(keys), (jax.device_count(), *shape), dtype), every_device)

    inputs = [normal(tokens, fan_in) for fan_in, _ in projections]
    weights = [normal(fan_in, fan_out) for fan_in, fan_out in projections]
    attention = [normal(config.num_hidden_layers, rows, heads, length, head_dim) for _ in range(3)]

    def products(inputs, weights, queries, keys, values):
        scores = jnp.einsum("lbhqd,lbhkd->lbhqk", queries, keys, preferred_element_type=dtype)
        return [x @ w for x, w in zip(inputs, weights)], jnp.einsum("lbhqk,lbhkd->lbhqd", scores, values)

    def forward_and_gradients(arguments, output_gradients):
        outputs, gradients_of = jax.vjp(products, *arguments)
        return outputs, gradients_of(output_gradients)

    arguments = (inputs, weights, *attention)
    output_shapes = jax.eval_shape(jax.vmap(products), *arguments)
    output_gradients = jax.tree_util.tree_map(lambda out: normal(*out.shape[1:]), output_shapes)
    seconds = time_calls(jax.jit(jax.vmap(forward_and_gradients)), arguments, output_gradients, repeats=3)
    flops = 3 * sum(2 * tokens * fan_in * fan_out for fan_in, fan_out in projections)
    flops += 3 * 2 * 2 * config.num_hidden_layers * rows * length * length * attention_width(config)
    return flops * jax.device_count() / seconds


def model_config(settings, arguments):
    """The preset's GPT-2, or a Llama of its layers, width and heads (see the module's docstring)."""
    if arguments.model_type == "gpt2":
        dropout = arguments.dropout
        return GPT2Config(
            vocab_size=settings["vocab_size"], n_positions=settings["block_size"], n_embd=settings["width"],
            n_layer=settings["layers"], n_head=settings["heads"], resid_pdrop=dropout, embd_pdrop=dropout,
            attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if arguments.dropout:
        raise SystemExit(f"error: the {arguments.model_type} model has no dropout; leave --dropout out")
    shape = dict(
        vocab_size=settings["vocab_size"], max_position_embeddings=settings["block_size"],
        hidden_size=settings["width"], num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
        num_key_value_heads=arguments.key_value_heads or settings["heads"],
        tie_word_embeddings=True, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
    )  # fmt: skip
    intermediate_size = arguments.intermediate_size or math.ceil(8 * settings["width"] / 3 / 64) * 64
    if arguments.model_type == "llama":
        return LlamaConfig(**shape, intermediate_size=intermediate_size)
    if not 0 < arguments.experts_per_token <= arguments.experts:
        raise SystemExit("error: --experts_per_token must be between 1 and --experts")
    return Qwen3MoeConfig(
        **shape, head_dim=settings["width"] // settings["heads"], num_experts=arguments.experts,
        num_experts_per_tok=arguments.experts_per_token,
        moe_intermediate_size=arguments.expert_intermediate_size or intermediate_size // arguments.experts_per_token,
        norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001,
    )  # fmt: skip


def global_batches(settings, arguments, config, steps_per_call: int) -> dict:
    """The global batches of one compiled call, each step's batch as gradient_accumulation_steps micro-batches:
    random tokens, or with --packed_examples the same packed rows in every step with their loss weights."""
    accumulation = arguments.gradient_accumulation_steps
    shape = (steps_per_call, accumulation, settings["batch_size"] // accumulation, settings["block_size"])
    if not arguments.packed_examples:
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=shape, dtype=np.int32)
        return {"input_ids": tokens}
    rows = packed_example_rows(settings["batch_size"], settings["block_size"], config.vocab_size)
    return {name: np.broadcast_to(rows[name].reshape(shape[1:]), shape) for name in ("input_ids", "weights")}


def benchmark_training(settings, arguments) -> dict:
    config = model_config(settings, arguments)
    dtype = jnp.dtype(settings["dtype"])
    mesh = create_mesh(arguments.mesh_shape)
    if arguments.packed_examples and arguments.model_type != "llama":
        raise SystemExit("error: --packed_examples packs examples that begin with a BOS: add --model_type llama")
    model_code = load_model_code(config, None, True, "benchmark_clm.py", mesh)
    model = model_code.module.MODEL_CLASS(
        config,
        dtype=dtype,
        param_dtype=jnp.dtype(arguments.param_dtype),
        remat_policy=arguments.gradient_checkpointing,
        mesh=mesh,
        # Packed examples are documents: each attends only to itself, from the BOS that starts it.
        document_separator_id=BOS_TOKEN_ID if arguments.packed_examples else None,
    )
    # The script's own set-up: mesh, optimizer, state shardings and the compiled train step.
    accumulation = arguments.gradient_accumulation_steps
    per_device_batch_size, remainder = divmod(settings["batch_size"], jax.device_count() * accumulation)
    if remainder or not per_device_batch_size:
        raise SystemExit("error: the batch size must be a multiple of the devices times --gradient_accumulation_steps")
    steps_per_call = arguments.steps_per_call or default_steps_per_call()
    training_arguments = run_clm_flax.TrainingArguments(
        output_dir="unused",
        do_train=True,
        max_steps=10_000,
        learning_rate=3e-4,
        weight_decay=0.1,
        per_device_train_batch_size=per_device_batch_size,
        gradient_accumulation_steps=accumulation,
        steps_per_call=steps_per_call,
        mesh_shape=arguments.mesh_shape,
        fp8=arguments.fp8,
    )
    eval_step = run_clm_flax.make_eval_step(model, None)
    script = run_clm_flax.SCRIPT_TRAINING
    setup = set_up_training(
        model, model_code, script, eval_step, training_arguments.training_settings(), None, settings["block_size"]
    )
    dummy_input = jnp.zeros((1, settings["block_size"]), jnp.int32)
    state = create_train_state(model, setup.optimizer, setup.abstract_state, 0, dummy_input)
    train_steps = setup.compiled_train_steps
    batches = jax.device_put(global_batches(settings, arguments, config, steps_per_call), setup.call_batches_sharding)

    # The first call runs steps_per_call steps, as in the script: its end is the time to the first step.
    compile_start = time.perf_counter()
    state, metrics = train_steps(state, batches, steps_per_call)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - compile_start
    first_step_seconds = seconds_since_process_start()
    peak_memory_bytes = peak_device_memory_bytes()  # the step's high-water mark: the first call ran a whole step
    parameters = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state.params))
    timing = time_training(train_steps, state, batches, steps_per_call, settings, config, arguments)
    tokens_per_second = settings["batch_size"] * settings["block_size"] / timing["step_seconds"]
    results = {
        "parameters": parameters,
        "peak_memory_bytes": peak_memory_bytes,
        "compile_seconds": compile_seconds,
        "seconds_to_first_step": first_step_seconds,
        "train_tokens_per_second": tokens_per_second,
        "steps_per_call": steps_per_call,
        "final_loss": float(timing["metrics"]["loss_sum"][-1] / timing["metrics"]["token_count"][-1]),
        "step_seconds": timing["step_seconds"],
    }
    if arguments.skip_matmul_peak:
        return results
    return results | matmul_diagnostics(settings, config, parameters, timing, tokens_per_second)


def peak_device_memory_bytes() -> int:
    """The most memory the first device's allocator has held (a GPU's peak_bytes_in_use); on a CPU, which keeps no
    such count, the process's peak resident memory."""
    stats = jax.devices()[0].memory_stats()
    return stats["peak_bytes_in_use"] if stats and "peak_bytes_in_use" in stats else peak_resident_bytes()


def time_training(train_steps, state, batches, steps_per_call: int, settings, config, arguments) -> dict:
    """The best seconds a step of --rounds rounds of --steps steps (with the measured matmul peak and the step's own
    products timed between them, unless --skip_matmul_peak), the last metrics, and the compiled program's memory."""
    memory = None
    if not arguments.skip_matmul_peak:
        memory = train_steps.lower(state, batches, steps_per_call).compile().memory_analysis()

    # Steps and the matmul peak are timed in alternating rounds and the best of each kept, so that a
    # moment of load from other programs on the machine does not skew their ratio.
    step_seconds, peak, step_matmuls = float("inf"), 0.0, 0.0
    calls = math.ceil(arguments.steps / steps_per_call)
    dtype = jnp.dtype(settings["dtype"])
    for _ in range(arguments.rounds):
        start = time.perf_counter()
        for _ in range(calls):
            state, metrics = train_steps(state, batches, steps_per_call)
        jax.block_until_ready(metrics)
        step_seconds = min(step_seconds, (time.perf_counter() - start) / (calls * steps_per_call))
        if not arguments.skip_matmul_peak:
            peak = max(peak, matmul_peak_flops(dtype))
            step_matmuls = max(step_matmuls, step_matmul_flops(settings, config, dtype))
    if arguments.profile_dir:
        with jax.profiler.trace(arguments.profile_dir, create_perfetto_trace=True):
            for _ in range(calls):
                state, metrics = train_steps(state, batches, steps_per_call)
            jax.block_until_ready(metrics)
    return {
        "step_seconds": step_seconds,
        "metrics": metrics,
        "peak": peak,
        "step_matmuls": step_matmuls,
        "memory": memory,
    }


def matmul_diagnostics(settings, config, parameters: int, timing: dict, tokens_per_second: float) -> dict:
    """MFU against the matmul peak measured in this run, how much of it the step's own products reach, and the
    compiled step's memory."""
    peak, step_matmuls, memory = timing["peak"], timing["step_matmuls"], timing["memory"]
    # Tables only looked up are no products: GPT-2's positions, an embedding apart from the output layer.
    looked_up = config.hidden_size * (config.max_position_embeddings if config.model_type == "gpt2" else 0)
    looked_up += 0 if config.tie_word_embeddings else config.hidden_size * config.vocab_size
    if config.model_type == "qwen3_moe":  # the experts a token does not reach do not multiply it
        idle_experts = config.num_experts - config.num_experts_per_tok
        looked_up += config.num_hidden_layers * idle_experts * 3 * config.hidden_size * config.moe_intermediate_size
    matmul_parameters = parameters - looked_up
    attention_flops = 12 * config.num_hidden_layers * attention_width(config) * settings["block_size"]
    flops_per_token = 6 * matmul_parameters + attention_flops
    return {
        # Per device: the state (arguments) and what the step needs besides (activations, temporaries).
        "state_megabytes_per_device": memory.argument_size_in_bytes / 1e6 if memory else None,
        "temporary_megabytes_per_device": memory.temp_size_in_bytes / 1e6 if memory else None,
        "model_tflops_per_second": tokens_per_second * flops_per_token / 1e12,
        "matmul_peak_tflops_per_second": peak / 1e12,
        "mfu": tokens_per_second * flops_per_token / peak,
        "step_matmuls_fraction_of_peak": step_matmuls / peak,
        "mfu_fraction_of_shapes_ceiling": tokens_per_second * flops_per_token / step_matmuls,
    }


def stdlib_texts(megabytes: float) -> tuple[list[str], int]:
    """The Python standard library's source files, about `megabytes` of them, and their size in bytes."""
    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    texts, size = [], 0
    for path in sources:
        with open(path, encoding="utf-8", errors="replace") as file:
            texts.append(file.read())
        size += len(texts[-1].encode())
        if size >= megabytes * 1e6:
            break
    return texts, size


def byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE tokenizer (the `tokenizers` object) trained on the first 200 texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts[:200], trainer)
    return backend


def write_jsonl(texts: list[str], directory: str) -> str:
    """The texts as a JSON-lines file in `directory`, one {"text": ...} per line; its path."""
    path = os.path.join(directory, "texts.jsonl")
    with open(path, "w") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    return path


def raw_encoding(backend, texts: list[str]) -> tuple[int, float]:
    """Tokens (one separator per text included) and seconds of the raw `tokenizers` batch encoding of the
    texts, in the same batches of 1000 texts as the scripts' pipelines."""
    start = time.perf_counter()
    num_tokens = len(texts)
    for index in range(0, len(texts), 1000):
        encodings = backend.encode_batch(texts[index : index + 1000], add_special_tokens=False)
        num_tokens += sum(len(encoding.ids) for encoding in encodings)
    return num_tokens, time.perf_counter() - start


def benchmark_preprocessing(arguments, vocab_size: int) -> dict:
    """Raw tokenizer batch encoding vs the script's whole tokenize + pack + cache, on the same texts."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    texts, size = stdlib_texts(arguments.corpus_megabytes)
    backend = byte_level_bpe(texts, vocab_size, ["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")

    with tempfile.TemporaryDirectory() as directory:
        data_file = write_jsonl(texts, directory)
        dataset = datasets.load_dataset("json", data_files=data_file, cache_dir=directory, split="train")
        num_tokens, raw_seconds = raw_encoding(backend, texts)  # one EOS per text joins them

        start = time.perf_counter()
        pack = partial(
            cached_blocks, dataset, "benchmark", run_clm_flax.tokenized_rows, tokenizer, 128, directory, TextSource()
        )
        blocks = pack(framing="grouped", overwrite=True)
        pipeline_seconds = time.perf_counter() - start

        start = time.perf_counter()
        pack(framing="grouped")
        cached_seconds = time.perf_counter() - start

        stream = datasets.load_dataset("json", data_files=data_file, split="train", streaming=True)
        start = time.perf_counter()
        streamed_blocks = sum(
            len(blocks) for blocks in run_clm_flax.pack_blocks(token_arrays(stream, tokenizer, "text"), 128)
        )
        streaming_seconds = time.perf_counter() - start
        assert streamed_blocks == len(blocks)
    return {
        "corpus_megabytes": size / 1e6,
        "tokens": num_tokens,
        "raw_tokenizer_tokens_per_second": num_tokens / raw_seconds,
        "pipeline_tokens_per_second": num_tokens / pipeline_seconds,
        "pipeline_fraction_of_raw": raw_seconds / pipeline_seconds,
        "cached_load_seconds": cached_seconds,
        "streaming_tokens_per_second": num_tokens / streaming_seconds,
        "streaming_fraction_of_raw": raw_seconds / streaming_seconds,
        "blocks": int(len(blocks)),
    }


def main():
    arguments, settings = parse_arguments()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; settings: {settings}")
    results = {
        "settings": settings,
        "devices": [str(device) for device in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }
    if not arguments.skip_training:
        results["training"] = benchmark_training(settings, arguments)
        training = results["training"]
        print(
            f"training: {training['train_tokens_per_second']:,.0f} tokens/s, "
            f"{training['step_seconds'] * 1000:.1f} ms/step in calls of {training['steps_per_call']} steps "
            f"({training['parameters'] / 1e6:.1f}M parameters, compiled in {training['compile_seconds']:.1f} s), "
            f"peak memory {training['peak_memory_bytes'] / 1e9:.2f} GB"
        )
        if not arguments.skip_matmul_peak:
            print(
                f"{training['model_tflops_per_second']:.3f} model TFLOP/s of a measured matmul peak of "
                f"{training['matmul_peak_tflops_per_second']:.3f} TFLOP/s: MFU {training['mfu']:.1%}; the step's "
                f"matrix products alone, at its shapes, run at {training['step_matmuls_fraction_of_peak']:.1%} of "
                f"the peak: the most MFU these shapes allow; the step reaches "
                f"{training['mfu_fraction_of_shapes_ceiling']:.0%} of it"
            )
        if training["seconds_to_first_step"] is not None:
            print(
                f"time to first step: {training['seconds_to_first_step']:.1f} s from the process's start to the end "
                "of the first call (imports, set-up, compilation)"
            )
        if training.get("temporary_megabytes_per_device") is not None:
            print(
                f"memory per device: {training['state_megabytes_per_device']:.1f} MB of state and batch, "
                f"{training['temporary_megabytes_per_device']:.1f} MB of activations and temporaries"
            )
    if not arguments.skip_preprocessing:
        import datasets

        datasets.disable_progress_bars()
        results["preprocessing"] = benchmark_preprocessing(arguments, min(settings["vocab_size"], 8192))
        preprocessing = results["preprocessing"]
        print(
            f"preprocessing: {preprocessing['pipeline_tokens_per_second']:,.0f} tokens/s for tokenize + pack + cache, "
            f"{preprocessing['pipeline_fraction_of_raw']:.0%} of the raw tokenizer's "
            f"{preprocessing['raw_tokenizer_tokens_per_second']:,.0f} tokens/s "
            f"({preprocessing['corpus_megabytes']:.1f} MB, {preprocessing['tokens']:,} tokens); "
            f"a cached rerun loads in {preprocessing['cached_load_seconds']:.2f} s"
        )
        print(
            f"streaming: {preprocessing['streaming_tokens_per_second']:,.0f} tokens/s read, tokenized and packed on "
            f"the fly, {preprocessing['streaming_fraction_of_raw']:.0%} of the raw tokenizer"
        )
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
