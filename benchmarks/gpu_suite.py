#!/usr/bin/env python3
"""The project's train step beside its PyTorch peer, for each training script's GPU preset, in one run that fits
one call on an H100 or H200 (benchmarks/README.md says how to run it there).

Rows (bfloat16, random ids, the same shape and batch on both sides):

    gpt2            GPT-2 124M, 32 x 1024: benchmark_clm.py --preset gpt2, beside transformers' GPT2LMHeadModel
                    and the lean single-file GPT of peers/lean_gpt.py (nanoGPT's published design); then the same
                    with --fp8, its ratio to the bfloat16 step's
    llama           the Llama of that shape (12 x 768, 12 heads over 4 key/value heads, SwiGLU 2048), 32 x 1024:
                    benchmark_clm.py --model_type llama, beside transformers' LlamaForCausalLM
    llama_finetune  that Llama fine-tuned on packed prompt/completion rows with the loss on the completions:
                    benchmark_clm.py --model_type llama --packed_examples, beside LlamaForCausalLM with labels -100
                    outside the completions and positions restarting at each example
    qwen3_moe       a Qwen3-MoE of that shape whose tokens meet as many MLP weights as the Llama's: 64 experts of
                    256, 8 per token (Qwen3-30B-A3B's 128 experts, 8 per token, scaled down), dropless, the
                    load-balancing loss in the loss: benchmark_clm.py --model_type qwen3_moe, beside transformers'
                    Qwen3MoeForCausalLM
    roberta         RoBERTa-base MLM, 32 x 512, 15% of the positions predicted: benchmark_mlm.py --preset
                    roberta-base, beside transformers' RobertaForMaskedLM
    t5              (named with --rows: a call of its own on a GPU) T5-small (60.5M parameters, 6 + 6 layers x 512,
                    ReLU MLP 2048, vocabulary 32128) span-corruption pretraining, 64 inputs of 512 tokens (rows of 568
                    tokens of text) and targets of 114: benchmark_t5.py, run_t5_mlm_flax.py's train step with its
                    default Adafactor, beside transformers' T5ForConditionalGeneration trained with transformers'
                    Adafactor set as the script's (peers/train_torch.py --model t5), on the same corrupted batch

Rows of post-training, each one process that runs both sides, its project's side in a process and TRL's in another
(float32 on both sides; a call of their own on a GPU, like generation):

    dpo             benchmark_dpo.py: run_dpo_flax.py's steps/s beside TRL's DPOTrainer, a random Llama of the
                    width of the rows above in 4 layers, 8 pairs a step of about 2 x 121 tokens, the reference model's
                    log-probabilities in every step
    grpo            benchmark_grpo.py: run_grpo_flax.py's steps/s beside TRL's GRPOTrainer on that Llama, 64
                    completions of 16 tokens a step (8 a prompt) sampled and trained on

Each side runs in its own process, one after the other, so that neither GPU memory nor compile caches mix (each gets
fresh torch.compile and Triton caches: its time to the first step is a cold start). The peers run
peers/train_torch.py: torch.compile, fused AdamW, SDPA attention, autocast to bfloat16. Each side is timed as best of
--rounds windows of --steps steps after its first steps; a side that fails or outruns its time is reported as failed
with its last error line, and the other rows go on. Reported for each: tokens/s, the ratio of the project's to the
peer's, MFU, peak GPU memory (JAX: the device's peak_bytes_in_use; PyTorch: torch.cuda.max_memory_allocated) and the
time from the process's start to the end of its first step.

MFU is the same formula on both sides: (6 x the weights that multiply + 12 x layers x width x sequence length)
FLOPs a token (PaLM, Chowdhery et al. 2022, appendix B; position and token lookups are no products, the tied output
layer is, at every position) x tokens/s, divided by the card's published dense bfloat16 peak. T5's tokens are tokens
of text, as benchmark_t5.py counts them, and its FLOPs those of t5_flops_per_token.

    python benchmarks/gpu_suite.py --json gpu_suite.json            # on a GPU: the rows above, about 7 minutes
    python benchmarks/gpu_suite.py --rows llama roberta               # some rows
    python benchmarks/gpu_suite.py --rows dpo grpo                    # post-training beside TRL, a call of its own
    python benchmarks/gpu_suite.py --rows t5                          # T5 beside transformers, a call of its own
    python benchmarks/gpu_suite.py --smoke                            # the same table at tiny shapes on a CPU

--smoke runs tiny models in float32 for a few steps, the PyTorch side without torch.compile (its compile takes longer
on a CPU than the whole smoke), and MFU against a float32 matmul peak numpy measures here; its numbers say only that
every part runs.
"""

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from flax_lm.data.span_corruption import SpanCorruption, span_corruption_lengths  # numpy alone: no framework here

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))

