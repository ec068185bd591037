#!/usr/bin/env python3
"""Fine-tune a causal language model by GRPO (group relative policy optimization) with JAX/Flax.

Each step takes prompts from a JSONL file (a `prompt` field a row, a text or a conversation: Hugging Face TRL's
prompt-only formats), samples --num_generations completions of each with the package's sampler
(flax_lm.generation.sampling: batched, compiled, with the key/value cache), scores every completion with the reward
functions of this file (REWARD_FUNCTIONS, which --reward_funcs picks from), turns the rewards into advantages
normalised within each prompt's group, and takes one optimizer step on the clipped objective, with a KL term to the
starting model when --beta is above 0. The flags and the logged names are those of TRL's GRPOTrainer
(--num_generations, --beta, --epsilon, --max_completion_length, --temperature, --loss_type; reward, reward_std, kl,
completions/mean_length, clip_ratio/...), and the loss of a step equals GRPOTrainer's on the same completions and
rewards (tests/parity/test_grpo_parity.py).

    ./run_grpo_flax.py --model_name_or_path sft-run --train_file prompts.jsonl --output_dir grpo-run \
        --reward_funcs addition --num_generations 8 --per_device_train_batch_size 32 --max_steps 100

The output directory is a Hugging Face model directory, as run_clm_flax.py's, and grpo_log.jsonl holds the logged
metrics of each logged step. To reward something else, write `def my_reward(prompt, completion) -> float` below,
add it to REWARD_FUNCTIONS and pass --reward_funcs my_reward.
"""

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

import flax_lm  # noqa: F401  first: where PyTorch is missing, it keeps transformers from warning about it on import

# isort: split

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from transformers import HfArgumentParser

from flax_lm.command_line.model_loading import model_loading
from flax_lm.data.chat import conversation_prompt_ids, stop_token_ids
from flax_lm.devices.processes import LOG_FORMAT
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.generation.sampling import Sampling, decode_rows, make_sampler
from flax_lm.models.huggingface import save_model
from flax_lm.models.model_code import load_model_code
from flax_lm.server.generator import load_model

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: TRL's GRPOConfig names where it has the setting
# ----------------------------------------------------------------------------------------------------


@dataclass
class GRPOArguments:
    model_name_or_path: str = field(
        metadata={"help": "The causal LM to start from: a directory with config.json, weights and tokenizer files."}
    )
    train_file: str = field(metadata={"help": 'A JSONL file of prompts, one {"prompt": ...} a line.'})
    output_dir: str = field(metadata={"help": "Where the fine-tuned model and grpo_log.jsonl are written."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["addition"],
        metadata={"help": "Reward functions of REWARD_FUNCTIONS, summed; give several names for several."},
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled for each prompt (a group)."})
    per_device_train_batch_size: int = field(
        default=32, metadata={"help": "Completions per step: a multiple of --num_generations."}
    )
    max_completion_length: int = field(default=32, metadata={"help": "Most tokens of a completion."})
    temperature: float = field(default=1.0, metadata={"help": "Temperature of the completions' draws and the loss."})
    beta: float = field(default=0.0, metadata={"help": "Coefficient of the KL term to the starting model; 0: none."})
    epsilon: float = field(default=0.2, metadata={"help": "The ratio is clipped to [1 - epsilon, 1 + epsilon_high]."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping bound; default: --epsilon."})
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "How token losses are averaged (LOSS_AGGREGATIONS).",
            "choices": ["grpo", "bnpo", "dr_grpo", "dapo"],
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantages divided by the std of the group, of the batch, or none.",
            "choices": ["group", "batch", "none"],
        },
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW's learning rate (constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradients clipped to this global norm; 0: none."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps (one generation batch each)."})
    logging_steps: int = field(default=10, metadata={"help": "Log the metrics every this many steps."})
    seed: int = field(default=42, metadata={"help": "Seed of the prompts' order and the completions' draws."})
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the ratio (1 in value), so that its gradient is the unbiased reverse "
            "KL's (DeepSeek-V3.2; TRL's default)."
        },
    )
    model_file: str | None = field(default=None, metadata={"help": "The model module of a --model_file run."})


def check_arguments(args: GRPOArguments):
    """Refuse argument mistakes before any work, each in one line."""
    if args.num_generations < 2:
        raise UsageError("--num_generations must be at least 2: advantages compare the completions of a prompt")
    if args.per_device_train_batch_size % args.num_generations:
        raise UsageError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size} is not a multiple of "
            f"--num_generations {args.num_generations}; make it one"
        )
    for name in args.reward_funcs:
        if name not in REWARD_FUNCTIONS:
            raise UsageError(f"--reward_funcs {name} is not in REWARD_FUNCTIONS ({', '.join(REWARD_FUNCTIONS)})")
    if args.max_completion_length < 1 or args.max_steps < 1 or args.logging_steps < 1:
        raise UsageError("--max_completion_length, --max_steps and --logging_steps must be at least 1")
    if problem := Sampling(args.max_completion_length, args.temperature).problem("--"):
        raise UsageError(problem.replace("--max_new_tokens", "--max_completion_length"))
    if args.temperature == 0:
        raise UsageError("--temperature must be positive: a group of greedy completions is one completion repeated")
    if args.beta < 0 or args.epsilon < 0 or (args.epsilon_high is not None and args.epsilon_high < 0):
        raise UsageError("--beta, --epsilon and --epsilon_high must be 0 or more")


