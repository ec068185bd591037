"""lm-evaluation-harness tasks scored by the JAX model: lm-eval's model interface over flax_lm.evaluation.scoring
(loglikelihood, loglikelihood_rolling) and flax_lm.generation.sampling (generate_until), and the tasks a run scores at
each evaluation.

The scores are those of lm-eval's `hf` backend on the exported model in PyTorch: the same encoding of contexts and
continuations (lm-eval's own, TemplateLM's), the same cut from the left of what is longer than the model's positions,
the same rolling windows over a text, greedy decoding to the same stop strings. lm-eval is optional: this module
needs it (`pip install lm_eval`), and run_clm_flax.py imports it only for --eval_tasks.
"""

import logging
import os
import random

import lm_eval.evaluator
import numpy as np
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from flax_lm.data.chat import chat_template_of
from flax_lm.devices.processes import main_process_first
from flax_lm.errors import UsageError
from flax_lm.evaluation.scoring import Scorer
from flax_lm.generation.sampling import DecodingBatch, Sampling

logger = logging.getLogger(__name__)

# The seeds lm_eval.simple_evaluate sets (Python's, NumPy's and the few-shot examples' draws), so that a task scores
# here as it does there.
PYTHON_SEED, NUMPY_SEED, FEWSHOT_SEED = 0, 1234, 1234
# Decoding steps between two looks for the stop strings of generate_until.
STEPS_PER_LOOK = 8


