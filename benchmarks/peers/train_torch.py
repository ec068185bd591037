#!/usr/bin/env python3
"""The PyTorch peer of one row of benchmarks/gpu_suite.py: a train step as a PyTorch user writes it, timed as the
project's benchmark_clm.py / benchmark_mlm.py / benchmark_t5.py time theirs. transformers' GPT2LMHeadModel,
LlamaForCausalLM, Qwen3MoeForCausalLM (its load-balancing loss in the loss, as on the project's side) or
RobertaForMaskedLM (SDPA attention), or the lean single-file GPT of lean_gpt.py; torch.compile; fused AdamW with the
gradients clipped to norm 1; bfloat16 through autocast over float32 weights (as transformers' Trainer --bf16 and
nanoGPT run). Batches are random ids of the row's shape, made once and on the device: causal rows (the labels are the
inputs), masked rows (15% of the positions predicted, BERT's 80/10/10 replacement), or with --packed_examples the
packed prompt/completion rows of suite_shared.py (labels -100 outside the completions, positions restarting at each
example, from which transformers builds the block-diagonal attention of packed sequences).

--model t5 is T5's recipe as run_t5_mlm_flax.py runs it: transformers' T5ForConditionalGeneration (the original
T5's ReLU MLP and tied output layer, dropout 0.1 as the project's side trains with) on the span-corrupted batch of
benchmark_t5.py (suite_shared.span_corrupted_batch: inputs of --sequence_length, targets as long as span corruption
makes them), trained with transformers' Adafactor set as optax.adafactor, the script's default, is: a constant
learning rate of 1e-2 (relative_step off, no warm-up init), updates scaled by each parameter's root mean square
(scale_parameter) and clipped to a root mean square of 1 (clip_threshold), second moments decaying as 1 - step^-0.8,
no momentum, no weight decay, no clipping of the gradients' norm (--max_grad_norm 0). (optax factors the second
moments of matrices whose two sides are 128 or longer, transformers' of every matrix: the relative position tables
differ, a few thousand numbers.) Its tokens are tokens of text, as benchmark_t5.py counts them: --sequence_length's
inputs come from rows of more (568 for 512).

    python benchmarks/peers/train_torch.py --model llama --key_value_heads 4 --intermediate_size 2048 --torch_compile

It prints its results as one JSON object (and writes them to --json).
"""

import argparse
import importlib.metadata
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from lean_gpt import LeanGPT, LeanGPTConfig  # noqa: E402  (same folder)
from suite_shared import (  # noqa: E402  (benchmarks/)
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    packed_example_rows,
    peak_resident_bytes,
    seconds_since_process_start,
    span_corrupted_batch,
)
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.optimization import Adafactor  # noqa: E402

MODELS = ("gpt2", "lean_gpt", "llama", "qwen3_moe", "roberta", "t5")
ROBERTA_SPECIAL_IDS = dict(bos=0, pad=1, eos=2, mask=4)  # <s>, <pad>, </s>, <unk>=3, <mask>: as benchmark_mlm.py's


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--key_value_heads", type=int, help="llama: key/value heads (default: as many as heads)")
    parser.add_argument("--intermediate_size", type=int, default=2048, help="llama and t5: the MLP's width")
    parser.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts in each layer")
    parser.add_argument("--experts_per_token", type=int, default=2, help="qwen3_moe: the experts each token reaches")
    parser.add_argument(
        "--expert_intermediate_size", type=int, help="qwen3_moe: an expert's width (default: the MLP's over top-k)"
    )
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--sequence_length", type=int, default=1024, help="t5: the inputs' length")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="autocast's dtype")
    parser.add_argument("--steps", type=int, default=10, help="training steps timed in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timing; the best round counts")
    parser.add_argument("--warmup_steps", type=int, default=2, help="steps run after the first before timing")
    parser.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile")
    parser.add_argument("--packed_examples", action="store_true", help="llama: fine-tune on packed examples")
    parser.add_argument("--mlm_probability", type=float, default=0.15, help="roberta: the positions predicted")
    parser.add_argument("--json", help="also write the results to this JSON file")
    arguments = parser.parse_args()
    if arguments.packed_examples and arguments.model != "llama":
        parser.error("--packed_examples packs examples that begin with a BOS: use --model llama")
    return arguments