# The shapes of the rows: the training scripts' GPU presets, and a tiny model of each kind for --smoke (one layer: its
# sides' time is mostly compiling, which each layer adds to).
SHAPES = {
    "gpu": dict(
        layers=12, width=768, heads=12, key_value_heads=4, intermediate_size=2048, vocab_size=50304,
        causal_batch=(32, 1024), masked_batch=(32, 512), dtype="bfloat16", experts=64, experts_per_token=8,
        generation_batch_sizes=(1, 32), prompt_tokens=16, new_tokens=128,
        t5=dict(layers=6, width=512, heads=8, intermediate_size=2048, vocab_size=32128, batch=(64, 512)),
    ),
    "smoke": dict(
        layers=1, width=64, heads=4, key_value_heads=2, intermediate_size=128, vocab_size=256,
        causal_batch=(4, 64), masked_batch=(4, 64), dtype="float32", experts=8, experts_per_token=2,
        generation_batch_sizes=(1, 4), prompt_tokens=4, new_tokens=8,
        t5=dict(layers=1, width=64, heads=4, intermediate_size=128, vocab_size=256, batch=(4, 64)),
    ),
}  # fmt: skip

# A smoke side's XLA: the tiny T5's side took 14 CPU-seconds with them against 19 without (compiling 8 s, not 15);
# the smoke of tests/end_to_end/test_gpu_suite_runs.py without its T5 row, 108 against 120.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# Dense bfloat16 peaks of the cards' data sheets (without sparsity), by a part of the name the drivers report; the
# first that matches counts.
PUBLISHED_BFLOAT16_PEAKS = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("GH200", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.0e12),
)


# In the order they run: RoBERTa last, whose compile has been the slowest.
# A side that would start with less of the time budget left is not started: no GPU side compiles in less.
SIDE_MINIMUM_SECONDS = 45
TRAINING_ROWS = ["gpt2", "llama", "llama_finetune", "qwen3_moe", "roberta"]
# A training row run only when named: the default rows already fill a call (benchmarks/README.md).
T5_ROW = "t5"
GENERATION_ROW = "generate"
POST_TRAINING_ROWS = ["dpo", "grpo"]


@dataclass
class Side:
    """One process of a row: the project's benchmark, or a peer."""

    label: str
    command: list[str]
    environment: dict = field(default_factory=dict)
    variant: bool = False  # another setting of the project's side: its ratio is its speed to the project side's


@dataclass
class Row:
    name: str
    description: str
    kind: str  # gpt2, llama, qwen3_moe, roberta or t5: what the FLOP count reads
    project: Side
    peers: list[Side] = field(default_factory=list)


