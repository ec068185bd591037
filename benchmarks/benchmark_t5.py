#!/usr/bin/env python3
"""Throughput of run_t5_mlm_flax.py: training tokens/s and model-FLOPs utilisation at a T5 shape, and the speed of
the span corruption on the host.

Training: the script's own train step (the Flax T5, Adafactor as the script's default) on batches that the script's
BatchMaker corrupts from random tokens, already on the devices, so the number is the step's speed, not the disk's.
Tokens are those of text: a row of --max_seq_length input tokens is corrupted from a longer row of text (568 tokens
for 512), the length the Hugging Face example calls expanded_inputs_length; the input and target tokens the model
runs on are reported too. Model-FLOPs utilisation (MFU) divides the model's FLOPs (6 x the weights that multiply, per
token they multiply: the encoder's per input token, the decoder's and the output layer's per target token; plus
attention, 12 x layers x d_model x keys per query token, self and cross; PaLM's appendix B) by a matmul peak measured
in the same run on the same devices (benchmark_clm.matmul_peak_flops). The cross-attention's key and value
projections, which multiply the encoder's output, count per input token.

Host: how many tokens of text per second BatchMaker corrupts into inputs and targets with numpy, which must stay well
above the training speed since it runs on the host, one batch ahead of the step.

    python benchmarks/benchmark_t5.py                                      # T5-small's shape, inputs of 128, on a CPU
    python benchmarks/benchmark_t5.py --max_seq_length 512 --batch_size 64 --dtype bfloat16      # a GPU
    python benchmarks/gpu_suite.py --rows t5       # that, beside transformers' T5ForConditionalGeneration (its peer)

--versus runs the whole script beside the Hugging Face Flax example on the same text instead (versus_t5_example.py;
benchmarks/README.md says how to get the example and an environment it runs in):

    python benchmarks/benchmark_t5.py --versus /tmp/hf_t5/run_t5_mlm_flax.py --versus_python /tmp/venv_hf/bin/python \
        --model_dir my-t5 --train_file tests/fixtures/en/train.txt --validation_file tests/fixtures/en/validation.txt
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from transformers import T5Config

from flax_lm.devices.mesh import create_mesh
from flax_lm.models.model_code import load_model_code
from flax_lm.models.t5 import T5_PRESETS
from flax_lm.models.t5.model import FlaxT5ForConditionalGeneration
from flax_lm.training.lifecycle import set_up_training
from flax_lm.training.train_state import create_train_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark_clm import matmul_peak_flops, peak_device_memory_bytes  # noqa: E402  (same folder)
from suite_shared import seconds_since_process_start  # noqa: E402
from versus_t5_example import versus  # noqa: E402

import run_t5_mlm_flax  # noqa: E402

SENTINELS = 100  # T5's: <extra_id_0> is the highest id, the others below it
# The flags that override the preset's shape (benchmarks/gpu_suite.py's tiny --smoke T5), and what they set: layers
# set the encoder's and the decoder's, heads d_kv as d_model over heads.
SHAPE_FLAGS = {"layers": "num_layers", "width": "d_model", "heads": "num_heads", "intermediate_size": "d_ff"}
SHAPE_FLAGS["vocab_size"] = "vocab_size"


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=T5_PRESETS, default="t5-small", help="the model's shape")
    for name, preset_name in SHAPE_FLAGS.items():
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {preset_name}")
    parser.add_argument("--max_seq_length", type=int, default=128, help="input tokens of a row (T5 trained on 512)")
    parser.add_argument("--batch_size", type=int, default=8, help="rows of the global batch")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed in each round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of timing; the best round counts")
    parser.add_argument("--skip_matmul_peak", action="store_true", help="leave out the measured peak and the MFU")
    parser.add_argument("--skip_host", action="store_true", help="leave out the host's span corruption speed")
    parser.add_argument("--json", help="also write the results to this JSON file")
    versus_flags = parser.add_argument_group("--versus: the whole script beside the Hugging Face example")
    versus_flags.add_argument("--versus", help="the path of the example's run_t5_mlm_flax.py")
    versus_flags.add_argument("--versus_python", help="the Python of an environment the example runs in")
    versus_flags.add_argument("--model_dir", help="the config and tokenizer both train from (create_config.py)")
    versus_flags.add_argument("--train_file", default="tests/fixtures/en/train.txt", help="text, a line a text")
    versus_flags.add_argument("--validation_file", default="tests/fixtures/en/validation.txt", help="held-out text")
    versus_flags.add_argument("--learning_rate", type=float, default=5e-3, help="the peak of the linear schedule")
    versus_flags.add_argument("--warmup_steps", type=int, default=5, help="of the linear schedule")
    versus_flags.add_argument("--seed", type=int, default=42, help="both scripts' --seed")
    versus_flags.add_argument("--versus_rounds", type=int, default=2, help="runs of each script, alternating")
    versus_flags.add_argument("--versus_skip_steps", type=int, default=5, help="steps left out of the timing")
    arguments = parser.parse_args()
    if arguments.versus and not (arguments.versus_python and arguments.model_dir):
        parser.error("--versus needs --versus_python and --model_dir")
    return arguments


def model_config(arguments) -> T5Config:
    """The preset's T5, with the shape flags given in its place."""
    settings = dict(T5_PRESETS[arguments.preset])
    settings |= {name: getattr(arguments, flag) for flag, name in SHAPE_FLAGS.items() if getattr(arguments, flag)}
    if arguments.layers:
        settings["num_decoder_layers"] = arguments.layers
    if arguments.width or arguments.heads:
        settings["d_kv"] = settings["d_model"] // settings["num_heads"]
    return T5Config(**settings)


