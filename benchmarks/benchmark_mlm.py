#!/usr/bin/env python3
"""Throughput of run_mlm_flax.py: training tokens/s and model-FLOPs utilisation, host masking and preprocessing.

Training: the script's own train step (the Flax RoBERTa, AdamW, gradient clipping) on batches made and
masked by the script's BatchMaker from random tokens, already on the devices, so the number is the step's
speed, not the disk's. Model-FLOPs utilisation (MFU) divides the model's FLOPs per token (6 x parameters +
attention, as in the PaLM paper's appendix B; embedding lookups excluded; the LM head and its tied
vocabulary projection counted only at the positions it runs at, the room for predictions, about 30% of
them) by a matmul peak measured in the same run on the same devices and dtype
(benchmark_clm.matmul_peak_flops), so the ratio says how close the step comes to what this machine's
matmuls reach.

Host: how many tokens per second BatchMaker frames and masks with numpy, which must stay well above the
training speed since it runs on the host, one batch ahead of the step.

Preprocessing: the script's cached_blocks, grouped and with --line_by_line, each tokenizing and writing its
cache, against the raw `tokenizers` batch encoding of the same texts.

    python benchmarks/benchmark_mlm.py                          # the CPU target: 4 layers x 256, vocab 8192
    python benchmarks/benchmark_mlm.py --preset roberta-base    # RoBERTa-base, sequence 512, bfloat16 (a GPU)
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from transformers import RobertaConfig

from flax_lm.command_line.arguments import default_steps_per_call
from flax_lm.data.packed import cached_blocks
from flax_lm.data.source import TextSource
from flax_lm.devices.mesh import create_mesh
from flax_lm.models.model_code import load_model_code
from flax_lm.models.roberta.model import FlaxRobertaForMaskedLM
from flax_lm.training.lifecycle import set_up_training
from flax_lm.training.train_state import create_train_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark_clm import (  # noqa: E402  (same folder)
    byte_level_bpe,
    matmul_peak_flops,
    peak_device_memory_bytes,
    raw_encoding,
    stdlib_texts,
    write_jsonl,
)
from suite_shared import seconds_since_process_start  # noqa: E402

import run_mlm_flax  # noqa: E402

PRESETS = {
    # The CPU target: small enough for a 2-core laptop, big enough for matmuls to dominate.
    "cpu-small": dict(layers=4, width=256, heads=4, vocab_size=8192, seq_length=128, batch_size=16, dtype="float32"),
    # RoBERTa-base as published (12 layers, 768 wide, 12 heads, 50265 tokens padded to a multiple of 64).
    "roberta-base": dict(
        layers=12, width=768, heads=12, vocab_size=50304, seq_length=512, batch_size=32, dtype="bfloat16"
    ),
}
PAD_TOKEN_ID = 1  # RoBERTa's special tokens: <s>=0, <pad>=1, </s>=2, <unk>=3, <mask>=4


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="cpu-small")
    for name in ("layers", "width", "heads", "vocab_size", "seq_length", "batch_size"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the preset's compute dtype")
    parser.add_argument("--steps", type=int, default=10, help="training steps timed in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timing; the best round counts")
    parser.add_argument(
        "--steps_per_call", type=int, help="steps per compiled call, as run_mlm_flax.py's flag (default: its default)"
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability everywhere (RoBERTa uses 0.1)")
    parser.add_argument("--corpus_megabytes", type=float, default=8.0, help="text used for the preprocessing test")
    parser.add_argument("--skip_preprocessing", action="store_true")
    parser.add_argument(
        "--skip_matmul_peak",
        action="store_true",
        help="leave out the measured matmul peak and the MFU against it, which compile programs of their own "
        "(benchmarks/gpu_suite.py counts MFU against the card's published peak)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    arguments = parser.parse_args()
    settings = dict(PRESETS[arguments.preset])
    for name in settings:
        if getattr(arguments, name) is not None:
            settings[name] = getattr(arguments, name)
    return arguments, settings


def random_blocks(settings, count: int) -> np.ndarray:
    """Grouped-mode examples of random ordinary tokens (ids past the 5 special tokens)."""
    shape = (count, settings["seq_length"] - 2)
    return np.random.default_rng(0).integers(5, settings["vocab_size"], size=shape, dtype=np.int32)


def batch_maker(settings) -> run_mlm_flax.BatchMaker:
    return run_mlm_flax.BatchMaker(
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=PAD_TOKEN_ID,
        mask_token_id=4,
        special_token_ids=(0, 1, 2, 3, 4),
        random_token_count=settings["vocab_size"],
        mlm_probability=0.15,
        max_seq_length=settings["seq_length"],
    )


def benchmark_training(settings, arguments) -> dict:
    config = RobertaConfig(
        vocab_size=settings["vocab_size"],
        hidden_size=settings["width"],
        num_hidden_layers=settings["layers"],
        num_attention_heads=settings["heads"],
        intermediate_size=4 * settings["width"],
        max_position_embeddings=settings["seq_length"] + PAD_TOKEN_ID + 1,
        type_vocab_size=1,
        hidden_dropout_prob=arguments.dropout,
        attention_probs_dropout_prob=arguments.dropout,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=0,
        eos_token_id=2,
        layer_norm_eps=1e-5,
    )
    dtype = jnp.dtype(settings["dtype"])
    model = FlaxRobertaForMaskedLM(config, dtype=dtype, mesh=create_mesh())
    # The script's own set-up: mesh, optimizer, state shardings and the compiled train step.
    per_device_batch_size, remainder = divmod(settings["batch_size"], jax.device_count())
    if remainder or not per_device_batch_size:
        raise SystemExit("error: the batch size must be a multiple of the number of devices")
    steps_per_call = arguments.steps_per_call or default_steps_per_call()
    training_arguments = run_mlm_flax.TrainingArguments(
        output_dir="unused",
        do_train=True,
        max_steps=10_000,
        learning_rate=3e-4,
        weight_decay=0.01,
        per_device_train_batch_size=per_device_batch_size,
        steps_per_call=steps_per_call,
    )
    eval_step = run_mlm_flax.make_eval_step(model)
    model_code = load_model_code(config, None, False, "benchmark_mlm.py")
    script = run_mlm_flax.SCRIPT_TRAINING
    setup = set_up_training(
        model, model_code, script, eval_step, training_arguments.training_settings(), None, settings["seq_length"]
    )
    dummy_input = jnp.zeros((1, settings["seq_length"]), jnp.int32)
    state = create_train_state(model, setup.optimizer, setup.abstract_state, 0, dummy_input)
    train_steps = setup.compiled_train_steps
    blocks = random_blocks(settings, settings["batch_size"])
    batch = batch_maker(settings)(blocks, np.arange(len(blocks)), len(blocks), (0,))
    # The batches of one compiled call, (steps_per_call, 1, batch, ...): the same batch for every step, as one
    # micro-batch, as the script passes a step without gradient accumulation.
    batches = {
        name: jax.device_put(np.broadcast_to(values, (steps_per_call, 1, *values.shape)), setup.call_batches_sharding)
        for name, values in batch.items()
    }

    compile_start = time.perf_counter()
    state, metrics = train_steps(state, batches, steps_per_call)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - compile_start
    first_step_seconds = seconds_since_process_start()
    peak_memory_bytes = peak_device_memory_bytes()  # the step's high-water mark: the first call ran a whole step

    # Steps and the matmul peak are timed in alternating rounds and the best of each kept, so that a
    # moment of load from other programs on the machine does not skew their ratio.
    step_seconds, peak = float("inf"), 0.0
    calls = math.ceil(arguments.steps / steps_per_call)
    for _ in range(arguments.rounds):
        start = time.perf_counter()
        for _ in range(calls):
            state, metrics = train_steps(state, batches, steps_per_call)
        jax.block_until_ready(metrics)
        step_seconds = min(step_seconds, (time.perf_counter() - start) / (calls * steps_per_call))
        if not arguments.skip_matmul_peak:
            peak = max(peak, matmul_peak_flops(dtype))

    def count(tree):
        return sum(leaf.size for leaf in jax.tree_util.tree_leaves(tree))

    # The encoder runs at every position, the LM head (with the tied word embeddings as its output layer)
    # only at the room left for predictions; embedding lookups are not matmuls and are left out.
    parameters = count(state.params)
    head_parameters = count(state.params["lm_head"]) + config.vocab_size * config.hidden_size
    head_fraction = batch["masked_positions"].shape[1] / settings["seq_length"]
    attention_flops = 12 * config.num_hidden_layers * config.hidden_size * settings["seq_length"]
    flops_per_token = (
        6 * count(state.params["roberta"]["encoder"]) + 6 * head_parameters * head_fraction + attention_flops
    )
    tokens_per_second = settings["batch_size"] * settings["seq_length"] / step_seconds
    results = {
        "parameters": parameters,
        "lm_head_fraction_of_positions": head_fraction,
        "step_seconds": step_seconds,
        "compile_seconds": compile_seconds,
        "seconds_to_first_step": first_step_seconds,
        "peak_memory_bytes": peak_memory_bytes,
        "train_tokens_per_second": tokens_per_second,
        "model_tflops_per_second": tokens_per_second * flops_per_token / 1e12,
        "steps_per_call": steps_per_call,
        "final_loss": float(metrics["loss_sum"][-1] / metrics["weight_sum"][-1]),
    }
    if not arguments.skip_matmul_peak:
        results |= {"matmul_peak_tflops_per_second": peak / 1e12, "mfu": tokens_per_second * flops_per_token / peak}
    return results


def benchmark_host_masking(settings) -> dict:
    """Tokens per second that BatchMaker frames and masks, one global batch at a time, in grouped mode."""
    blocks = random_blocks(settings, 64 * settings["batch_size"])
    make_batch = batch_maker(settings)
    start = time.perf_counter()
    for step in range(64):
        indices = np.arange(step * settings["batch_size"], (step + 1) * settings["batch_size"])
        make_batch(blocks, indices, len(indices), (0, step))
    seconds = time.perf_counter() - start
    return {"masking_tokens_per_second": 64 * settings["batch_size"] * settings["seq_length"] / seconds}


def benchmark_preprocessing(arguments, vocab_size: int, seq_length: int) -> dict:
    """Raw tokenizer batch encoding vs the script's tokenize + group + cache and tokenize lines + cache."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    texts, size = stdlib_texts(arguments.corpus_megabytes)
    backend = byte_level_bpe(texts, vocab_size, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    )

    with tempfile.TemporaryDirectory() as directory:
        data_file = write_jsonl(texts, directory)
        dataset = datasets.load_dataset("json", data_files=data_file, cache_dir=directory, split="train")
        num_tokens, raw_seconds = raw_encoding(backend, texts)  # one separator per text joins them

        start = time.perf_counter()
        rows, lines = run_mlm_flax.tokenized_rows, partial(run_mlm_flax.tokenized_rows, line_by_line=True)
        arguments = (tokenizer, seq_length - 2, directory, TextSource())
        blocks = cached_blocks(dataset, "benchmark", rows, *arguments, framing="grouped", overwrite=True)
        grouped_seconds = time.perf_counter() - start
        start = time.perf_counter()
        cached_blocks(dataset, "benchmark", rows, *arguments, framing="grouped")
        cached_seconds = time.perf_counter() - start

        start = time.perf_counter()
        cached_blocks(dataset, "benchmark", lines, *arguments, framing="line_by_line", overwrite=True)
        lines_seconds = time.perf_counter() - start
    return {
        "corpus_megabytes": size / 1e6,
        "tokens": num_tokens,
        "raw_tokenizer_tokens_per_second": num_tokens / raw_seconds,
        "grouped_tokens_per_second": num_tokens / grouped_seconds,
        "grouped_fraction_of_raw": raw_seconds / grouped_seconds,
        "line_by_line_tokens_per_second": num_tokens / lines_seconds,
        "cached_load_seconds": cached_seconds,
        "blocks": int(len(blocks)),
    }