def rows_of(shape: dict, arguments) -> list[Row]:
    """The rows in the order they run, each side's command at `shape`."""
    batch, length = shape["causal_batch"]
    masked_batch, masked_length = shape["masked_batch"]
    timing = ["--steps", str(arguments.steps), "--rounds", str(arguments.rounds)]
    common = ["--layers", shape["layers"], "--width", shape["width"], "--heads", shape["heads"]]
    common += ["--vocab_size", shape["vocab_size"], "--dtype", shape["dtype"]]
    llama = ["--key_value_heads", shape["key_value_heads"], "--intermediate_size", shape["intermediate_size"]]
    moe = [*llama, "--experts", shape["experts"], "--experts_per_token", shape["experts_per_token"]]
    clm = ["benchmark_clm.py", "--preset", "gpt2", *common, "--block_size", length, "--batch_size", batch]
    clm += ["--skip_preprocessing", "--skip_matmul_peak", *timing]
    mlm = ["benchmark_mlm.py", "--preset", "roberta-base", *common, "--seq_length", masked_length]
    mlm += ["--batch_size", masked_batch, "--skip_preprocessing", "--skip_matmul_peak", *timing]
    compiled = [] if arguments.smoke else ["--torch_compile"]
    torch = ["peers/train_torch.py", *common, "--sequence_length", length, "--batch_size", batch, *timing, *compiled]
    masked_torch = ["peers/train_torch.py", *common, "--sequence_length", masked_length]
    masked_torch += ["--batch_size", masked_batch, *timing, *compiled]
    size = "124M" if not arguments.smoke else "tiny"
    t5 = shape["t5"]
    t5_batch, t5_length = t5["batch"]
    t5_shape = ["--layers", t5["layers"], "--width", t5["width"], "--heads", t5["heads"]]
    t5_shape += ["--intermediate_size", t5["intermediate_size"], "--vocab_size", t5["vocab_size"]]
    t5_shape += ["--batch_size", t5_batch, "--dtype", shape["dtype"]]
    t5_ours = ["benchmark_t5.py", *t5_shape, "--max_seq_length", t5_length, "--skip_matmul_peak", "--skip_host"]
    t5_peer = ["peers/train_torch.py", "--model", "t5", *t5_shape, "--sequence_length", t5_length, *compiled]
    t5_row_length, t5_target_length = span_corruption_lengths(t5_length, SpanCorruption())
    return [
        Row(
            "gpt2", f"GPT-2 {size}, {batch} x {length}", "gpt2", Side("flax_lm", clm),
            [Side("transformers GPT2LMHeadModel", [*torch, "--model", "gpt2"]),
             Side("lean GPT (peers/lean_gpt.py)", [*torch, "--model", "lean_gpt"]),
             Side("flax_lm --fp8", [*clm, "--fp8"], variant=True)],
        ),
        Row(
            "llama", f"Llama {shape['layers']} x {shape['width']}, {shape['key_value_heads']} KV heads, {batch} x "
            f"{length}", "llama", Side("flax_lm", [*clm, "--model_type", "llama", *llama]),
            [Side("transformers LlamaForCausalLM", [*torch, "--model", "llama", *llama])],
        ),
        Row(
            "llama_finetune", f"Llama fine-tuning, packed prompt/completion rows, {batch} x {length}", "llama",
            Side("flax_lm", [*clm, "--model_type", "llama", *llama, "--packed_examples"]),
            [Side("transformers LlamaForCausalLM", [*torch, "--model", "llama", *llama, "--packed_examples"])],
        ),
        Row(
            "qwen3_moe", f"Qwen3-MoE {shape['layers']} x {shape['width']}, {shape['experts_per_token']} of "
            f"{shape['experts']} experts, {batch} x {length}", "qwen3_moe",
            Side("flax_lm", [*clm, "--model_type", "qwen3_moe", *moe]),
            [Side("transformers Qwen3MoeForCausalLM", [*torch, "--model", "qwen3_moe", *moe])],
        ),
        Row(
            "roberta", f"RoBERTa-{'base' if not arguments.smoke else 'tiny'} MLM, {masked_batch} x {masked_length}",
            "roberta", Side("flax_lm", mlm),
            [Side("transformers RobertaForMaskedLM", [*masked_torch, "--model", "roberta"])],
        ),
        Row(
            T5_ROW, f"T5-{'small' if not arguments.smoke else 'tiny'} span corruption, {t5_batch} x {t5_length} "
            f"inputs (rows of {t5_row_length} tokens of text), targets of {t5_target_length}", "t5",
            Side("flax_lm", [*t5_ours, *timing]),
            [Side("transformers T5ForConditionalGeneration, Adafactor", [*t5_peer, *timing])],
        ),
    ]  # fmt: skip