def shape_name(arguments) -> str:
    overridden = [f"--{flag} {getattr(arguments, flag)}" for flag in SHAPE_FLAGS if getattr(arguments, flag)]
    return f"{arguments.preset}'s shape" + (f" with {' '.join(overridden)}" if overridden else "")


def batch_maker(config, max_seq_length: int) -> run_t5_mlm_flax.BatchMaker:
    corruption = run_t5_mlm_flax.SpanCorruption()
    row_length, target_length = run_t5_mlm_flax.span_corruption_lengths(max_seq_length, corruption)
    return run_t5_mlm_flax.BatchMaker(
        corruption=corruption,
        sentinel_ids=tuple(range(config.vocab_size - 1, config.vocab_size - 1 - SENTINELS, -1)),
        eos_token_id=1,
        pad_token_id=0,
        decoder_start_token_id=0,
        max_seq_length=max_seq_length,
        row_length=row_length,
        target_length=target_length,
    )


def random_rows(config, make_batch, count: int) -> np.ndarray:
    """Rows of random ordinary tokens: past <pad>, </s> and <unk>, below the sentinels."""
    generator = np.random.default_rng(0)
    return generator.integers(3, config.vocab_size - SENTINELS, (count, make_batch.row_length), dtype=np.int32)


def flops_per_step(params, config, batch_size: int, input_length: int, target_length: int) -> float:
    """The model FLOPs of one training step, as the docstring counts them."""

    def count(tree):
        return sum(
            leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if "relative" not in str(path)
        )

    inner = config.num_heads * config.d_kv
    # The cross-attention's keys and values: projections of the encoder's output, one for each input token.
    cross_keys_values = config.num_decoder_layers * 2 * config.d_model * inner
    encoder = 6 * (count(params["encoder"]) + cross_keys_values) + 12 * config.num_layers * inner * input_length
    decoder = 6 * (count(params["decoder"]) - cross_keys_values)
    decoder += 12 * config.num_decoder_layers * inner * (target_length + input_length)
    output_layer = 6 * config.vocab_size * config.d_model
    return batch_size * (input_length * encoder + target_length * (decoder + output_layer))


def benchmark_training(config, arguments) -> dict:
    model = FlaxT5ForConditionalGeneration(config, dtype=jnp.dtype(arguments.dtype), mesh=create_mesh())
    per_device_batch_size, remainder = divmod(arguments.batch_size, jax.device_count())
    if remainder or not per_device_batch_size:
        raise SystemExit("error: the batch size must be a multiple of the number of devices")
    training_arguments = run_t5_mlm_flax.TrainingArguments(
        output_dir="unused",
        do_train=True,
        max_steps=10_000,
        per_device_train_batch_size=per_device_batch_size,
        steps_per_call=1,
    )
    settings = training_arguments.training_settings()
    model_code = load_model_code(config, None, False, "benchmark_t5.py", encoder_decoder=True)
    eval_step = run_t5_mlm_flax.make_eval_step(model)
    script = run_t5_mlm_flax.SCRIPT_TRAINING
    setup = set_up_training(model, model_code, script, eval_step, settings, None, arguments.max_seq_length)
    dummy_input = jnp.zeros((1, arguments.max_seq_length), jnp.int32)
    state = create_train_state(model, setup.optimizer, setup.abstract_state, 0, dummy_input)
    make_batch = batch_maker(config, arguments.max_seq_length)
    rows = random_rows(config, make_batch, arguments.batch_size)
    batch = make_batch(rows, np.arange(len(rows)), len(rows), (0,))
    # One step a call, the same batch each time, as one micro-batch: (steps, micro-batches, rows, ...).
    batches = {name: jax.device_put(values[None, None], setup.call_batches_sharding) for name, values in batch.items()}

    compile_start = time.perf_counter()
    state, metrics = setup.compiled_train_steps(state, batches, 1)
    jax.block_until_ready(metrics)
    compile_seconds = time.perf_counter() - compile_start
    first_step_seconds = seconds_since_process_start()
    peak_memory_bytes = peak_device_memory_bytes()

    step_seconds, peak = float("inf"), 0.0
    for _ in range(arguments.rounds):
        start = time.perf_counter()
        for _ in range(arguments.steps):
            state, metrics = setup.compiled_train_steps(state, batches, 1)
        jax.block_until_ready(metrics)
        step_seconds = min(step_seconds, (time.perf_counter() - start) / arguments.steps)
        if not arguments.skip_matmul_peak:
            peak = max(peak, matmul_peak_flops(jnp.dtype(arguments.dtype)))

    target_length = make_batch.target_length
    flops = flops_per_step(state.params, config, arguments.batch_size, arguments.max_seq_length, target_length)
    results = {
        "parameters": sum(leaf.size for leaf in jax.tree_util.tree_leaves(state.params)),
        "row_length": make_batch.row_length,
        "target_length": target_length,
        "step_seconds": step_seconds,
        "compile_seconds": compile_seconds,
        "seconds_to_first_step": first_step_seconds,
        "peak_memory_bytes": peak_memory_bytes,
        "text_tokens_per_second": arguments.batch_size * make_batch.row_length / step_seconds,
        "train_tokens_per_second": arguments.batch_size * make_batch.row_length / step_seconds,  # gpu_suite.py's
        "model_tokens_per_second": arguments.batch_size * (arguments.max_seq_length + target_length) / step_seconds,
        "model_tflops_per_second": flops / step_seconds / 1e12,
        "final_loss": float(metrics["loss_sum"][-1] / metrics["weight_sum"][-1]),
    }
    if not arguments.skip_matmul_peak:
        results |= {"matmul_peak_tflops_per_second": peak / 1e12, "mfu": flops / step_seconds / peak}
    return results


