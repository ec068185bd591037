"""The evaluation of a run's validation rows, reported: the whole data's results and, with --data_mixture, each
source's, in the log and the trackers (the script's eval step makes the sums, its functions turn them into
results and words)."""

import logging
from dataclasses import dataclass

import jax
from tqdm.auto import tqdm

from flax_lm.devices.mesh import prefetch, to_global_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationSchedule:
    """When a training run evaluates: the training flags --do_eval, --eval_on_start and --eval_steps (the interval
    --eval_strategy gives, or --logging_steps where unset; the scripts' training arguments give theirs,
    CommonTrainingArguments.evaluation_schedule)."""

    do_eval: bool
    eval_on_start: bool
    eval_steps: int


def evaluation_sets(validation) -> dict:
    """{name: rows} of the evaluation data: each source of a mixture by its name, or the one set named ""."""
    return validation if isinstance(validation, dict) else {"": validation}


def summed(sums: list[dict]) -> dict:
    """The sums of several evaluations (dicts of the same names) added: those of the whole data."""
    return {name: sum(part[name] for part in sums) for name in sums[0]}


def evaluate_by_source(sums_of, validation, results_of) -> dict:
    """The results of the whole evaluation data, with a mixture's each source's under "sources" ({} otherwise):
    `sums_of(rows)` evaluates one set into sums, `results_of(sums)` turns sums into results."""
    sums = {name: sums_of(rows) for name, rows in evaluation_sets(validation).items()}
    results = results_of(summed(list(sums.values())))
    results["sources"] = {name: results_of(part) for name, part in sums.items() if name}
    return results


def report_by_source(results: dict, step: int, trackers, metric_names: tuple, describe):
    """The log line (`describe(results)`: the metrics in words) and tracker scalars of an evaluation, whole and of
    each source."""
    for name, part in [("", results), *results["sources"].items()]:
        logger.info("step %d: eval%s %s", step, f" of {name}" if name else "", describe(part))
        prefix = f"eval/{name}/" if name else "eval/"
        trackers.scalars({prefix + key: part[key] for key in metric_names if key in part}, step)


def validation_results(sums_of, validation, results_of, step: int, trackers, metric_names: tuple, describe) -> dict:
    """evaluate_by_source's results of the validation rows, reported (report_by_source) at `step`."""
    results = evaluate_by_source(sums_of, validation, results_of)
    report_by_source(results, step, trackers, metric_names, describe)
    return results


def summed_over_batches(eval_step, params, local_batches, num_batches: int, batch_sharding) -> dict:
    """The sums `eval_step(params, batch)` makes, added up on the host over every batch: this process's rows of each
    global batch (`local_batches`, of `num_batches` in all, read ahead while the devices evaluate)."""
    totals = {}
    batches = prefetch(to_global_batch(batch, batch_sharding) for batch in local_batches)
    for batch in tqdm(batches, total=num_batches, desc="Evaluating", leave=False, disable=jax.process_index() > 0):
        for name, value in jax.device_get(eval_step(params, batch)).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def saved_results(results: dict, names: tuple, validation) -> dict:
    """What eval_results.json holds of an evaluation: eval_NAME of the whole data and eval_SOURCE_NAME of each source
    (null where a result is missing), and eval_samples, the rows evaluated."""
    saved = {f"eval_{name}": results.get(name) for name in names}
    for source, source_results in results["sources"].items():
        saved.update({f"eval_{source}_{name}": source_results.get(name) for name in names})
    return saved | {"eval_samples": sum(map(len, evaluation_sets(validation).values()))}


def evaluate_on_start(evaluate, params, progress, schedule: EvaluationSchedule):
    """--eval_on_start: with --do_eval, evaluate the model of a new run before its first step (at step 0). With
    --metric_for_best_model, evaluate a resumed checkpoint of an evaluation step whose best model lacks its
    evaluation: the loop evaluates after it saves, so a checkpoint records the best before its own step's."""
    if not schedule.do_eval:
        return
    if schedule.eval_on_start and progress.step == 0:
        evaluate(params, 0)
    best, step = progress.best_model, progress.step
    if best and 0 < step and best.evaluated_step < step and step % schedule.eval_steps == 0:
        best.consider(evaluate(params, step), step)
