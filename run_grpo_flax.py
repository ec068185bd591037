#!/usr/bin/env python3
"""Fine-tune a causal language model by GRPO (group relative policy optimization) with JAX/Flax.

Each step takes prompts from JSONL files (a `prompt` field a row, a text or a conversation: Hugging Face TRL's
prompt-only formats), samples --num_generations completions of each with the package's sampler
(flax_lm.generation.sampling: batched, compiled, with the key/value cache), scores every completion with the reward
functions of this file (REWARD_FUNCTIONS, which --reward_funcs picks from), turns the rewards into advantages
normalised within each prompt's group, and takes one optimizer step on the clipped objective, with a KL term to the
reference (the starting model, or with LoRA's adapters the base model) when --beta is above 0. The flags and the
logged names are those of TRL's GRPOTrainer (--num_generations, --beta, --epsilon, --max_completion_length,
--temperature, --loss_type; reward, reward_std, kl, completions/mean_length, clip_ratio/...), and the loss of a step
equals GRPOTrainer's on the same completions and rewards (tests/parity/test_grpo_parity.py).

    ./run_grpo_flax.py --model_name_or_path sft-run --train_file prompts.jsonl --output_dir grpo-run \
        --reward_funcs addition --num_generations 8 --per_device_train_batch_size 32 --max_steps 100

The set-up is run_clm_flax.py's and run_dpo_flax.py's (flax_lm): the optimizers of --optim and their schedules,
checkpoints every --save_steps and --resume_from_checkpoint, the trackers of --report_to, the mesh of --mesh_shape,
LoRA's adapters (--lora_rank). The output directory is a Hugging Face model directory (a PEFT adapter with
--lora_rank), and grpo_log.jsonl holds the metrics of each logged step. To reward something else, write
`def my_reward(prompt, completion) -> float` below, add it to REWARD_FUNCTIONS and pass --reward_funcs my_reward.
"""

import json
import logging
import os
import re
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flax_lm.command_line.arguments import (
    CommonDataArguments,
    CommonTrainingArguments,
    ModelArguments,
    check_common_arguments,
    check_numeric_arguments,
)
from flax_lm.command_line.lora_flags import LoraArguments, adapted, check_lora_flags
from flax_lm.command_line.model_loading import model_loading
from flax_lm.command_line.phases import start_training
from flax_lm.command_line.start import start_run
from flax_lm.command_line.trainer_flags import apply_strategies
from flax_lm.data.chat import conversation_prompt_ids, stop_token_ids
from flax_lm.data.data_files import data_file_patterns, pattern_files
from flax_lm.devices.mesh import create_mesh, process_slice, to_global_batch
from flax_lm.errors import UsageError, call_with_one_line_errors
from flax_lm.generation.sampling import Sampling, decode_rows, make_sampler
from flax_lm.models import check_model_type
from flax_lm.models.huggingface import load_config_and_tokenizer
from flax_lm.models.model_code import load_model_code
from flax_lm.run.checkpoints import StopRequest, log_when_committed, open_checkpoints, wait_until_committed
from flax_lm.run.tracking import JsonLinesLog, logs_at_step
from flax_lm.training import optimizers
from flax_lm.training.lifecycle import ScriptTraining, TrainingSetup, set_up_training
from flax_lm.training.lora import is_adapter, without_adapters
from flax_lm.training.train_state import TrainState, apply_finite_update, step_gradients

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# Arguments: this script's own (TRL's GRPOConfig names), beside those of flax_lm.command_line.arguments
# ----------------------------------------------------------------------------------------------------


