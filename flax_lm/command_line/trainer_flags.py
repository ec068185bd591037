"""The Hugging Face Trainer's and TRL's flags in these scripts: their names for flags of ours that mean the same
(taken as ours, on the command line and in a JSON file of arguments), the Trainer flags that cannot apply here
(refused in one line saying what to do instead), and the Trainer's evaluation and save strategies as the step
intervals the training loop counts in."""

from flax_lm.errors import UsageError

# Flags of the Hugging Face examples that these scripts do not take, and what to do instead.
UNSUPPORTED_FLAGS = {
    "push_to_hub": "upload the model after training with `hf upload` as docs/exporting.md shows (its files alone)",
    "hub_model_id": "upload the model after training with `hf upload MODEL_ID OUTPUT_DIR` as docs/exporting.md shows",
    "hub_token": "upload the model after training with `hf upload`, which takes the token of `hf auth login`",
    "use_fast_tokenizer": "the tokenizer is always the fast (tokenizers-backed) one; leave the flag out",
    "remat_policy": "name the policy after --gradient_checkpointing, e.g. --gradient_checkpointing dots_saveable",
    "adafactor": "pass --optim adafactor",
    "torch_compile": "the steps are compiled by XLA always (jax.jit); leave the flag out",
    "fp16": "pass --dtype float16 (or --bf16, the same as --dtype bfloat16)",
    "tf32": "matrix products run at the precision of --dtype; leave the flag out",
    "deepspeed": "spread the model over the devices with --mesh_shape (data, FSDP and tensor parallel)",
    "fsdp": "shard the parameters over the devices with --mesh_shape, e.g. --mesh_shape 1,8,1",
    "dataloader_num_workers": "batches are assembled ahead of the step in a thread of their own; tokenizing in "
    "processes is --preprocessing_num_workers",
    "gradient_checkpointing_kwargs": "name the policy after --gradient_checkpointing, e.g. --gradient_checkpointing "
    "dots_saveable",
}

# Trainer's and TRL's names for flags these scripts take under another name: each is taken as the first of the
# script's flags that it lists (--max_length is run_clm_flax.py's --block_size, run_mlm_flax.py's --max_seq_length).
FLAG_ALIASES = {
    "max_length": ["block_size", "max_seq_length"],
    "max_seq_length": ["block_size"],
    "dataset_text_field": ["text_column_name"],
    "dataset_num_proc": ["preprocessing_num_workers"],
    "lora_r": ["lora_rank"],
}
# Trainer's --bf16 (compute in bfloat16, the parameters kept in float32) is --dtype bfloat16.
SWITCH_ALIASES = {"bf16": ("dtype", "bfloat16")}
# Trainer's names of learning rate schedules ours compute: the cosine decays to --min_lr_rate (cosine_with_min_lr's
# min_lr_rate), and every schedule starts with the warm-up (constant_with_warmup).
LEARNING_RATE_SCHEDULE_ALIASES = {"cosine_with_min_lr": "cosine", "constant_with_warmup": "constant"}
TRUE_WORDS, FALSE_WORDS = {"true", "yes", "1"}, {"false", "no", "0"}


def with_flags_renamed(arguments: list[str], known: set[str]) -> list[str]:
    """The command line with Trainer's and TRL's names of our flags (FLAG_ALIASES, SWITCH_ALIASES) replaced by ours."""
    renamed, position = [], 0
    while position < len(arguments):
        argument = arguments[position]
        position += 1
        name, equals, value = argument[2:].partition("=") if argument.startswith("--") else ("", "", "")
        if name in SWITCH_ALIASES and name not in known:
            if not equals and position < len(arguments) and arguments[position].lower() in TRUE_WORDS | FALSE_WORDS:
                value, equals = arguments[position], "="
                position += 1
            if not equals or value.lower() in TRUE_WORDS:
                flag, flag_value = SWITCH_ALIASES[name]
                renamed += [f"--{flag}", flag_value]
            elif value.lower() not in FALSE_WORDS:
                raise UsageError(f"--{name} takes true or false, not {value}")
            continue
        if name in FLAG_ALIASES and name not in known:
            target = next((flag for flag in FLAG_ALIASES[name] if flag in known), None)
            if target is not None:
                argument = f"--{target}{equals}{value}"
        renamed.append(argument)
    return renamed