def read_prompts(path: str) -> list:
    """The `prompt` field of each line of a JSONL file: a text, or a conversation (a list of {"role", "content"}
    messages, TRL's conversational format) that the tokenizer's chat template renders."""
    if not os.path.isfile(path):
        raise UsageError(f"--train_file {path} does not exist")
    prompts = []
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"--train_file {path} line {number} is not JSON: {error}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), (str, list)):
                raise UsageError(
                    f'--train_file {path} line {number} has no "prompt" field (a text or a list of messages); '
                    "give each line one"
                )
            prompts.append(row["prompt"])
    if not prompts:
        raise UsageError(f"--train_file {path} holds no prompts")
    return prompts


def prompt_text(prompt) -> str:
    """What a reward function sees of a prompt: its text, or the content of a conversation's last message."""
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""


# ----------------------------------------------------------------------------------------------------
# Rewards: the copy-and-edit place. A reward function takes a prompt and one completion (texts) and returns a float;
# the rewards of the functions --reward_funcs names are summed.
# ----------------------------------------------------------------------------------------------------


def addition(prompt: str, completion: str) -> float:
    """1 where the completion starts with the sum that a prompt ending in "a+b=" asks for, else 0."""
    question = re.search(r"(-?\d+)\+(-?\d+)=$", prompt.strip())
    answer = re.match(r"\s*(-?\d+)", completion)
    if question is None or answer is None:
        return 0.0
    return float(int(answer.group(1)) == int(question.group(1)) + int(question.group(2)))


def short(prompt: str, completion: str) -> float:
    """Fewer characters, more reward: 1 for an empty completion, falling to 0 at 100 characters."""
    return max(0.0, 1.0 - len(completion) / 100)


REWARD_FUNCTIONS = {"addition": addition, "short": short}


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str) -> np.ndarray:
    """Each completion's reward less the mean of its group (the completions of its prompt, consecutive), divided by
    the standard deviation (Bessel-corrected, plus 1e-4) of its group or of the whole batch, or by nothing."""
    groups = rewards.reshape(-1, num_generations)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = np.repeat(groups.std(axis=1, ddof=1), num_generations)
    else:
        std = np.full_like(rewards, rewards.std(ddof=1))
    return centred / (std + 1e-4)


# ----------------------------------------------------------------------------------------------------
# The loss: PPO's clipped ratio of each completion token, the k3 estimate of the KL to the reference, and how the
# token losses of a batch are averaged (--loss_type)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSettings:
    temperature: float
    beta: float
    epsilon_low: float
    epsilon_high: float
    loss_type: str
    max_completion_length: int
    use_bias_correction_kl: bool = True