class FlaxLM(TemplateLM):
    """lm-eval's model interface over the JAX model: `scorer` and `sampler` compiled for it, `tokenizer` its own,
    `batch_size` rows decoded together, and the parameters to score with in `params`, set before each evaluation.
    Every process of a run answers every request (rank 0 of 1 to lm-eval), so each holds the whole results."""

    def __init__(self, scorer: Scorer, sampler, tokenizer, batch_size: int):
        super().__init__()
        self.scorer, self.sampler, self.tokenizer, self.batch_size = scorer, sampler, tokenizer, batch_size
        self.params = None
        self.max_gen_toks = 256  # the hf backend's default of new tokens, where a task gives none

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # What an empty context and the first rolling window start from: BOS, else EOS, as in the hf backend.
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval's request caches are told the prompts were rendered with (the hf backend's value)."""
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return chat_template_of(self.tokenizer)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation lm-eval makes of a prompt (--apply_chat_template) rendered by the tokenizer's template as
        the hf backend renders it: asking for the assistant's turn, or continuing its last message."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            # As the hf backend: the tokenizer adds its special tokens, unless the text begins with BOS already.
            add_special_tokens = not string.startswith(self.tokenizer.decode([self.prefix_token_id]))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding writes it) for each (cache key, context ids,
        continuation ids); context and continuation together longer than the positions plus one lose their first
        tokens."""
        sequences = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's {self.max_length} "
                    "positions"
                )
            sequences.append((context + continuation)[-(self.max_length + 1) :])
        answers = []
        for (key, _, continuation), scores in zip(requests, self.scorer.score(self.params, sequences, progress=True)):
            scored = slice(len(scores.log_probs) - len(continuation), None)
            answer = (float(scores.log_probs[scored].astype(np.float64).sum()), bool(scores.is_greedy[scored].all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, every token predicted once, from the prefix token on, in windows of
        the model's positions that keep as much context as fits (lm-eval's rolling windows)."""
        windows, owners = [], []
        for owner, (text,) in enumerate(request.args for request in requests):
            token_windows = get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            for context, continuation in map(make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_likelihood
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued greedily (drawn, where the task sets do_sample) up to its first stop string, the
        end-of-text token or max_gen_toks new tokens; the context loses its first tokens where it leaves no room."""
        end_of_text = self.tokenizer.decode([self.eot_token_id])
        prompts, samplings, stops = [], [], []
        for index, (context, generation_kwargs) in enumerate(request.args for request in requests):
            settings = normalize_gen_kwargs(generation_kwargs, self.max_gen_toks)
            stops.append(handle_stop_sequences(settings.pop("until", None), end_of_text))
            max_new_tokens = settings.pop("max_gen_toks")
            room = self.max_length - max_new_tokens
            if room <= 0:
                raise ValueError(
                    f"a task asks for {max_new_tokens} new tokens, which leave no room for a context in the model's "
                    f"{self.max_length} positions"
                )
            settings.pop("do_sample")
            sampling = Sampling(
                max_new_tokens,
                temperature=float(settings.pop("temperature", 0.0)),
                top_k=int(settings.pop("top_k", None) or 0),
                top_p=float(settings.pop("top_p", None) or 1.0),
                seed=FEWSHOT_SEED,
                prompt_index=index,
            )
            if settings or sampling.problem(""):
                raise ValueError(f"generation settings {generation_kwargs} are not supported: {sampling.problem('')}")
            prompts.append(self.tok_encode(context)[-room:] or [self.prefix_token_id])
            samplings.append(sampling)
        texts = [""] * len(requests)
        order = sorted(range(len(requests)), key=lambda index: -len(prompts[index]))  # less padding
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            new_ids = self.decode_rows(*([items[row] for row in rows] for items in (prompts, samplings, stops)))
            for row, ids in zip(rows, new_ids):
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                texts[row] = postprocess_generated_text(text, stops[row], think_end_token=None)
                self.cache_hook.add_partial("generate_until", requests[row].args, texts[row])
        return texts

    def decode_rows(self, prompts: list[list[int]], samplings: list[Sampling], stops: list[list[str]]):
        """The new tokens of each prompt, decoded together; a row ends once its text holds one of its stop strings."""
        batch = DecodingBatch(self.sampler, self.params, prompts, samplings)
        new_ids, ended = [[] for _ in prompts], set()
        while not all(finished or row in ended for row, finished in enumerate(batch.finished)):
            for row, ids in enumerate(batch.advance(STEPS_PER_LOOK, ended=sorted(ended))):
                new_ids[row] += ids
                text = self.tokenizer.decode(new_ids[row], skip_special_tokens=True)
                if any(stop and stop in text for stop in stops[row]):
                    ended.add(row)
        return new_ids


class TaskFileLoader(yaml.SafeLoader):
    """YAML's safe loader, taking a tag of lm-eval's (!function) for the plain value under it: enough to tell whether
    a task file parses, without running its code."""


TaskFileLoader.add_multi_constructor("!", lambda loader, tag, node: None)


def first_unparsed_yaml(folder: str) -> tuple[str, str] | None:
    """The first YAML file under `folder` (sorted) that does not parse, and YAML's error in one line; None where all
    do. lm-eval leaves such a file out of its index with no word, and its task is then merely unknown."""
    paths = sorted(
        os.path.join(root, name) for root, _, names in os.walk(folder) for name in names if name.endswith(".yaml")
    )
    for path in paths:
        try:
            with open(path, encoding="utf-8") as file:
                yaml.load(file, Loader=TaskFileLoader)
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            return path, " ".join(str(error).split())
    return None


def task_index(names: list[str], include_path: str | None):
    """lm-eval's index of the tasks that holds every name: that of the YAML files under include_path alone where it
    does (lm-eval's own index of some 15000 tasks takes seconds to build), else lm-eval's with them."""
    if include_path:
        local_index = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local_index.all_tasks for name in names):
            return local_index
    index = TaskManager(include_path=include_path)
    if unknown := [name for name in names if name not in index.all_tasks]:
        if include_path and (unparsed := first_unparsed_yaml(include_path)):
            path, error = unparsed
            raise UsageError(
                f"--eval_tasks: no task or group named '{unknown[0]}', and {path} under --eval_tasks_path does not "
                f"parse as YAML ({error}), so lm-eval skipped it; fix that file"
            )
        where = f" or in --eval_tasks_path {include_path}" if include_path else ""
        raise UsageError(
            f"--eval_tasks: lm-eval has no task or group named '{unknown[0]}'{where}; `lm-eval ls tasks` lists them"
        )
    return index