def generation_side(shape: dict, arguments) -> Side:
    """generate_flax.py's decoding of the Llama row's model beside transformers' generate with a static cache
    (compiled with torch.compile on a GPU) on the same weights, greedy, at batch 1 and 32 (benchmark_generate.py).
    Both frameworks share its process: JAX must leave PyTorch room on the card."""
    command = [
        "benchmark_generate.py",
        "--model_type",
        "llama",
        "--layers",
        shape["layers"],
        "--width",
        shape["width"],
    ]
    command += ["--heads", shape["heads"], "--key_value_heads", shape["key_value_heads"], "--vocab_size"]
    command += [shape["vocab_size"], "--intermediate_size", shape["intermediate_size"], "--dtype", shape["dtype"]]
    command += ["--torch_compile", "--batch_sizes", *shape["generation_batch_sizes"], "--repeats", arguments.rounds]
    command += ["--new_tokens", shape["new_tokens"], "--prompt_tokens", shape["prompt_tokens"]]
    return Side(
        "generate_flax.py's sampler, transformers generate", command, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    )


def post_training_side(name: str, shape: dict, arguments) -> Side:
    """benchmark_dpo.py or benchmark_grpo.py at the shape's width, 4 layers (2 for --smoke): both sides in one call."""
    model = ["--hidden_size", shape["width"], "--layers", 4 if not arguments.smoke else 2]
    if name == "dpo":
        steps = ["--steps", arguments.steps * (arguments.rounds + 1), "--window", arguments.steps]
        return Side("run_dpo_flax.py, TRL DPOTrainer", ["benchmark_dpo.py", *model, *steps])
    steps = ["--steps", arguments.steps * (arguments.rounds + 1), "--warmup_steps", arguments.steps]
    completions = [
        "--batch",
        64 if not arguments.smoke else 8,
        "--max_completion_length",
        16 if not arguments.smoke else 4,
    ]
    return Side("run_grpo_flax.py, TRL GRPOTrainer", ["benchmark_grpo.py", *model, *steps, *completions])


def flops_per_token(kind: str, shape: dict, sequence_length: int) -> float:
    """(6 x the weights that multiply + 12 x layers x width x sequence length) a token: the same count for both
    sides of a row, from its shape alone. Biases and norms are left out; the tied output layer counts."""
    if kind == "t5":
        return t5_flops_per_token(shape["t5"])
    width, layers, vocab_size = shape["width"], shape["layers"], shape["vocab_size"]
    if kind in ("llama", "qwen3_moe"):
        key_value_width = width // shape["heads"] * shape["key_value_heads"]
        # A Qwen3-MoE's tokens meet its router and as many expert weights as the Llama's MLP has (see the rows).
        router = width * shape["experts"] if kind == "qwen3_moe" else 0
        layer = 2 * width * width + 2 * width * key_value_width + 3 * width * shape["intermediate_size"] + router
        weights = layers * layer + vocab_size * width
    else:
        weights = layers * 12 * width * width + vocab_size * width
        weights += width * width if kind == "roberta" else 0  # the MLM head's dense layer before the output layer
    return 6 * weights + 12 * layers * width * sequence_length


def t5_flops_per_token(t5: dict) -> float:
    """A T5's FLOPs (ReLU MLP, as T5-small's) per token of text, a row of text being corrupted into an input of
    t5["batch"][1] tokens and a shorter target: 6 x the weights that multiply each token, plus attention, 12 x layers x
    width x keys per query token. Each input token meets the encoder's weights (4 width x width of self-attention, 2 x
    width x intermediate size of MLP, a layer) and the cross-attention's key and value projections of each decoder
    layer (2 width x width); each target token meets the decoder's self-attention, the cross-attention's query and
    output projections and the MLP, and the output layer (vocabulary x width); the encoder's attention has the input's
    keys, the decoder's the target's and then the input's (heads x d_kv is the width, as in T5-small). Norms and
    relative position tables are left out. The sum over a row, divided by its tokens of text. benchmark_t5.py counts
    the same from its weights (its norms too)."""
    width, layers, vocab_size = t5["width"], t5["layers"], t5["vocab_size"]
    input_length = t5["batch"][1]
    row_length, target_length = span_corruption_lengths(input_length, SpanCorruption())
    attention, mlp = 4 * width * width, 2 * width * t5["intermediate_size"]
    cross_keys_values, cross_queries_outputs = 2 * width * width, 2 * width * width
    per_input_token = 6 * layers * (attention + mlp + cross_keys_values) + 12 * layers * width * input_length
    per_target_token = 6 * (layers * (attention + cross_queries_outputs + mlp) + vocab_size * width)
    per_target_token += 12 * layers * width * (target_length + input_length)
    return (input_length * per_input_token + target_length * per_target_token) / row_length


