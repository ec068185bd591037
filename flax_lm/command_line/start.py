"""A training script's start: its flags parsed and checked on every process once the processes of the run have
joined (those that name the script's own tables, its optimizers and schedules, among them), the log set up, and
--output_dir checked before anything is written into it."""

from collections.abc import Callable

import jax

from flax_lm.command_line.arguments import parse_training_arguments
from flax_lm.devices.processes import initialize_distributed, on_process_zero, setup_logging, wait_for_all_processes
from flax_lm.errors import UsageError
from flax_lm.run.output_dir import check_output_dir
from flax_lm.training.optimizers import DECAY_SHAPES


def start_run(argument_types: tuple, check_arguments: Callable, flag_tables: dict) -> tuple:
    """The script's arguments (of `argument_types`: model, data, training; `flag_tables`: the tables its flags name,
    listed by --help), parsed and checked (check_flag_tables, then the script's `check_arguments`) on every process,
    once the processes of the run have joined; then the log, and --output_dir checked by process 0 before anything
    is written into it."""
    model_args, data_args, training_args, distributed_args = parse_training_arguments(*argument_types, flag_tables)
    initialize_distributed(distributed_args.process_group())
    check_flag_tables(training_args, flag_tables)
    check_arguments(model_args, data_args, training_args)
    # Every process checks --output_dir before process 0 writes into it. On CPU, this first exchange also sets up
    # the processes' collectives, which they must reach within 30 s of each other: right after joining, they do.
    wait_for_all_processes("arguments checked")
    setup_logging(is_main_process=jax.process_index() == 0)
    on_process_zero(
        lambda: check_output_dir(training_args.output_dir_settings()), f"use --output_dir {training_args.output_dir}"
    )
    return model_args, data_args, training_args


def check_flag_tables(training_args, flag_tables: dict):
    """Refuse, before any work, a flag whose value the script's table does not name (`flag_tables`: {"optim":
    OPTIMIZERS, "lr_scheduler_type": LEARNING_RATE_SCHEDULES}), a decay shape DECAY_SHAPES does not name, and a floor
    for a schedule that does not decay."""
    check_choices(training_args, **flag_tables, lr_decay_shape=DECAY_SHAPES)
    if training_args.min_lr_rate and training_args.lr_scheduler_type == "constant":
        raise UsageError("--min_lr_rate sets where a decay ends; use it with a --lr_scheduler_type that decays")


def check_choices(argument_group, **tables):
    """Refuse a flag whose value is not a key of its table: the script's own (OPTIMIZERS, LEARNING_RATE_SCHEDULES),
    so that a name added to the table of a copied script is taken by the flag at once."""
    for flag, table in tables.items():
        value = getattr(argument_group, flag)
        if value not in table:
            raise UsageError(f"--{flag} {value} is not one of {', '.join(table)}")