def benchmark_host_corruption(config, arguments) -> dict:
    """Tokens of text per second that BatchMaker corrupts, one global batch at a time."""
    make_batch = batch_maker(config, arguments.max_seq_length)
    batches = 32
    rows = random_rows(config, make_batch, batches * arguments.batch_size)
    start = time.perf_counter()
    for step in range(batches):
        indices = np.arange(step * arguments.batch_size, (step + 1) * arguments.batch_size)
        make_batch(rows, indices, len(indices), (0, step))
    seconds = time.perf_counter() - start
    return {"corruption_tokens_per_second": rows.size / seconds}


def print_versus(arguments):
    corruption = run_t5_mlm_flax.SpanCorruption()
    row_length, _ = run_t5_mlm_flax.span_corruption_lengths(arguments.max_seq_length, corruption)
    results = versus(arguments, row_length)
    print(f"{results['steps']} steps of {arguments.batch_size} rows of {row_length} tokens of text; medians:")
    for side, medians in results["medians"].items():
        print(
            f"{side}: {medians['tokens_per_second']:,.0f} tokens/s, "
            f"{medians['tokens_per_cpu_second']:,.0f} tokens/CPU-s "
            f"({medians['cpu_seconds_per_step']:.2f} CPU-s a step), eval loss {medians['eval_loss']:.4f}, "
            f"whole run {medians['wall_seconds']:.0f} s and {medians['cpu_seconds']:.0f} CPU-s"
        )
    ratios = results["ratios"]
    print(
        f"ours / example: {ratios['tokens_per_second']:.2f}x tokens/s, "
        f"{ratios['tokens_per_cpu_second']:.2f}x tokens per CPU-second"
    )
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump({"arguments": vars(arguments)} | results, file, indent=2)


def main():
    arguments = parse_arguments()
    if arguments.versus:
        print_versus(arguments)
        return
    config = model_config(arguments)
    print(
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; {shape_name(arguments)}, inputs of "
        f"{arguments.max_seq_length} tokens, batch {arguments.batch_size}, {arguments.dtype}"
    )
    results = {"arguments": vars(arguments), "device_kind": jax.devices()[0].device_kind}
    results["training"] = training = benchmark_training(config, arguments)
    print(
        f"training: {training['text_tokens_per_second']:,.0f} tokens of text/s (rows of {training['row_length']}), "
        f"{training['model_tokens_per_second']:,.0f} input and target tokens/s (targets of "
        f"{training['target_length']}), {training['step_seconds']:.2f} s/step, "
        f"{training['model_tflops_per_second']:.3f} model TFLOP/s ({training['parameters'] / 1e6:.1f}M parameters, "
        f"compiled in {training['compile_seconds']:.1f} s), peak memory {training['peak_memory_bytes'] / 1e9:.2f} GB"
    )
    if not arguments.skip_matmul_peak:
        print(
            f"of a measured matmul peak of {training['matmul_peak_tflops_per_second']:.3f} TFLOP/s: "
            f"MFU {training['mfu']:.1%}"
        )
    if not arguments.skip_host:
        results["host"] = host = benchmark_host_corruption(config, arguments)
        print(f"host span corruption: {host['corruption_tokens_per_second']:,.0f} tokens of text/s")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