def numpy_float32_peak() -> float:
    """The best FLOP/s of numpy's float32 matmuls here: --smoke's stand-in for a card's published peak."""
    best = 0.0
    for size in (256, 512, 1024):
        a, b = np.ones((size, size), np.float32), np.ones((size, size), np.float32)
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def published_peak(card: str) -> float | None:
    return next((peak for part, peak in PUBLISHED_BFLOAT16_PEAKS if part in card), None)


def last_error_line(text: str) -> str:
    """The last line of a side's output that says something (a traceback ends with the error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_side(side: Side, timeout: float, log_dir: str, name: str, smoke: bool) -> dict:
    """Runs one side in a process of its own session (so that a timeout ends its compile workers too), with fresh
    compile caches; its results, or its failure. A smoke's side computes on one thread: its tiny steps gain nothing
    from more, and on a shared CPU PyTorch's waiting threads slow them a hundredfold. Its JAX compiles without
    XLA's costly CPU optimisations (SMOKE_XLA_FLAGS): compiling is most of a smoke side's time, and its speed says
    nothing."""
    json_path = os.path.join(log_dir, f"{name}.json")
    log_path = os.path.join(log_dir, f"{name}.log")
    if os.path.exists(json_path):  # an earlier run's, which a failing side must not pass off as its own
        os.remove(json_path)
    caches = tempfile.mkdtemp(prefix=f"gpu-suite-{name}-caches-")  # removed after: only the logs come back
    environment = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
        "PYTHONUNBUFFERED": "1",
        **(
            {"OMP_NUM_THREADS": "1", "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}"}
            if smoke
            else {}
        ),
        **side.environment,
    }
    environment.pop("JAX_COMPILATION_CACHE_DIR", None)
    script, *flags = side.command
    command = [sys.executable, os.path.join(BENCHMARKS_DIR, script), *map(str, flags), "--json", json_path]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    seconds = time.perf_counter() - start
    shutil.rmtree(caches, ignore_errors=True)
    with open(log_path) as log:
        output = log.read()
    if returncode is None:
        return {"error": f"stopped after {timeout:.0f} s; last line: {last_error_line(output)}", "seconds": seconds}
    if returncode != 0 or not os.path.exists(json_path):
        return {"error": last_error_line(output), "seconds": seconds}
    with open(json_path) as file:
        results = json.load(file)
    return {**results.get("training", results), "device_kind": results.get("device_kind"), "seconds": seconds}


def run_in_budget(side: Side, row: str, name: str, timeout: float, deadline: float, log_dir: str, smoke: bool):
    """run_side for at most `timeout` seconds and what is left of the suite's --time_budget; "not run" where less is
    left than a side needs."""
    left = deadline - time.monotonic()
    if left < SIDE_MINIMUM_SECONDS:
        return {"error": "not run: the suite's --time_budget was spent"}
    print(f"{row}: {side.label} ...", file=sys.stderr, flush=True)
    return run_side(side, min(timeout, left), log_dir, name, smoke)


def versions() -> dict:
    found = {}
    for name in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=[*TRAINING_ROWS, T5_ROW, GENERATION_ROW, *POST_TRAINING_ROWS],
        default=TRAINING_ROWS,
        help=f"the rows to run (default: the training rows but {T5_ROW}; {T5_ROW}: T5 beside transformers, "
        f"{GENERATION_ROW}: generation, and {', '.join(POST_TRAINING_ROWS)}: post-training beside TRL, calls of "
        "their own on a GPU)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in float32 on a CPU, PyTorch uncompiled")
    parser.add_argument("--steps", type=int, help="steps in each timed window (default: 10; 2 with --smoke)")
    parser.add_argument("--rounds", type=int, help="timed windows; the best counts (default: 3; 2 with --smoke)")
    parser.add_argument(
        "--time_budget", type=float, default=420.0, help="seconds for all sides together: a side gets what is left"
    )
    parser.add_argument("--side_timeout", type=float, default=120.0, help="the most seconds one side may take")
    parser.add_argument("--json", help="also write the table to this JSON file")
    parser.add_argument("--log_dir", help="where each side's output goes (default: beside --json, or a temporary one)")
    arguments = parser.parse_args()
    arguments.steps = arguments.steps or (2 if arguments.smoke else 10)
    arguments.rounds = arguments.rounds or (2 if arguments.smoke else 3)
    if arguments.steps < 1 or arguments.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    return arguments


def main():
    arguments = parse_arguments()
    shape = SHAPES["smoke" if arguments.smoke else "gpu"]
    rows = [row for row in rows_of(shape, arguments) if row.name in arguments.rows]
    log_dir = arguments.log_dir or (
        os.path.join(os.path.dirname(os.path.abspath(arguments.json)), "gpu_suite_logs")
        if arguments.json
        else tempfile.mkdtemp(prefix="gpu_suite_")
    )
    os.makedirs(log_dir, exist_ok=True)
    deadline = time.monotonic() + arguments.time_budget
    measurements = []
    for row in rows:
        sequence_length = shape["masked_batch" if row.kind == "roberta" else "causal_batch"][1]  # T5: its own
        for number, side in enumerate([row.project, *row.peers]):
            name = f"{row.name}-{number}"
            result = run_in_budget(side, row.name, name, arguments.side_timeout, deadline, log_dir, arguments.smoke)
            measurements.append(
                {
                    "row": row.name,
                    "model": row.description,
                    "side": side.label,
                    "command": " ".join(map(str, side.command)),
                    "variant": side.variant,
                    "flops_per_token": flops_per_token(row.kind, shape, sequence_length),
                    **result,
                }
            )
    generation = None
    if GENERATION_ROW in arguments.rows:
        side = generation_side(shape, arguments)
        generation = run_in_budget(
            side, GENERATION_ROW, GENERATION_ROW, arguments.side_timeout, deadline, log_dir, arguments.smoke
        )
        generation["command"] = " ".join(map(str, side.command))
    post_training = {}
    for name in (name for name in POST_TRAINING_ROWS if name in arguments.rows):
        side = post_training_side(name, shape, arguments)
        # Its two sides run one after the other in it: twice a side's time.
        timeout = 2 * arguments.side_timeout
        post_training[name] = run_in_budget(side, name, name, timeout, deadline, log_dir, arguments.smoke)
        post_training[name]["command"] = " ".join(map(str, side.command))
    report = summarize(measurements, generation, arguments)
    report["post_training"] = post_training
    if post_training:
        report["text"] += "\n\n" + "\n".join(post_training_table(post_training))
    print(report["text"])
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump({key: value for key, value in report.items() if key != "text"}, file, indent=2)


def summarize(measurements: list[dict], generation: dict | None, arguments) -> dict:
    """The table, as text and as data: ratios against the row's project side, MFU against the peak."""
    measured = [m for m in [*measurements, generation or {}] if "error" not in m]
    cards = sorted({m.get("device_kind") or m.get("device_name") for m in measured} - {None})
    card = ", ".join(cards) or "unknown"
    if arguments.smoke:
        peak, peak_source = numpy_float32_peak(), "a float32 matmul peak numpy measured here (--smoke)"
    else:
        peak = published_peak(card)
        peak_source = f"the card's published dense bfloat16 peak, {peak / 1e12:.1f} TFLOP/s" if peak else None
    project_speed = {}
    for measurement in measurements:
        if "error" not in measurement:
            speed = measurement["train_tokens_per_second"]
            if measurement["side"] == "flax_lm":
                project_speed[measurement["row"]] = speed
            measurement["mfu"] = speed * measurement["flops_per_token"] / peak if peak else None
    for measurement in measurements:
        ours = project_speed.get(measurement["row"])
        peer = measurement.get("train_tokens_per_second")
        if measurement["side"] == "flax_lm" or not (ours and peer):
            measurement["ratio"] = None
        else:
            measurement["ratio"] = peer / ours if measurement.get("variant") else ours / peer
    header = {
        "card": card,
        "versions": versions(),
        "smoke": arguments.smoke,
        "dtype": SHAPES["smoke" if arguments.smoke else "gpu"]["dtype"],
        "steps": arguments.steps,
        "rounds": arguments.rounds,
        "mfu_peak_flops": peak,
        "mfu_formula": "(6 x weights that multiply + 12 x layers x width x sequence length) FLOPs a token (T5: "
        "t5_flops_per_token, a token of text) x tokens/s "
        f"/ {peak_source or 'no known peak for this card: MFU left out'}",
        "measurements": measurements,
        "generation": generation,
    }
    return {**header, "text": table_text(header)}


