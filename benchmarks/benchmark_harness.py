#!/usr/bin/env python3
"""Requests per second of lm-evaluation-harness's loglikelihood requests scored by the JAX model as
run_clm_flax.py --eval_tasks scores them (flax_lm.evaluation.harness over flax_lm.evaluation.scoring), beside lm-eval's
hf backend on the same weights in PyTorch, in the same run; and how far apart their log-likelihoods are.

The requests have HellaSwag's shape: --documents contexts of 40 to 100 tokens, each with 4 endings of 10 to 40
tokens (random ids, from a fixed seed), given to both as token ids, so that tokenizing costs neither anything. The
JAX scorer takes --tokens_per_batch padded positions at a time (run_clm_flax.py: --per_device_eval_batch_size times
the devices times --block_size; 8 x 1024 by default on one device); the hf backend takes --hf_batch_size requests at
a time. The first JAX pass compiles its few shapes and is reported apart; the timed pass reuses them, as every later
evaluation of a run does.

    python benchmarks/benchmark_harness.py [--preset gpt2] [--documents 100] [--hf_batch_size 32]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from flax_lm.evaluation.scoring import Scorer
from flax_lm.generation.sampling import make_sampler
from flax_lm.models.gpt2 import model as gpt2
from flax_lm.training.train_state import abstract_model_params

try:  # test requirements (pip install -r requirements-test.txt): without them the benchmark only answers --help
    import torch
    from lm_eval.models.huggingface import HFLM

    from flax_lm.evaluation.harness import FlaxLM
except ModuleNotFoundError as missing:
    missing_requirement = missing.name
else:
    missing_requirement = None

PRESETS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "gpt2-tiny": dict(n_layer=2, n_embd=128, n_head=2, vocab_size=8192, n_positions=256),
}


def hellaswag_shaped_requests(documents: int, vocab_size: int, seed: int = 0) -> list:
    """(cache key, context ids, continuation ids) of each request: 4 endings of each context."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(documents):
        context = rng.integers(1, vocab_size, rng.integers(40, 101)).tolist()
        for _ in range(4):
            requests.append((None, context, rng.integers(1, vocab_size, rng.integers(10, 41)).tolist()))
    return requests


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="gpt2")
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--tokens_per_batch", type=int, default=8 * 1024)
    parser.add_argument("--hf_batch_size", type=int, default=32)
    arguments = parser.parse_args()
    if missing_requirement:
        parser.error(
            f"{missing_requirement} is not installed: this benchmark needs the test requirements "
            "(pip install -r requirements-test.txt)"
        )

    config = GPT2Config(bos_token_id=0, eos_token_id=0, **PRESETS[arguments.preset])
    torch.manual_seed(0)
    torch_model = GPT2LMHeadModel(config).eval()
    model = gpt2.FlaxGPT2LMHeadModel(config)
    state_dict = {name: tensor.numpy() for name, tensor in torch_model.state_dict().items()}
    params = gpt2.from_hf_state_dict(state_dict, abstract_model_params(model, jnp.zeros((1, 8), jnp.int32)))
    # The requests are token ids: the tokenizer only names the end-of-text token.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>")),
        eos_token="<|endoftext|>",
    )
    requests = hellaswag_shaped_requests(arguments.documents, config.vocab_size)
    tokens = sum(len(context) + len(continuation) for _, context, continuation in requests)
    print(
        f"{arguments.preset}: {sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)) / 1e6:.1f}M parameters, "
        f"{len(requests)} requests of {tokens / len(requests):.0f} tokens on average, on {jax.devices()[0]}"
    )

    flax_lm = FlaxLM(Scorer(model, arguments.tokens_per_batch), make_sampler(model, 0), tokenizer, batch_size=8)
    flax_lm.params = jax.device_put(params)
    _, first_seconds = timed(lambda: flax_lm._loglikelihood_tokens(requests))
    ours, seconds = timed(lambda: flax_lm._loglikelihood_tokens(requests))
    rate = len(requests) / seconds
    print(f"JAX (run_clm_flax.py --eval_tasks): {rate:.1f} requests/s ({first_seconds:.1f} s with compilation)")

    hf_lm = HFLM(pretrained=torch_model, tokenizer=tokenizer, batch_size=arguments.hf_batch_size)
    with torch.no_grad():
        theirs, hf_seconds = timed(lambda: hf_lm._loglikelihood_tokens(requests, disable_tqdm=True))
    print(
        f"PyTorch (lm-eval's hf backend, batch {arguments.hf_batch_size}): {len(requests) / hf_seconds:.1f} requests/s"
    )
    differences = np.abs(np.array([answer[0] for answer in ours]) - np.array([answer[0] for answer in theirs]))
    same_greedy = all(a[1] == b[1] for a, b in zip(ours, theirs))
    print(f"log-likelihoods: largest difference {differences.max():.2e}; greedy flags the same: {same_greedy}")


if __name__ == "__main__":
    main()