# The flags of low-rank adapters (--lora_rank ...) are in LoraArguments.
@dataclass
class TrainingArguments(LoraArguments, CommonTrainingArguments):
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (TRL's GRPO default, 1e-6)."})
    logging_steps: int = field(default=10, metadata={"help": "Steps between log lines (TRL's GRPO default, 10)."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["addition"],
        metadata={"help": "Reward functions of REWARD_FUNCTIONS, summed; give several names for several."},
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled for each prompt (a group)."})
    max_completion_length: int = field(default=32, metadata={"help": "Most tokens of a completion."})
    temperature: float = field(default=1.0, metadata={"help": "Temperature of the completions' draws and the loss."})
    beta: float = field(default=0.0, metadata={"help": "Coefficient of the KL term to the reference; 0: none."})
    epsilon: float = field(default=0.2, metadata={"help": "The ratio is clipped to [1 - epsilon, 1 + epsilon_high]."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping bound; default: --epsilon."})
    loss_type: str = field(default="dapo", metadata={"help": "How token losses are averaged: {names}."})
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Advantages divided by the std of the group, of the batch, or none.",
            "choices": ["group", "batch", "none"],
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the ratio (1 in value), so that its gradient is the unbiased reverse "
            "KL's (DeepSeek-V3.2; TRL's default)."
        },
    )

    def loss_settings(self) -> "LossSettings":
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return LossSettings(
            self.temperature, self.beta, self.epsilon, epsilon_high, self.loss_type, self.max_completion_length,
            self.use_bias_correction_kl,
        )  # fmt: skip


def check_arguments(model_args, data_args, training_args):
    """Refuse argument mistakes before any work, each in one line, and fill in the defaults that depend on other
    arguments: GRPO always trains, one step per compiled call (the next step's completions are sampled from its
    weights)."""
    check_model_type(model_args.model_type, generates_text=True)
    check_numeric_arguments(
        (data_args, training_args),
        num_generations=(lambda value: value >= 2, "must be at least 2: advantages compare a prompt's completions"),
        max_completion_length=(lambda value: value >= 1, "must be at least 1"),
        beta=(lambda value: value >= 0, "must be 0 or more"),
        epsilon=(lambda value: value >= 0, "must be 0 or more"),
        epsilon_high=(lambda value: value is None or value >= 0, "must be 0 or more"),
    )
    if not model_args.model_name_or_path:
        raise UsageError("GRPO starts from a model that samples something: pass --model_name_or_path")
    for flag in ("dataset_name", "validation_file", "streaming", "packed_data_dir", "data_mixture"):
        if getattr(data_args, flag):
            raise UsageError(f"--{flag} is not supported by run_grpo_flax.py; pass the prompts with --train_file")
    if training_args.do_eval or training_args.metric_for_best_model or training_args.load_best_model_at_end:
        raise UsageError("run_grpo_flax.py has no evaluation; leave --do_eval and the best-model flags out")
    if training_args.per_device_train_batch_size % training_args.num_generations:
        raise UsageError(
            f"--per_device_train_batch_size {training_args.per_device_train_batch_size} is not a multiple of "
            f"--num_generations {training_args.num_generations}; make it one"
        )
    if training_args.gradient_accumulation_steps != 1 or training_args.steps_per_call not in (None, 1):
        raise UsageError(
            "GRPO samples each step's completions from the weights of the step before: leave "
            "--gradient_accumulation_steps and --steps_per_call at 1 (raise --per_device_train_batch_size instead)"
        )
    training_args.do_train, training_args.steps_per_call = True, 1
    for name in training_args.reward_funcs:
        if name not in REWARD_FUNCTIONS:
            raise UsageError(f"--reward_funcs {name} is not in REWARD_FUNCTIONS ({', '.join(REWARD_FUNCTIONS)})")
    if training_args.scale_rewards not in ("group", "batch", "none"):  # a JSON file of arguments skips the choices
        raise UsageError(f"--scale_rewards {training_args.scale_rewards} is not one of group, batch, none")
    if problem := Sampling(training_args.max_completion_length, training_args.temperature).problem("--"):
        raise UsageError(problem.replace("--max_new_tokens", "--max_completion_length"))
    if training_args.temperature == 0:
        raise UsageError("--temperature must be positive: a group of greedy completions is one completion repeated")
    if training_args.lora_dropout:
        raise UsageError("--lora_dropout: GRPO's log-probabilities are those of the sampling, without dropout")
    check_common_arguments(model_args, data_args, training_args)
    check_lora_flags(model_args, training_args)


# ----------------------------------------------------------------------------------------------------
# Data: the prompts, and what a reward function sees of them
# ----------------------------------------------------------------------------------------------------


def read_prompts(files: list[str]) -> list:
    """The `prompt` field of each line of the JSONL files of --train_file: a text, or a conversation (a list of
    {"role", "content"} messages, TRL's conversational format) that the tokenizer's chat template renders."""
    paths = [path for pattern in data_file_patterns(files) for path in pattern_files(pattern) or [pattern]]
    prompts = []
    for path in paths:
        if not os.path.isfile(path):
            raise UsageError(f"--train_file {path} does not exist")
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
        raise UsageError(f"--train_file {' '.join(files)} holds no prompts")
    return prompts


def tokenized_prompts(prompts: list, tokenizer, config, training_args) -> list[list[int]]:
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
            raise UsageError(f"--train_file: the conversation of prompt {number} {error}") from None
    if any(not ids for ids in prompt_ids):
        raise UsageError("--train_file has an empty prompt; give every prompt some text")
    longest, completion_length = max(map(len, prompt_ids)), training_args.max_completion_length
    if longest + completion_length > config.max_position_embeddings:
        raise UsageError(
            f"prompts of {longest} tokens and --max_completion_length {completion_length} exceed the "
            f"model's {config.max_position_embeddings} positions; lower --max_completion_length"
        )
    return prompt_ids


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
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].astype(jnp.float32) / temperature
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_probs, completion_ids[..., None], axis=-1)[..., 0]


def batch_log_probs(model, params, batch: dict, temperature: float):
    """completion_log_probs of a batch's completions."""
    names = ("prompt_ids", "prompt_mask", "completion_ids")
    return completion_log_probs(model, params, *(batch[name] for name in names), temperature)


def grpo_loss(params, model, batch: dict, settings: LossSettings):
    """The loss of one step and its metrics. The completions were sampled from these very params (one optimizer step
    per generation batch), so the ratio is 1 in value and clipping only shapes the gradient. With --beta, the batch
    holds the reference's log-probabilities of its completions ("ref_log_probs")."""
    log_probs = batch_log_probs(model, params, batch, settings.temperature)
    mask, advantages = batch["completion_mask"], batch["advantages"][:, None]
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(log_probs))
    clipped = jnp.clip(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    token_losses = -jnp.minimum(ratio * advantages, clipped * advantages)
    metrics = {}

    def masked_mean(values):
        return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    if settings.beta:
        difference = jax.lax.stop_gradient(batch["ref_log_probs"]) - log_probs
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


def reward_metrics(batch: dict, reward_names: tuple[str, ...], num_generations: int) -> dict:
    """TRL's metrics of a batch's rewards (batch["rewards"]: (completions, reward functions)) and completions."""
    rewards = batch["rewards"]
    total = rewards.sum(-1)
    group_std = total.reshape(-1, num_generations).std(axis=1, ddof=1)
    metrics = {
        "reward": total.mean(),
        "reward_std": total.std(ddof=1),
        "frac_reward_zero_std": jnp.isclose(group_std, 0).mean(),
        "completions/mean_length": batch["completion_mask"].sum(-1).mean(),
    }
    return metrics | {f"rewards/{name}/mean": rewards[:, column].mean() for column, name in enumerate(reward_names)}


def train_metric_names(training_args) -> tuple[str, ...]:
    """What the train step sums over steps: each metric of a step (its mean over the batch), and the steps."""
    names = ["loss", "steps", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"]
    names += [f"clip_ratio/{bound}_mean" for bound in ("low", "high", "region")] + ["kl"] * bool(training_args.beta)
    return (*names, *(f"rewards/{name}/mean" for name in training_args.reward_funcs))


def grpo_metrics(sums: dict) -> dict:
    """The means over the steps of a log line (or of train_results.json) of every metric the steps sum."""
    steps = max(sums["steps"], 1.0)
    return {name: value / steps for name, value in sums.items() if name != "steps"}


# Copied from run_clm_flax.learning_rate_schedule
def learning_rate_schedule(settings: optimizers.OptimizerSettings, total_steps: int) -> optax.Schedule:
    """A linear warm-up from 0 to --learning_rate, then the schedule of LEARNING_RATE_SCHEDULES that
    --lr_scheduler_type names."""
    schedule_after_warmup = LEARNING_RATE_SCHEDULES[settings.lr_scheduler_type]
    return optimizers.after_linear_warmup(schedule_after_warmup, settings, total_steps)


# Copied from run_clm_flax.LEARNING_RATE_SCHEDULES
LEARNING_RATE_SCHEDULES = {
    "linear": optimizers.decay_to_the_end("linear"),
    "cosine": optimizers.decay_to_the_end("cosine"),
    "constant": lambda settings, *_: optax.constant_schedule(settings.learning_rate),
    "warmup_stable_decay": optimizers.warmup_stable_decay,
}


# Copied from run_clm_flax.decay_mask
def decay_mask(params):
    """True for the weights AdamW decays: matrices and embeddings, not biases or LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


# Copied from run_clm_flax.is_trained
def is_trained(path, param) -> bool:
    """Whether training updates this parameter (all do; to train only attention: `return "attn" in [entry.key for
    entry in path]`). A frozen one is not differentiated, has no optimizer state, no share in the gradient norm."""
    return True


# Copied from run_clm_flax.is_hidden_matrix
def is_hidden_matrix(path, param) -> bool:
    """Whether --optim muon trains this parameter with Muon: a 2-D kernel of the blocks (the attention and MLP
    projections) or a mixture of experts' stack of them (experts, in, out), each expert's matrix its own. The
    embeddings, the output layer and head (lm_head), norms and biases are AdamW's. Decided by name and shape, so a
    matrix added to a block goes to Muon as well; a new head named other than lm_head must be named here to stay
    with AdamW."""
    names = [entry.key for entry in path]
    is_kernel = (names[-1] == "kernel" and param.ndim == 2) or (names[-2:-1] == ["experts"] and param.ndim == 3)
    return is_kernel and "lm_head" not in names


# Copied from run_clm_flax.OPTIMIZERS
OPTIMIZERS = {
    "adamw": lambda settings, schedule: optimizers.adamw(settings, schedule, decay_mask),
    "muon": lambda settings, schedule: optimizers.muon_with_adamw(
        settings, schedule, optimizers.adamw(settings, schedule, decay_mask), is_hidden_matrix
    ),
    "lion": lambda settings, schedule: optimizers.lion(settings, schedule, decay_mask),
    "adafactor": lambda settings, schedule: optimizers.adafactor(settings, schedule, decay_mask),
}


# The tables the flags name, whose names --help lists.
FLAG_TABLES = {"optim": OPTIMIZERS, "lr_scheduler_type": LEARNING_RATE_SCHEDULES, "loss_type": LOSS_AGGREGATIONS}


# Copied from run_clm_flax.create_optimizer
def create_optimizer(
    settings: optimizers.OptimizerSettings, schedule: optax.Schedule, trains=None
) -> optax.GradientTransformation:
    """The optimizer of --optim, for the parameters is_trained picks (or `trains`, in its place: LoRA's adapters)."""
    optimizer = OPTIMIZERS[settings.optim](settings, schedule)
    if settings.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(settings.max_grad_norm), optimizer)
    return optimizers.trained_only(optimizer, trains or is_trained)


def make_train_step(model, optimizer, schedule, seed: int, training_args, trains=None):
    """The train step: the loss of grpo_loss on one generation batch (with the loss's flags), its update, and TRL's
    metrics of the batch; `trains`: what trains in place of is_trained (LoRA's adapters:
    flax_lm.training.lora.is_adapter)."""
    settings, reward_names = training_args.loss_settings(), tuple(training_args.reward_funcs)
    dropout_key = jax.random.key(seed + 1)  # unused: the log-probabilities are the sampling's, without dropout

    def loss_and_metrics(params, batch, dropout_rng):
        loss, metrics = grpo_loss(params, model, batch, settings)
        metrics |= reward_metrics(batch, reward_names, training_args.num_generations)
        return loss, metrics | {"loss": loss, "steps": jnp.ones((), jnp.float32)}

    def train_step(state: TrainState, batch):
        grads, metrics = step_gradients(loss_and_metrics, state, batch, dropout_key, trains or is_trained)
        new_state, update_metrics = apply_finite_update(state, grads, metrics["loss"], optimizer)
        return new_state, metrics | {"learning_rate": schedule(state.step)} | update_metrics

    return train_step


def script_training(training_args, adapters=None) -> ScriptTraining:
    """What flax_lm's set-up (set_up_training) builds the training from: this script's schedule, optimizer and train
    step (with the loss the flags choose), the metrics its train step sums, and the flag of its completions' length;
    with `adapters` (LoRA's) a train step that trains them alone."""
    make_step = partial(make_train_step, training_args=training_args)
    optimizer, metric_names = create_optimizer, train_metric_names(training_args)
    if adapters is not None:
        make_step, optimizer = partial(make_step, trains=is_adapter), partial(create_optimizer, trains=is_adapter)
    return ScriptTraining(learning_rate_schedule, optimizer, make_step, metric_names, "max_completion_length")


# ----------------------------------------------------------------------------------------------------
# Generation: each step's completions, their rewards and advantages; the reference's log-probabilities
# ----------------------------------------------------------------------------------------------------


def padded(rows: list[list[int]], length: int, pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of `rows` padded to `length`, on the left (prompts) or the right (completions)."""
    ids, mask = np.full((len(rows), length), pad_id, np.int32), np.zeros((len(rows), length), np.float32)
    for number, row in enumerate(rows):
        start = length - len(row) if left else 0
        ids[number, start : start + len(row)], mask[number, start : start + len(row)] = row, 1.0
    return ids, mask


class Generation:
    """The batch of each step: its prompts, each --num_generations times, their completions sampled from the
    weights the step starts from, the rewards and the advantages. The prompts' order and every completion's draw are
    keyed by the step alone, so that a resumed run samples what the interrupted one would have."""

    def __init__(self, setup: TrainingSetup, prompts: list, prompt_ids: list, tokenizer, training_args):
        self.setup, self.prompts, self.prompt_ids, self.tokenizer = setup, prompts, prompt_ids, tokenizer
        self.args, self.prompt_length = training_args, max(map(len, prompt_ids))
        self.order = np.random.default_rng(training_args.seed).permutation(len(prompts))
        self.sampler = make_sampler(setup.model, stop_token_ids(tokenizer, tokenizer.eos_token_id))  # a chat's too
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batch(self, params, step: int) -> tuple[dict, int, str]:
        """The global batch of step `step` + 1 (the steps done so far: `step`) as the compiled call takes it, its
        tokens, and its first completion's text."""
        args, batch_size = self.args, self.setup.train_batch_size
        per_step = batch_size // args.num_generations
        chosen = [self.order[(step * per_step + offset) % len(self.order)] for offset in range(per_step)]
        rows = [self.prompt_ids[index] for index in chosen for _ in range(args.num_generations)]
        samplings = [
            Sampling(
                args.max_completion_length, args.temperature, seed=args.seed, prompt_index=step * batch_size + row
            )
            for row in range(len(rows))
        ]
        completions = decode_rows(self.sampler, params, rows, samplings)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompt_texts = [prompt_text(self.prompts[index]) for index in chosen for _ in range(args.num_generations)]
        rewards = np.array(
            [[REWARD_FUNCTIONS[name](p, c) for name in args.reward_funcs] for p, c in zip(prompt_texts, texts)],
            np.float32,
        )
        batch = dict(zip(("prompt_ids", "prompt_mask"), padded(rows, self.prompt_length, self.pad_id, left=True)))
        ids, mask = padded(completions, args.max_completion_length, self.pad_id, left=False)
        batch |= {"completion_ids": ids, "completion_mask": mask, "rewards": rewards}
        batch["advantages"] = group_advantages(rewards.sum(-1), args.num_generations, args.scale_rewards)
        tokens = int(batch["prompt_mask"].sum() + mask.sum())
        local = {name: values[process_slice(batch_size)][None, None] for name, values in batch.items()}
        return to_global_batch(local, self.setup.call_batches_sharding), tokens, texts[0]


class Reference:
    """The reference's log-probabilities of each batch's completions, for the KL term of --beta: of the starting
    weights, read from --model_name_or_path (never from a checkpoint, so that a resumed run keeps its reference) and
    held beside the trained ones, outside the optimizer; with LoRA's adapters, of the base model: the frozen weights
    of the state without the adapters, no copy."""

    def __init__(self, setup: TrainingSetup, model_args, training_args):
        self.params = None
        if setup.adapters is None:
            abstract_params = setup.abstract_state.params
            params = model_args.pretrained_weights()(setup.model_code, abstract_params)
            self.params = jax.device_put(params, jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_params))

        def of_call(params, batches):  # arrays (1 step, 1 micro-batch, completions, ...), as the compiled call's
            flat = {name: values[0, 0] for name, values in batches.items()}
            return batch_log_probs(setup.model, params, flat, training_args.temperature)[None, None]

        self.of_call = jax.jit(of_call, out_shardings=setup.call_batches_sharding)

    def added(self, state: TrainState, batch: dict) -> dict:
        params = without_adapters(state.params) if self.params is None else self.params
        return batch | {"ref_log_probs": self.of_call(params, batch)}


# ----------------------------------------------------------------------------------------------------
# Main: a table of contents, then the functions it calls in that order, the loop among them
# ----------------------------------------------------------------------------------------------------


def main():
    argument_types = (ModelArguments, CommonDataArguments, TrainingArguments)
    model_args, data_args, training_args = start_run(argument_types, check_arguments, FLAG_TABLES)

    config, tokenizer = load_config_and_tokenizer(model_loading(model_args), "llama")
    mesh = create_mesh(training_args.mesh_shape)
    model_code = load_model_code(
        config, model_args.model_file, True, "run_grpo_flax.py", mesh, compare_exports=not model_args.skip_export_check
    )
    prompts = read_prompts(data_args.train_file)
    prompt_ids = tokenized_prompts(prompts, tokenizer, config, training_args)
    length = training_args.max_completion_length
    model = model_code.module.MODEL_CLASS(
        config, jnp.dtype(model_args.dtype), jnp.dtype(model_args.param_dtype), model_args.gradient_checkpointing, mesh
    )
    model, adapters = adapted(model, model_code, model_args, training_args, length, training_args.seed)
    script, settings = script_training(training_args, adapters), training_args.training_settings()
    # The training rows as the record of the run and its epochs count them: each prompt once per completion.
    rows = np.repeat(padded(prompt_ids, max(map(len, prompt_ids)), 0, left=True)[0], training_args.num_generations, 0)
    no_evaluation = lambda params, batch: {}  # noqa: E731
    setup = set_up_training(model, model_code, script, no_evaluation, settings, rows, length, adapters)
    apply_strategies(training_args, setup.steps_per_epoch, setup.total_steps)
    arguments = (model_args, data_args, training_args)
    state, this_run = start_training(setup, arguments, config, tokenizer, grpo_metrics, (), __file__)

    if this_run.trains_now:
        if jax.process_index() == 0:
            # grpo_log.jsonl: one tracker more, given what the others are.
            log_file = JsonLinesLog(training_args.output_dir, "grpo_log.jsonl", resumed=this_run.progress.step > 0)
            this_run.trackers.trackers.append(log_file)
        generation = Generation(setup, prompts, prompt_ids, tokenizer, training_args)
        reference = Reference(setup, model_args, training_args) if training_args.beta else None
        state, this_run.stopped_by = train(state, this_run, generation, reference, training_args)
    this_run.finish(state, None, lambda: None)


def train(state, this_run, generation: Generation, reference: Reference | None, training_args):
    """Train from the step after `this_run.progress.step` to the last, one generation batch a step, logging every
    --logging_steps (with a sampled completion), saving every --save_steps and at the end, or after the step in
    which a stop was requested. Returns the state and the signal that stopped training, None if it ran to the end."""
    progress, setup, log = this_run.progress, this_run.setup, this_run.log
    with (
        open_checkpoints(training_args.output_dir, training_args.save_total_limit, None) as checkpoints,
        StopRequest() as stop,
        log,
    ):
        checkpoint_being_written, step = None, progress.step
        while step < setup.total_steps:
            batch, tokens, sample = generation.batch(state.params, step)
            if reference is not None:
                batch = reference.added(state, batch)
            state, metrics = setup.compiled_train_steps(state, batch, 1)
            log.steps_done(metrics, [tokens])
            step += 1
            checkpoint_being_written = log_when_committed(checkpoints, checkpoint_being_written)
            is_last = step == log.total_steps
            is_log_step = logs_at_step(step, is_last, training_args.logging_steps, training_args.logging_first_step)
            stopping = stop.requested(check_other_processes=is_log_step)
            is_save_step = step % training_args.save_steps == 0 or is_last or stopping
            if is_log_step or is_save_step:
                log.add_steps_to_progress(step, progress, checkpoints)
            if is_log_step or stopping:
                log.write(step)
                logger.info("step %d: a completion: %r", step, sample)
            if is_save_step:
                wait_until_committed(checkpoints, checkpoint_being_written)  # announced before the save waits for it
                progress.step = step
                checkpoint_being_written = this_run.save(checkpoints, state, progress)
            if stopping:
                break
        wait_until_committed(checkpoints, checkpoint_being_written)
    return state, stop.signal_name if stopping else None


if __name__ == "__main__":
    call_with_one_line_errors(main)
