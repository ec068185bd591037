#!/usr/bin/env python3
"""Tokens per second of generate_flax.py's decoding (the sampler of flax_lm.generation.sampling) beside transformers'
PyTorch `generate`, in the same run; or, with --serving, of generate_flax.py --serve under concurrent clients.

Both decode greedily with a key/value cache (and, with --num_beams, by beam search too: flax_lm.generation.sampling's
one compiled loop beside transformers' beam search), from the same random GPT-2 (124M parameters by default) and the
same prompts, `--new_tokens` tokens each without stopping early (no end-of-text token), at each batch size. The first
JAX call compiles; its time is reported apart, and the timed calls reuse the compiled program (as every later request
of the same shape bucket does). The two must write the same tokens: both are checked.

    python benchmarks/benchmark_generate.py [--batch_sizes 1 8] [--new_tokens 128] [--prompt_tokens 16] [--num_beams 4]

With --model_type llama the preset's layers, width and heads make a Llama (as benchmark_clm.py's: --key_value_heads,
--intermediate_size); with --dtype bfloat16 both sides decode in bfloat16 (the weights too), where greedy decodings
may part where two tokens' scores round alike; with --torch_compile transformers decodes with a static cache, which
it compiles with torch.compile on a GPU (on a CPU it runs uncompiled). On a GPU, PyTorch runs there too. The Llama
of benchmarks/gpu_suite.py, on a GPU:

    python benchmarks/benchmark_generate.py --model_type llama --key_value_heads 4 --intermediate_size 2048 \
        --dtype bfloat16 --torch_compile --batch_sizes 1 32

With --serving, the model of --model_name_or_path (a GPT-2 directory, as run_clm_flax.py writes) is served twice,
decoding up to --serving_batch_size concurrent requests together and then one request at a time (--batch_size 1),
and each server is sent greedy requests for --new_tokens tokens by each count of --clients clients at once, each
client sending its next request when the last one is answered. An untimed round first compiles the shapes the
timed one uses. Reported: new tokens per second over all clients, the latency of requests (p50, p90, p99), and
the mean rows of the server's batches (from its /metrics).

    python benchmarks/benchmark_generate.py --serving --model_name_or_path DIR [--clients 1 8 32] \
        [--requests_per_client 4] [--serving_batch_size 32] [--new_tokens 64]
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from flax_lm.generation import sampling
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.models.llama import model as llama
from flax_lm.training.train_state import abstract_model_params

try:  # a test requirement (pip install -r requirements-test.txt): without it the benchmark only answers --help
    import torch
except ModuleNotFoundError as missing:
    missing_requirement = missing.name
else:
    missing_requirement = None

GENERATE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generate_flax.py")

PRESETS = {
    "gpt2": dict(layers=12, width=768, heads=12, vocab_size=50257),
    "gpt2-medium": dict(layers=24, width=1024, heads=16, vocab_size=50257),
}


def best_time(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="gpt2")
    parser.add_argument(
        "--model_type", choices=["gpt2", "llama"], default="gpt2", help="the model of the preset's shape"
    )
    parser.add_argument("--key_value_heads", type=int, help="llama: key/value heads (default: as many as heads)")
    parser.add_argument("--intermediate_size", type=int, help="llama: the MLP's width (default: 8/3 of the width)")
    for name in ("layers", "width", "heads", "vocab_size"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' dtype")
    parser.add_argument(
        "--torch_compile", action="store_true", help="transformers with a static cache, compiled on a GPU"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each; the fastest is reported")
    parser.add_argument(
        "--num_beams", type=int, default=1, help="above 1: beam search of this many beams too, beside greedy decoding"
    )
    parser.add_argument("--serving", action="store_true", help="benchmark generate_flax.py --serve instead")
    parser.add_argument("--model_name_or_path", help="with --serving: the GPT-2 directory to serve")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="with --serving")
    parser.add_argument("--requests_per_client", type=int, default=4, help="with --serving: timed requests of each")
    parser.add_argument("--serving_batch_size", type=int, default=32, help="with --serving: the batched server's")
    arguments = parser.parse_args()
    if missing_requirement:
        parser.error(
            f"{missing_requirement} is not installed: this benchmark needs the test requirements "
            "(pip install -r requirements-test.txt)"
        )
    if arguments.serving:
        if importlib.util.find_spec("httpx") is None:
            parser.error(
                "httpx is not installed: --serving needs the test requirements (pip install -r requirements-test.txt)"
            )
        if not arguments.model_name_or_path:
            parser.error("--serving needs --model_name_or_path, the GPT-2 directory to serve")
        benchmark_serving(arguments)
    else:
        benchmark_decoding(arguments)


def models_of(arguments):
    """The same random weights twice: transformers' model (on the GPU where there is one) and the Flax model with its
    parameters, in --dtype. No end-of-text token: every row decodes all new tokens, on both sides."""
    shape = {**PRESETS[arguments.preset]}
    shape.update({name: getattr(arguments, name) for name in shape if getattr(arguments, name) is not None})
    torch.manual_seed(0)
    if arguments.model_type == "gpt2":
        config = GPT2Config(
            vocab_size=shape["vocab_size"], n_positions=1024, n_layer=shape["layers"], n_embd=shape["width"],
            n_head=shape["heads"], bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        torch_model, module, flax_class = GPT2LMHeadModel(config), gpt2, gpt2.FlaxGPT2LMHeadModel
    else:
        config = LlamaConfig(
            vocab_size=shape["vocab_size"], max_position_embeddings=1024, hidden_size=shape["width"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=arguments.key_value_heads or shape["heads"],
            intermediate_size=arguments.intermediate_size or -(-8 * shape["width"] // 3 // 64) * 64,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        torch_model, module, flax_class = LlamaForCausalLM(config), llama, llama.FlaxLlamaForCausalLM
    dtype = jnp.dtype(arguments.dtype)
    model = flax_class(config, dtype=dtype)
    abstract_params = abstract_model_params(model, jnp.zeros((1, 8), jnp.int32))
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    params = jax.tree_util.tree_map(
        lambda leaf: leaf.astype(dtype), module.from_hf_state_dict(state_dict, abstract_params)
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_model = torch_model.to(device, getattr(torch, arguments.dtype)).eval()
    return config, torch_model, model, jax.device_put(params)


def benchmark_decoding(arguments):
    config, torch_model, model, params = models_of(arguments)
    sampler = sampling.make_sampler(model, eos_token_id=None)
    compiled = "static cache, torch.compile" if arguments.torch_compile and torch.cuda.is_available() else "uncompiled"
    compiled = (
        "static cache, uncompiled on a CPU" if arguments.torch_compile and compiled == "uncompiled" else compiled
    )
    print(
        f"{arguments.model_type} ({arguments.preset}'s shape): "
        f"{sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) / 1e6:.1f}M parameters, "
        f"{arguments.dtype}, {arguments.prompt_tokens} prompt + {arguments.new_tokens} new tokens; JAX on "
        f"{jax.devices()[0].device_kind}, PyTorch {torch.__version__} on {torch_model.device} ({compiled})",
        flush=True,
    )
    torch_settings = {"cache_implementation": "static"} if arguments.torch_compile else {}
    results = []
    rng = np.random.default_rng(0)
    for batch_size in arguments.batch_sizes:
        prompts = rng.integers(0, config.vocab_size, size=(batch_size, arguments.prompt_tokens))

        def generate_jax(prompts=prompts):
            return sampling.generate_ids(sampler, params, prompts.tolist(), arguments.new_tokens)

        def generate_torch(prompts=prompts, **settings):
            input_ids = torch.tensor(prompts, device=torch_model.device)
            with torch.no_grad():
                return torch_model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=arguments.new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                    **torch_settings,
                    **settings,
                ).cpu()  # waits for the device

        greedy_torch = partial(generate_torch, min_new_tokens=arguments.new_tokens)
        results.append(report(f"batch {batch_size}, greedy", generate_jax, greedy_torch, batch_size, arguments))
        if arguments.num_beams > 1:
            samplings = [
                sampling.Sampling(arguments.new_tokens, num_beams=arguments.num_beams, prompt_index=row)
                for row in range(batch_size)
            ]

            def beam_search_jax(prompts=prompts, samplings=samplings):
                return sampling.decode_rows(sampler, params, prompts.tolist(), samplings)

            beams = f"batch {batch_size}, {arguments.num_beams} beams"
            beam_search_torch = partial(generate_torch, num_beams=arguments.num_beams)
            results.append(report(beams, beam_search_jax, beam_search_torch, batch_size, arguments))
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(
                {"settings": vars(arguments), "device_kind": jax.devices()[0].device_kind, "rows": results}, file
            )


def report(name: str, generate_jax, generate_torch, batch_size: int, arguments) -> dict:
    """Times both decodings of the same prompts (new tokens a second: the rows' tokens written, not the beams')."""
    start = time.perf_counter()
    jax_ids = generate_jax()
    compile_and_run = time.perf_counter() - start
    torch_ids = generate_torch()[:, arguments.prompt_tokens :].tolist()  # also compiles, with --torch_compile
    same = sum(ours == theirs for ours, theirs in zip(jax_ids, torch_ids))
    tokens = batch_size * arguments.new_tokens
    jax_seconds = best_time(generate_jax, arguments.repeats)
    torch_seconds = best_time(generate_torch, arguments.repeats)
    print(
        f"{name}: JAX {tokens / jax_seconds:7.1f} tokens/s ({jax_seconds:.2f} s; first call with "
        f"compilation {compile_and_run:.1f} s), PyTorch {tokens / torch_seconds:7.1f} tokens/s "
        f"({torch_seconds:.2f} s): {tokens / jax_seconds / (tokens / torch_seconds):.2f}x; "
        f"{same} of {batch_size} rows the same tokens",
        flush=True,
    )
    return {
        "decoding": name,
        "batch_size": batch_size,
        "jax_tokens_per_second": tokens / jax_seconds,
        "torch_tokens_per_second": tokens / torch_seconds,
        "jax_first_call_seconds": compile_and_run,
        "rows_with_the_same_tokens": same,
    }


def start_server(model: str, batch_size: int, new_tokens: int, max_queued_requests: int):
    """generate_flax.py --serve on a free port: (the process, its URL)."""
    command = [
        sys.executable, GENERATE_SCRIPT, "--model_name_or_path", model, "--serve", "--port", "0",
        "--batch_size", str(batch_size), "--max_new_tokens", str(new_tokens),
        "--max_new_tokens_limit", str(new_tokens), "--max_queued_requests", str(max_queued_requests),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    if not line.startswith("Serving"):
        server.kill()
        raise SystemExit(f"the server did not start; run it alone to see why: {' '.join(command)}")
    return server, line.split()[-1]


def batch_rows(url: str) -> tuple[float, float]:
    """(rows, batches) the server has decoded so far, from its /metrics."""
    import httpx  # only --serving needs an HTTP client and a metrics parser
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "flax_lm_batch_rows":
            values = {sample.name: sample.value for sample in family.samples}
            return values["flax_lm_batch_rows_sum"], values["flax_lm_batch_rows_count"]
    raise SystemExit("the server's /metrics has no flax_lm_batch_rows")


def run_clients(url: str, model: str, clients: int, requests_per_client: int, new_tokens: int):
    """(seconds, new tokens, latency of each request): `clients` clients sending their requests one after another."""

    import httpx

    def client(number: int) -> list[tuple[float, int]]:
        answers = []
        with httpx.Client(timeout=3600) as http:
            for index in range(requests_per_client):
                request = {"model": model, "prompt": f"Request {number} {index}:", "max_tokens": new_tokens}
                start = time.perf_counter()
                answer = http.post(f"{url}/v1/completions", json=request)
                answer.raise_for_status()
                answers.append((time.perf_counter() - start, answer.json()["usage"]["completion_tokens"]))
        return answers

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [answer for answers in pool.map(client, range(clients)) for answer in answers]
    return time.perf_counter() - start, sum(tokens for _, tokens in answers), [latency for latency, _ in answers]


def benchmark_serving(arguments):
    model = arguments.model_name_or_path
    print(
        f"generate_flax.py --serve of {model}: greedy, {arguments.new_tokens} new tokens a request, "
        f"{arguments.requests_per_client} requests a client; JAX on {jax.devices()[0].platform}",
        flush=True,
    )
    for label, batch_size in [("batched", arguments.serving_batch_size), ("one at a time", 1)]:
        server, url = start_server(model, batch_size, arguments.new_tokens, max(arguments.clients))
        try:
            for clients in arguments.clients:
                run_clients(url, model, clients, 1, arguments.new_tokens)  # compiles the shapes of this load
                rows_before, batches_before = batch_rows(url)
                seconds, tokens, latencies = run_clients(
                    url, model, clients, arguments.requests_per_client, arguments.new_tokens
                )
                rows, batches = batch_rows(url)
                p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
                print(
                    f"{label} (--batch_size {batch_size}), {clients:2d} clients: {tokens / seconds:7.1f} tokens/s, "
                    f"latency p50 {p50:.2f} s, p90 {p90:.2f} s, p99 {p99:.2f} s; "
                    f"{(rows - rows_before) / (batches - batches_before):.1f} rows a batch",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
