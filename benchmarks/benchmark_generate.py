#!/usr/bin/env python3
"""Tokens per second of generate_flax.py's decoding (the sampler of flax_lm.models.gpt2) beside transformers'
PyTorch `generate`, in the same run.

Both decode greedily with a key/value cache, from the same random GPT-2 (124M parameters by default) and the
same prompts, `--new_tokens` tokens each without stopping early (no end-of-text token), at each batch size.
The first JAX call compiles; its time is reported apart, and the timed calls reuse the compiled program (as
every later request of the same shape bucket does). The two must write the same tokens: both are checked.

    python benchmarks/benchmark_generate.py [--batch_sizes 1 8] [--new_tokens 128] [--prompt_tokens 16]
"""

import argparse
import time

import jax
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from flax_lm.models import gpt2
from flax_lm.train_state import abstract_model_params

PRESETS = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12), "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16)}


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
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each; the fastest is reported")
    arguments = parser.parse_args()

    # No end-of-text token: every row decodes all new tokens, on both sides.
    config = GPT2Config(
        vocab_size=50257, n_positions=1024, bos_token_id=None, eos_token_id=None, **PRESETS[arguments.preset]
    )
    torch.manual_seed(0)
    torch_model = GPT2LMHeadModel(config).eval()
    model = gpt2.FlaxGPT2LMHeadModel(config)
    abstract_params = abstract_model_params(model, jax.numpy.zeros((1, 8), jax.numpy.int32))
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    params = jax.device_put(gpt2.from_hf_state_dict(state_dict, abstract_params))
    sampler = gpt2.make_sampler(model, eos_token_id=None)
    print(
        f"{arguments.preset}: {sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) / 1e6:.1f}M parameters, "
        f"float32, greedy, {arguments.prompt_tokens} prompt + {arguments.new_tokens} new tokens; JAX on "
        f"{jax.devices()[0].platform}, PyTorch {torch.__version__} with {torch.get_num_threads()} threads",
        flush=True,
    )

    rng = np.random.default_rng(0)
    for batch_size in arguments.batch_sizes:
        prompts = rng.integers(0, config.vocab_size, size=(batch_size, arguments.prompt_tokens))

        def generate_jax(prompts=prompts):
            return gpt2.generate_ids(sampler, params, prompts.tolist(), arguments.new_tokens)

        def generate_torch(prompts=prompts):
            input_ids = torch.tensor(prompts)
            with torch.no_grad():
                return torch_model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=arguments.new_tokens,
                    min_new_tokens=arguments.new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                )

        start = time.perf_counter()
        jax_ids = generate_jax()
        compile_and_run = time.perf_counter() - start
        torch_ids = generate_torch()[:, arguments.prompt_tokens :].tolist()
        same = sum(ours == theirs for ours, theirs in zip(jax_ids, torch_ids))
        tokens = batch_size * arguments.new_tokens
        jax_seconds = best_time(generate_jax, arguments.repeats)
        torch_seconds = best_time(generate_torch, arguments.repeats)
        print(
            f"batch {batch_size}: JAX {tokens / jax_seconds:7.1f} tokens/s ({jax_seconds:.2f} s; first call with "
            f"compilation {compile_and_run:.1f} s), PyTorch {tokens / torch_seconds:7.1f} tokens/s "
            f"({torch_seconds:.2f} s): {tokens / jax_seconds / (tokens / torch_seconds):.2f}x; "
            f"{same} of {batch_size} rows the same tokens",
            flush=True,
        )


if __name__ == "__main__":
    main()
