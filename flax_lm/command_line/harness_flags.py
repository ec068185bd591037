"""The flags of lm-evaluation-harness tasks (--eval_tasks and the settings of lm-eval's that go with them), which a
script that scores its model on the harness's tasks takes beside its own, and their checks."""

import importlib.util
import os
from dataclasses import dataclass, field

from flax_lm.errors import UsageError


@dataclass
class HarnessArguments:
    eval_tasks: str | None = field(
        default=None,
        metadata={
            "help": "lm-evaluation-harness tasks or groups, comma-separated (hellaswag,arc_easy,lambada_openai), "
            "scored by the model at every evaluation and at the end (needs `pip install lm_eval`). With --do_eval "
            "alone they score --model_name_or_path, and no evaluation data is needed."
        },
    )
    eval_tasks_path: str | None = field(
        default=None,
        metadata={"help": "A directory of task YAML files of your own, for --eval_tasks (lm-eval's include path)."},
    )
    eval_tasks_limit: int | None = field(
        default=None,
        metadata={"help": "Score only the first N documents of each task of --eval_tasks: quicker, less exact."},
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={"help": "Prompt --eval_tasks as conversations in the tokenizer's chat template (lm-eval's flag)."},
    )
    fewshot_as_multiturn: bool | None = field(
        default=None,
        metadata={
            "help": "Each few-shot example of --eval_tasks a chat turn of its own (lm-eval's flag); default: as "
            "--apply_chat_template, as in lm-eval.",
            "nargs": "?",
            "const": True,
        },
    )


def check_harness_flags(arguments: HarnessArguments):
    """Refuse the harness flags that cannot apply, each in one line, and default --fewshot_as_multiturn as lm-eval
    does. `arguments`: the script's training arguments (with --do_eval), which hold the harness flags."""
    if arguments.eval_tasks:
        if importlib.util.find_spec("lm_eval") is None:
            raise UsageError("--eval_tasks needs lm-evaluation-harness, which is not installed: pip install lm_eval")
        if not arguments.do_eval:
            raise UsageError("--eval_tasks are scored at each evaluation: add --do_eval")
        if arguments.eval_tasks_path and not os.path.isdir(arguments.eval_tasks_path):
            raise UsageError(f"--eval_tasks_path {arguments.eval_tasks_path} is not a directory")
    elif arguments.eval_tasks_path or arguments.eval_tasks_limit or arguments.apply_chat_template:
        raise UsageError(
            "--eval_tasks_path, --eval_tasks_limit and --apply_chat_template apply to --eval_tasks; add it or leave "
            "them out"
        )
    if arguments.fewshot_as_multiturn and not arguments.apply_chat_template:
        raise UsageError("--fewshot_as_multiturn makes the few-shot examples chat turns: add --apply_chat_template")
    if arguments.fewshot_as_multiturn is None:
        arguments.fewshot_as_multiturn = arguments.apply_chat_template