def build_model(arguments) -> torch.nn.Module:
    """The row's model, with SDPA attention, dropout off (as on the project's side), float32 weights."""
    shape = dict(vocab_size=arguments.vocab_size, num_hidden_layers=arguments.layers, hidden_size=arguments.width)
    shape["num_attention_heads"] = arguments.heads
    if arguments.model == "lean_gpt":
        config = LeanGPTConfig(
            arguments.vocab_size, arguments.sequence_length, arguments.layers, arguments.heads, arguments.width
        )
        return LeanGPT(config)
    if arguments.model == "gpt2":
        config = GPT2Config(
            vocab_size=arguments.vocab_size, n_positions=arguments.sequence_length, n_embd=arguments.width,
            n_layer=arguments.layers, n_head=arguments.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    if arguments.model == "llama":
        config = LlamaConfig(
            **shape, num_key_value_heads=arguments.key_value_heads or arguments.heads,
            intermediate_size=arguments.intermediate_size, max_position_embeddings=arguments.sequence_length,
            tie_word_embeddings=True, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
        )  # fmt: skip
        return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if arguments.model == "qwen3_moe":
        expert_width = arguments.expert_intermediate_size or arguments.intermediate_size // arguments.experts_per_token
        config = Qwen3MoeConfig(
            **shape, num_key_value_heads=arguments.key_value_heads or arguments.heads,
            head_dim=arguments.width // arguments.heads, num_experts=arguments.experts,
            num_experts_per_tok=arguments.experts_per_token, moe_intermediate_size=expert_width,
            norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001,
            max_position_embeddings=arguments.sequence_length, tie_word_embeddings=True, bos_token_id=BOS_TOKEN_ID,
            eos_token_id=EOS_TOKEN_ID,
        )  # fmt: skip
        return Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa")
    if arguments.model == "t5":
        config = T5Config(
            vocab_size=arguments.vocab_size, d_model=arguments.width, d_kv=arguments.width // arguments.heads,
            d_ff=arguments.intermediate_size, num_layers=arguments.layers, num_decoder_layers=arguments.layers,
            num_heads=arguments.heads, feed_forward_proj="relu", tie_word_embeddings=True, dropout_rate=0.1,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )  # fmt: skip
        return T5ForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    config = RobertaConfig(
        **shape, intermediate_size=4 * arguments.width,
        max_position_embeddings=arguments.sequence_length + ROBERTA_SPECIAL_IDS["pad"] + 1, type_vocab_size=1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=ROBERTA_SPECIAL_IDS["pad"],
        bos_token_id=ROBERTA_SPECIAL_IDS["bos"], eos_token_id=ROBERTA_SPECIAL_IDS["eos"], layer_norm_eps=1e-5,
    )  # fmt: skip
    return RobertaForMaskedLM._from_config(config, attn_implementation="sdpa")


def masked_rows(arguments, rng) -> dict:
    """<s> random ordinary tokens </s>, with --mlm_probability of the ordinary ones to predict: 80% of those replaced
    by <mask>, 10% by a random token, 10% kept; labels -100 at the positions not predicted."""
    shape = (arguments.batch_size, arguments.sequence_length)
    input_ids = rng.integers(5, arguments.vocab_size, size=shape)
    input_ids[:, 0], input_ids[:, -1] = ROBERTA_SPECIAL_IDS["bos"], ROBERTA_SPECIAL_IDS["eos"]
    predicted = rng.random(shape) < arguments.mlm_probability
    predicted[:, [0, -1]] = False
    labels = np.where(predicted, input_ids, -100)
    replacement = rng.random(shape)
    input_ids = np.where(predicted & (replacement < 0.8), ROBERTA_SPECIAL_IDS["mask"], input_ids)
    randomized = predicted & (replacement >= 0.8) & (replacement < 0.9)
    input_ids = np.where(randomized, rng.integers(5, arguments.vocab_size, size=shape), input_ids)
    return {"input_ids": input_ids, "attention_mask": np.ones(shape, np.int64), "labels": labels}


def batch_of(arguments, device) -> tuple[dict, int]:
    """The batch on the device, and the tokens of a row as the project's side counts them (of text, for T5)."""
    rng = np.random.default_rng(0)
    tokens_per_row = arguments.sequence_length
    if arguments.model == "roberta":
        rows = masked_rows(arguments, rng)
    elif arguments.model == "t5":
        corrupted = span_corrupted_batch(arguments.batch_size, arguments.sequence_length, arguments.vocab_size)
        input_ids, labels, tokens_per_row = corrupted["input_ids"], corrupted["labels"], corrupted["row_length"]
        rows = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": labels}
    elif arguments.packed_examples:
        packed = packed_example_rows(arguments.batch_size, arguments.sequence_length, arguments.vocab_size)
        labels = np.where(packed["weights"] > 0, packed["input_ids"], -100)
        rows = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"], "labels": labels}
    else:
        input_ids = rng.integers(0, arguments.vocab_size, size=(arguments.batch_size, arguments.sequence_length))
        rows = {"input_ids": input_ids, "labels": input_ids}
    batch = {name: torch.as_tensor(np.asarray(values, np.int64), device=device) for name, values in rows.items()}
    return batch, tokens_per_row


def main():
    arguments = parse_arguments()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # TF32 where float32 remains, as nanoGPT sets
    model = build_model(arguments).to(device).train()
    parameters = sum(parameter.numel() for parameter in model.parameters())  # tied weights counted once
    if arguments.model == "t5":  # as run_t5_mlm_flax.py's default, optax.adafactor (see the docstring)
        optimizer = Adafactor(
            model.parameters(), lr=1e-2, scale_parameter=True, relative_step=False, warmup_init=False,
            clip_threshold=1.0, decay_rate=-0.8, beta1=None, weight_decay=0.0,
        )  # fmt: skip
        max_grad_norm = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        max_grad_norm = 1.0
    forward = torch.compile(model) if arguments.torch_compile else model
    batch, tokens_per_row = batch_of(arguments, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=arguments.dtype == "bfloat16")

    def train_step() -> torch.Tensor:
        with autocast:
            outputs = forward(**batch)
        loss = outputs[1] if arguments.model == "lean_gpt" else outputs.loss
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    compile_start = time.perf_counter()
    train_step()
    synchronize()
    compile_seconds = time.perf_counter() - compile_start
    first_step_seconds = seconds_since_process_start()
    for _ in range(arguments.warmup_steps):
        train_step()
    synchronize()
    step_seconds = float("inf")
    for _ in range(arguments.rounds):
        start = time.perf_counter()
        for _ in range(arguments.steps):
            loss = train_step()
        synchronize()
        step_seconds = min(step_seconds, (time.perf_counter() - start) / arguments.steps)
    peak_memory_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_resident_bytes()
    results = {
        "model_class": type(model).__name__,
        "parameters": parameters,
        "peak_memory_bytes": peak_memory_bytes,
        "compile_seconds": compile_seconds,
        "seconds_to_first_step": first_step_seconds,
        "train_tokens_per_second": arguments.batch_size * tokens_per_row / step_seconds,
        "step_seconds": step_seconds,
        "final_loss": float(loss.detach()),
        "torch_compile": arguments.torch_compile,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }
    print(json.dumps(results))
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