def main():
    arguments, settings = parse_arguments()
    import datasets

    datasets.disable_progress_bars()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; settings: {settings}")
    results = {
        "settings": settings,
        "devices": [str(device) for device in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }
    results["training"] = training = benchmark_training(settings, arguments)
    print(
        f"training: {training['train_tokens_per_second']:,.0f} tokens/s, "
        f"{training['step_seconds'] * 1000:.1f} ms/step in calls of {training['steps_per_call']} steps, "
        f"{training['model_tflops_per_second']:.3f} model TFLOP/s "
        f"({training['parameters'] / 1e6:.1f}M parameters, compiled in {training['compile_seconds']:.1f} s), "
        f"peak memory {training['peak_memory_bytes'] / 1e9:.2f} GB"
    )
    if not arguments.skip_matmul_peak:
        print(
            f"of a measured matmul peak of {training['matmul_peak_tflops_per_second']:.3f} TFLOP/s: "
            f"MFU {training['mfu']:.1%}"
        )
    if training["seconds_to_first_step"] is not None:
        print(
            f"time to first step: {training['seconds_to_first_step']:.1f} s from the process's start to the end "
            "of the first call (imports, set-up, compilation)"
        )
    results["host"] = host = benchmark_host_masking(settings)
    print(
        f"host masking: {host['masking_tokens_per_second']:,.0f} tokens/s "
        "(framing, padding and masking batches in numpy)"
    )
    if not arguments.skip_preprocessing:
        results["preprocessing"] = preprocessing = benchmark_preprocessing(
            arguments, min(settings["vocab_size"], 8192), settings["seq_length"]
        )
        print(
            f"preprocessing: grouped {preprocessing['grouped_tokens_per_second']:,.0f} tokens/s for tokenize + pack + "
            f"cache ({preprocessing['grouped_fraction_of_raw']:.0%} of the raw tokenizer's "
            f"{preprocessing['raw_tokenizer_tokens_per_second']:,.0f} tokens/s), line_by_line "
            f"{preprocessing['line_by_line_tokens_per_second']:,.0f} tokens/s "
            f"({preprocessing['corpus_megabytes']:.1f} MB, {preprocessing['tokens']:,} tokens); "
            f"a cached rerun loads in {preprocessing['cached_load_seconds']:.2f} s"
        )
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