class HarnessTasks:
    """The lm-eval tasks or groups `names` (from lm-eval's own and the YAML files under `include_path`) that a run
    scores with `model` (a FlaxLM), on the first `limit` documents of each (all where None). With
    `apply_chat_template`, each prompt is a conversation rendered by the tokenizer's chat template, the few-shot
    examples as earlier turns with `fewshot_as_multiturn`, as lm-eval's flags of those names make them. The tasks are
    looked up and their data read here, so that a wrong name or data file is refused before any training."""

    def __init__(
        self,
        names: list[str],
        include_path: str | None,
        limit: int | None,
        model: FlaxLM,
        apply_chat_template: bool = False,
        fewshot_as_multiturn: bool = False,
    ):
        self.names, self.limit, self.model = names, limit, model
        self.apply_chat_template, self.fewshot_as_multiturn = apply_chat_template, fewshot_as_multiturn
        if apply_chat_template and chat_template_of(model.tokenizer) is None:
            raise UsageError(
                "--apply_chat_template renders the task prompts with the tokenizer's chat template, and the tokenizer "
                "has none; leave the flag out, or give it one (--chat_template_path)"
            )
        self.index = task_index(names, include_path)
        with main_process_first("evaluation tasks loaded"):  # process 0 fills the datasets cache
            self.load()

    def load(self) -> dict:
        try:
            return self.index.load(self.names)
        except Exception as error:  # a task's data or YAML: its error, whatever lm-eval or datasets raised
            message = " ".join(str(error).split())
            raise UsageError(f"--eval_tasks {','.join(self.names)}: cannot load the tasks: {message}") from None

    def __call__(self, params) -> dict[str, dict[str, float]]:
        """{task or group: {metric: value}} of `params`. lm_eval.evaluator.evaluate does the work, with the task
        settings lm_eval.simple_evaluate would make (no few-shot examples unless the task sets them, its seeds),
        without simple_evaluate's report of the environment, which takes seconds each time."""
        self.model.params = params
        loaded = self.load()
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        random.seed(PYTHON_SEED)
        np.random.seed(NUMPY_SEED)
        results = lm_eval.evaluator.evaluate(
            lm=self.model,
            task_dict=loaded,
            limit=self.limit,
            bootstrap_iters=0,
            log_samples=False,
            apply_chat_template=self.apply_chat_template,
            fewshot_as_multiturn=self.fewshot_as_multiturn,
        )
        return metric_values(results["results"])

    @staticmethod
    def describe(task_results: dict) -> str:
        """Results of __call__ in words: "hellaswag acc 0.2850 acc_norm 0.3010; arc_easy acc 0.4200 ..."."""
        return "; ".join(
            " ".join([task, *(f"{metric} {value:.4f}" for metric, value in metrics.items())])
            for task, metrics in task_results.items()
        )

    def report(self, task_results: dict, step: int, trackers):
        """The log line and the tracker scalars (eval/TASK/METRIC) of results of __call__."""
        logger.info("step %d: eval tasks: %s", step, self.describe(task_results))
        scalars = {
            f"eval/{task}/{metric}": value
            for task, metrics in task_results.items()
            for metric, value in metrics.items()
        }
        trackers.scalars(scalars, step)


def metric_values(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's results by task ({"acc,none": 0.25, "acc_stderr,none": "N/A", "alias": ...}) as {metric: value}: the
    metrics under lm-eval's default filter by their names, others as metric_filter; standard errors left out."""
    values = {}
    for task, metrics in results.items():
        values[task] = {}
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or isinstance(value, (str, bool)) or value is None:
                continue
            values[task][metric if filter_name == "none" else f"{metric}_{filter_name}"] = float(value)
    return values