def table_text(report: dict) -> str:
    versions_line = ", ".join(f"{name} {version}" for name, version in report["versions"].items())
    compile_note = "PyTorch uncompiled (--smoke: torch.compile off)" if report["smoke"] else "torch.compile"
    lines = [
        f"card: {report['card']}; {versions_line}",
        f"{report['dtype']}; best of {report['rounds']} windows of {report['steps']} steps after the first steps; "
        f"peers: {compile_note}, fused AdamW (T5: transformers' Adafactor), SDPA attention",
        f"MFU: {report['mfu_formula']}",
        "",
        "| model, shape | side | tokens/s | ratio (flax_lm / peer; fp8 / flax_lm) | MFU | peak memory | first step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for measurement in report["measurements"]:
        if "error" in measurement:
            cells = [f"failed: {measurement['error']}", "–", "–", "–", "–"]
        else:
            cells = [
                f"{measurement['train_tokens_per_second']:,.0f}",
                f"{measurement['ratio']:.2f}" if measurement["ratio"] else "–",
                f"{measurement['mfu']:.1%}" if measurement["mfu"] is not None else "–",
                f"{measurement['peak_memory_bytes'] / 1e9:.2f} GB",
                f"{measurement['seconds_to_first_step']:.1f} s" if measurement["seconds_to_first_step"] else "–",
            ]
        lines.append(f"| {measurement['model']} | {measurement['side']} | {' | '.join(cells)} |")
    if report["smoke"]:
        lines.append("(on a CPU, peak memory is each process's peak resident memory)")
    if report["generation"] is not None:
        lines += ["", *generation_table(report["generation"], report["smoke"])]
    return "\n".join(lines)


def generation_table(generation: dict, smoke: bool) -> list[str]:
    peer = "transformers generate, static cache" + (" (uncompiled on a CPU)" if smoke else ", torch.compile")
    lines = [
        f"generation, greedy: {generation['command']}",
        f"| decoding | flax_lm tokens/s | {peer}: tokens/s | ratio | rows with the same tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    if "error" in generation:
        return [*lines, f"| failed: {generation['error']} | – | – | – | – |"]
    for row in generation["rows"]:
        ratio = row["jax_tokens_per_second"] / row["torch_tokens_per_second"]
        lines.append(
            f"| {row['decoding']} | {row['jax_tokens_per_second']:,.0f} | {row['torch_tokens_per_second']:,.0f} | "
            f"{ratio:.2f} | {row['rows_with_the_same_tokens']} of {row['batch_size']} |"
        )
    return lines


def post_training_table(post_training: dict) -> list[str]:
    lines = ["| post-training | flax_lm steps/s | TRL steps/s | ratio | command |", "| --- | --- | --- | --- | --- |"]
    for name, result in post_training.items():
        if "error" in result:
            lines.append(f"| {name} | failed: {result['error']} | – | – | {result['command']} |")
            continue
        ours, theirs = result["flax_lm"]["steps_per_second"], result["trl"]["steps_per_second"]
        lines.append(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} | {result['command']} |")
    return lines


if __name__ == "__main__":
    main()