def with_keys_renamed(values: dict, known: set[str]) -> dict:
    """An arguments file's values with Trainer's and TRL's names of our flags replaced by ours."""
    renamed = {}
    for name, value in values.items():
        if name in SWITCH_ALIASES and name not in known:
            if not isinstance(value, bool):
                raise UsageError(f"'{name}' takes true or false, not {value!r}")
            if value:
                flag, flag_value = SWITCH_ALIASES[name]
                renamed[flag] = flag_value
            continue
        targets = [flag for flag in FLAG_ALIASES.get(name, []) if flag in known] if name not in known else []
        renamed[targets[0] if targets else name] = value
    return renamed


def with_alias_values(parsed: tuple) -> tuple:
    for arguments in parsed:
        schedule = getattr(arguments, "lr_scheduler_type", None)
        if schedule in LEARNING_RATE_SCHEDULE_ALIASES:
            arguments.lr_scheduler_type = LEARNING_RATE_SCHEDULE_ALIASES[schedule]
    return parsed


def refuse_unknown_arguments(arguments: list[str]):
    for argument in arguments:
        name = argument.split("=")[0].lstrip("-").replace("-", "_")
        if name in UNSUPPORTED_FLAGS:
            raise UsageError(f"--{name} is not supported: {UNSUPPORTED_FLAGS[name]}")
    if arguments:
        raise UsageError(f"unknown argument {arguments[0]}; see --help for the arguments this script takes")


def apply_strategies(training_args, steps_per_epoch: int | None, total_steps: int):
    """--eval_strategy and --save_strategy as the intervals the loop counts in: an epoch's steps for epoch, the whole
    run for no (the loop evaluates only after it and saves only at its end)."""
    for strategy, interval in (("eval_strategy", "eval_steps"), ("save_strategy", "save_steps")):
        if getattr(training_args, strategy) == "epoch":
            if steps_per_epoch is None:
                raise UsageError(f"--{strategy} epoch needs training data of known length; pass --{strategy} steps")
            setattr(training_args, interval, steps_per_epoch)
        elif getattr(training_args, strategy) == "no":
            setattr(training_args, interval, max(total_steps, 1))
    check_best_model_schedule(training_args)


def check_best_model_flags(training_args, eval_metrics: tuple):
    """--metric_for_best_model as Trainer names it (eval_NAME, of the script's `eval_metrics`), defaulting to the
    loss with --load_best_model_at_end, and --greater_is_better defaulting to false for a loss, true otherwise."""
    metric = training_args.metric_for_best_model
    if metric is None and training_args.load_best_model_at_end:
        metric = "loss"
    if metric is None:
        if training_args.greater_is_better is not None:
            raise UsageError("--greater_is_better applies to --metric_for_best_model; add it or leave the flag out")
        return
    name = metric.removeprefix("eval_")
    if name not in eval_metrics:
        choices = ", ".join(eval_metrics)
        raise UsageError(f"--metric_for_best_model {metric} is not a metric of the evaluation; pass one of {choices}")
    if not training_args.do_train or not training_args.do_eval:
        raise UsageError("--metric_for_best_model compares the evaluations of training: add --do_train --do_eval")
    training_args.metric_for_best_model = f"eval_{name}"
    if training_args.greater_is_better is None:
        training_args.greater_is_better = not name.endswith("loss")


def check_best_model_schedule(training_args):
    """The best model is one of the saved checkpoints, so with --load_best_model_at_end every evaluation falls on a
    save, as Trainer requires (once apply_strategies has made the strategies intervals)."""
    if not training_args.load_best_model_at_end:
        return
    eval_strategy, save_strategy = training_args.eval_strategy, training_args.save_strategy
    if eval_strategy != save_strategy:
        raise UsageError(
            f"--load_best_model_at_end needs the saves and evaluations on the same schedule: --eval_strategy "
            f"{eval_strategy} and --save_strategy {save_strategy} differ; pass the same strategy to both"
        )
    eval_steps = training_args.eval_steps or training_args.logging_steps
    if eval_strategy == "steps" and training_args.save_steps % eval_steps:
        raise UsageError(
            f"--load_best_model_at_end chooses among the saved evaluated steps: --save_steps "
            f"{training_args.save_steps} must be a multiple of --eval_steps {eval_steps}"
        )