# How the token losses (batch, completion length) with their mask become the loss. grpo: each completion's mean, then
# their mean; bnpo and dapo: the mean over the batch's tokens (dapo's is over the whole generation batch, which one
# step here is); dr_grpo: the sum over a constant, the batch size times --max_completion_length.
LOSS_AGGREGATIONS = {
    "grpo": lambda losses, mask, length: ((losses * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean(),
    "bnpo": lambda losses, mask, length: (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0),
    "dapo": lambda losses, mask, length: (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0),
    "dr_grpo": lambda losses, mask, length: (losses * mask).sum() / (losses.shape[0] * length),
}


def completion_log_probs(model, params, prompt_ids, prompt_mask, completion_ids, temperature: float):
    """(batch, completion length) log-probabilities of each completion token after its prompt (left-padded, with
    `prompt_mask`) and the completion tokens before it, from the logits divided by the temperature, as the samples
    were drawn."""
    completion_length = completion_ids.shape[1]
    cache = model.empty_cache(prompt_mask, completion_length)
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    logits, _ = model.apply({"params": params}, ids, cache=cache)
    logits = logits[:, prompt_ids.shape[1] - 1 : -1] / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_probs, completion_ids[..., None], axis=-1)[..., 0]


def grpo_loss(params, ref_params, model, batch: dict, settings: LossSettings):
    """The loss of one step and its metrics. The completions were sampled from these very params (one optimizer step
    per generation batch), so the ratio is 1 in value and clipping only shapes the gradient."""
    log_probs = completion_log_probs(
        model, params, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], settings.temperature
    )
    mask, advantages = batch["completion_mask"], batch["advantages"][:, None]
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(log_probs))
    clipped = jnp.clip(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    token_losses = -jnp.minimum(ratio * advantages, clipped * advantages)
    metrics = {}

    def masked_mean(values):
        return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    if settings.beta:
        ref_log_probs = completion_log_probs(
            model, ref_params, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], settings.temperature
        )
        difference = jax.lax.stop_gradient(ref_log_probs) - log_probs
        kl = jnp.exp(difference) - difference - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        token_losses = token_losses + settings.beta * kl
        metrics["kl"] = masked_mean(kl)
    loss = LOSS_AGGREGATIONS[settings.loss_type](token_losses, mask, settings.max_completion_length)
    low = (ratio < 1 - settings.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    metrics |= {
        "clip_ratio/low_mean": masked_mean(low),
        "clip_ratio/high_mean": masked_mean(high),
        "clip_ratio/region_mean": masked_mean(low | high),
    }
    return loss, metrics


def make_train_step(model, optimizer, settings: LossSettings):
    @jax.jit
    def train_step(params, opt_state, ref_params, batch):
        (loss, metrics), gradients = jax.value_and_grad(grpo_loss, has_aux=True)(
            params, ref_params, model, batch, settings
        )
        updates, opt_state = optimizer.update(gradients, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics | {"loss": loss}

    return train_step


# ----------------------------------------------------------------------------------------------------
# Generation: the completions of a batch of prompts and their rewards
# ----------------------------------------------------------------------------------------------------


def padded(rows: list[list[int]], length: int, pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of `rows` padded to `length`, on the left (prompts) or the right (completions)."""
    ids, mask = np.full((len(rows), length), pad_id, np.int32), np.zeros((len(rows), length), np.float32)
    for number, row in enumerate(rows):
        start = length - len(row) if left else 0
        ids[number, start : start + len(row)], mask[number, start : start + len(row)] = row, 1.0
    return ids, mask


def generation_batch(step: int, prompts, prompt_ids, order, sampler, params, tokenizer, args, prompt_length):
    """The step's prompts, each --num_generations times, their completions sampled, and the rewards."""
    per_step = args.per_device_train_batch_size // args.num_generations
    chosen = [order[(step * per_step + offset) % len(order)] for offset in range(per_step)]
    rows = [prompt_ids[index] for index in chosen for _ in range(args.num_generations)]
    first = step * args.per_device_train_batch_size
    samplings = [
        Sampling(args.max_completion_length, args.temperature, seed=args.seed, prompt_index=first + row)
        for row in range(len(rows))
    ]
    completions = decode_rows(sampler, params, rows, samplings)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    prompt_texts = [prompt_text(prompts[index]) for index in chosen for _ in range(args.num_generations)]
    rewards = {
        name: np.array([REWARD_FUNCTIONS[name](p, c) for p, c in zip(prompt_texts, texts)], np.float32)
        for name in args.reward_funcs
    }
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = dict(zip(("prompt_ids", "prompt_mask"), padded(rows, prompt_length, pad_id, left=True)))
    ids, mask = padded(completions, args.max_completion_length, pad_id, left=False)
    batch |= {"completion_ids": ids, "completion_mask": mask}
    return batch, rewards, texts


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def parse_arguments() -> GRPOArguments:
    parser = HfArgumentParser(GRPOArguments)
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        if not os.path.isfile(sys.argv[1]):
            raise UsageError(f"arguments file {sys.argv[1]} does not exist")
        try:
            return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))[0]
        except (ValueError, TypeError) as error:  # JSONDecodeError is a ValueError; a missing field, a TypeError
            raise UsageError(f"arguments file {sys.argv[1]}: {error}") from None
    args, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise UsageError(f"unknown argument {unknown[0]}; see --help for the arguments this script takes")
    return args


def main():
    args = parse_arguments()
    check_arguments(args)
    logging.basicConfig(format=LOG_FORMAT, level=logging.INFO)
    logging.getLogger("jax").setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_error()
    prompts = read_prompts(args.train_file)
    model, params, tokenizer = load_model(model_loading(args), model_file=args.model_file)
    prompt_ids = tokenized_prompts(prompts, tokenizer, model.config, args)
    settings = LossSettings(
        args.temperature,
        args.beta,
        args.epsilon,
        args.epsilon if args.epsilon_high is None else args.epsilon_high,
        args.loss_type,
        args.max_completion_length,
        args.use_bias_correction_kl,
    )
    clip = [optax.clip_by_global_norm(args.max_grad_norm)] if args.max_grad_norm > 0 else []
    optimizer = optax.chain(*clip, optax.adamw(args.learning_rate, weight_decay=args.weight_decay))
    train_step = make_train_step(model, optimizer, settings)
    sampler = make_sampler(model, stop_token_ids(tokenizer, tokenizer.eos_token_id))  # a chat's end of turn too
    os.makedirs(args.output_dir, exist_ok=True)
    params = train(params, optimizer.init(params), train_step, sampler, tokenizer, prompts, prompt_ids, args)
    model_code = load_model_code(model.config, args.model_file, True, "run_grpo_flax.py")
    save_model(args.output_dir, params, model.config, tokenizer, model_code)
    print(f"model written to {args.output_dir}; metrics in {os.path.join(args.output_dir, LOG_FILE)}")


def tokenized_prompts(prompts: list, tokenizer, config, args) -> list[list[int]]:
    """The ids of each prompt: a text as the tokenizer encodes it, a conversation as the chat template renders it
    with the assistant's turn to come."""
    prompt_ids = []
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            prompt_ids.append(tokenizer(prompt)["input_ids"])
            continue
        try:
            prompt_ids.append(conversation_prompt_ids(tokenizer, prompt))
        except ValueError as error:
            raise UsageError(f"--train_file {args.train_file}: the conversation of prompt {number} {error}") from None
    if any(not ids for ids in prompt_ids):
        raise UsageError(f"--train_file {args.train_file} has an empty prompt; give every prompt some text")
    longest = max(map(len, prompt_ids))
    if longest + args.max_completion_length > config.max_position_embeddings:
        raise UsageError(
            f"prompts of {longest} tokens and --max_completion_length {args.max_completion_length} exceed the "
            f"model's {config.max_position_embeddings} positions; lower --max_completion_length"
        )
    return prompt_ids


LOG_FILE = "grpo_log.jsonl"


def train(params, opt_state, train_step, sampler, tokenizer, prompts, prompt_ids, args):
    """--max_steps steps, each on one generation batch, logging the means of the metrics every --logging_steps to
    the log and to grpo_log.jsonl; returns the trained params. The reference is the starting params (with --beta):
    JAX arrays are never changed in place, so keeping them costs their memory alone, outside the optimizer."""
    ref_params = params if args.beta else None
    order = np.random.default_rng(args.seed).permutation(len(prompts))
    prompt_length = max(map(len, prompt_ids))
    sums, started = {}, time.perf_counter()
    with open(os.path.join(args.output_dir, LOG_FILE), "w") as log_file:
        for step in range(args.max_steps):
            batch, rewards, texts = generation_batch(
                step, prompts, prompt_ids, order, sampler, params, tokenizer, args, prompt_length
            )
            total = sum(rewards.values())
            batch["advantages"] = group_advantages(total, args.num_generations, args.scale_rewards)
            params, opt_state, metrics = train_step(params, opt_state, ref_params, batch)
            for name, value in (step_metrics(metrics, rewards, total, batch, args)).items():
                sums[name] = sums.get(name, 0.0) + value
            if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
                steps = (step % args.logging_steps) + 1
                logged = {name: value / steps for name, value in sums.items()}
                logged |= {"step": step + 1, "steps_per_second": (step + 1) / (time.perf_counter() - started)}
                log_file.write(json.dumps(logged) + "\n")
                log_file.flush()
                logger.info("step %d: %s (sample %r)", step + 1, format_metrics(logged), texts[0])
                sums = {}
    return params


def step_metrics(metrics: dict, rewards: dict, total: np.ndarray, batch: dict, args) -> dict:
    """The metrics of one step under TRL's names: the loss's, and those of the rewards and completions."""
    groups = total.reshape(-1, args.num_generations)
    logged = {name: float(value) for name, value in metrics.items()} | {
        "reward": float(total.mean()),
        "reward_std": float(total.std(ddof=1)),
        "frac_reward_zero_std": float(np.isclose(groups.std(axis=1, ddof=1), 0).mean()),
        "completions/mean_length": float(batch["completion_mask"].sum(axis=1).mean()),
    }
    return logged | {f"rewards/{name}/mean": float(values.mean()) for name, values in rewards.items()}


def format_metrics(logged: dict) -> str:
    return ", ".join(f"{name} {value:.4g}" for name, value in logged.items() if name != "step")


if __name__ == "__main__":
    call_with_one_line_errors(main)
