"""What a run reports: the training log (log lines, progress bar, non-finite steps) and the trackers of --report_to
(TensorBoard without TensorFlow, Weights & Biases, MLflow)."""

import html
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass

import jax
from tqdm.auto import tqdm

from flax_lm.errors import UsageError
from flax_lm.run.checkpoints import last_intact_checkpoint
from flax_lm.run.checksums import checkpoint_has_checksums
from flax_lm.run.output_dir import TRACKER_RUNS_FILE, write_json
from flax_lm.run.run_files import record_run_files, unlinked

logger = logging.getLogger(__name__)


class TrainingLog:
    """What the loop reports. It holds the metrics of the steps not yet read from the devices and of those since
    the last log line, stops on a non-finite step (or skips it, with --skip_nonfinite_steps), and writes the log
    line, the progress bar and TensorBoard. As a `with` block it times the training and, leaving it, ends the
    progress bar's line before any error is printed."""

    def __init__(self, trackers, progress, total_steps: int, train_metrics, skip_nonfinite_steps: bool):
        """`progress`: the TrainingProgress training starts from; `train_metrics(sums)`: the script's metrics of a log
        line, from the sums of the train step's metrics (progress.metric_names) over the steps it covers."""
        self.trackers, self.skip_nonfinite_steps = trackers, skip_nonfinite_steps
        self.first_step, self.total_steps = progress.step, total_steps
        self.metric_names, self.train_metrics = progress.metric_names, train_metrics
        self.unread, self.window, self.tokens = [], [], 0
        self.unread_steps_shown = 0  # calls of `unread` whose steps the progress bar counts

    def __enter__(self):
        self.progress_bar = tqdm(
            initial=self.first_step, total=self.total_steps, desc="Training", disable=jax.process_index() > 0
        )
        self.start = self.window_start = time.perf_counter()
        self.window_first_step = self.first_step  # the step before those of the next log line
        return self

    def __exit__(self, *exception):
        self.progress_bar.close()
        self.runtime = time.perf_counter() - self.start

    def steps_done(self, metrics: dict, step_tokens: list[int]):
        """The steps of one compiled call: `metrics` stacked over them (entries beyond the call's steps unused), and
        the tokens of each. Kept on the devices until read: fetching them would wait for the steps to finish."""
        self.unread.append((metrics, step_tokens))
        self.tokens += sum(step_tokens)
        self.show_finished_steps()

    def show_finished_steps(self, all_finished: bool = False):
        """Advance the progress bar over the calls whose steps have finished, asking the devices without waiting: a
        call returns when it is queued, and the bar counts steps done, not steps queued."""
        while self.unread_steps_shown < len(self.unread):
            metrics, step_tokens = self.unread[self.unread_steps_shown]
            if not (all_finished or jax.tree_util.tree_leaves(metrics)[0].is_ready()):
                break
            self.progress_bar.update(len(step_tokens))
            self.unread_steps_shown += 1

    def add_steps_to_progress(self, step: int, progress, checkpoints):
        """Wait for the steps not yet read (the last of them `step`), and add the finite ones to `progress` and to
        the next log line. Done before each save, so that no non-finite step goes unnoticed into a checkpoint."""
        finite = self.finite_steps(self.fetch_unread(), step, checkpoints)
        progress.add(finite)
        progress.segment_done(self.first_step, step, time.perf_counter() - self.start, self.tokens)
        self.window += finite

    def fetch_unread(self) -> list[dict]:
        """The metrics (and tokens) of each step not yet read, fetched from the devices."""
        fetched = [
            {**{name: values[index] for name, values in metrics.items()}, "tokens": tokens}
            for metrics, step_tokens in jax.device_get(self.unread)
            for index, tokens in enumerate(step_tokens)
        ]
        self.show_finished_steps(all_finished=True)
        self.unread, self.unread_steps_shown = [], 0
        return fetched

    def finite_steps(self, fetched: list[dict], step: int, checkpoints) -> list[dict]:
        """The steps of `fetched` (the last of them `step`) whose loss and gradient norm are finite. Another step's
        update was never applied; it stops the run (nonfinite_error), or is logged and skipped with
        --skip_nonfinite_steps."""
        first_step = step - len(fetched) + 1
        bad_steps = [first_step + index for index, metrics in enumerate(fetched) if not metrics["finite"]]
        if bad_steps and not self.skip_nonfinite_steps:
            raise self.nonfinite_error(bad_steps[0], checkpoints)
        for bad_step in bad_steps:
            logger.warning("step %d: the loss or gradient norm is not finite; the update was skipped", bad_step)
        return [metrics for metrics in fetched if metrics["finite"]]

    @staticmethod
    def nonfinite_error(step: int, checkpoints) -> UsageError:
        last_good = last_intact_checkpoint(checkpoints)
        if last_good is None:
            saved = (
                "no training checkpoint saved is intact"
                if checkpoints.all_steps()
                else "no training checkpoint was saved yet"
            )
            advice = f"{saved}. Lower --learning_rate and start again"
        elif not checkpoint_has_checksums(last_good):  # saved by an earlier version: its bytes cannot be checked
            advice = (
                f"the newest checkpoint is {last_good}, saved without checksums, so it may be damaged (then take an "
                "earlier one). Lower --learning_rate and continue with --resume_from_checkpoint"
            )
        else:
            advice = (
                f"the last good checkpoint is {last_good}. Lower --learning_rate and continue with "
                "--resume_from_checkpoint"
            )
        return UsageError(
            f"the loss or gradient norm is not finite at step {step}; its update was not applied and nothing "
            f"was saved after it; {advice}, or pass --skip_nonfinite_steps to skip such steps"
        )

    def write(self, step: int):
        """The log line of the steps read since the last one."""
        if not self.window:
            return
        window_sums = {name: sum(float(metrics[name]) for metrics in self.window) for name in self.metric_names}
        summary = self.train_metrics(window_sums)
        # A metric named as a path (a mixture of experts' moe/layer_3/expert_load_max) goes to the trackers alone: the
        # log line and the progress bar keep to those a reader follows step by step.
        shown = {name: value for name, value in summary.items() if "/" not in name}
        learning_rate, grad_norm = float(self.window[-1]["learning_rate"]), float(self.window[-1]["grad_norm"])
        # Rates over the steps since the last log line (a skipped non-finite step took its time, but added no tokens).
        elapsed = time.perf_counter() - self.window_start
        tokens_per_second = sum(metrics["tokens"] for metrics in self.window) / elapsed
        steps_per_second = (step - self.window_first_step) / elapsed
        self.progress_bar.set_postfix(
            **{name: f"{value:.4f}" for name, value in shown.items()},
            lr=f"{learning_rate:.2e}",
            tokens_per_s=f"{tokens_per_second:.0f}",
        )
        logger.info(
            "step %d: %s, learning rate %.3e, grad norm %.3f, %.0f tokens/s",
            step,
            ", ".join(f"{name} {value:.4f}" for name, value in shown.items()),
            learning_rate,
            grad_norm,
            tokens_per_second,
        )
        logged = {
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": tokens_per_second,
            "steps_per_second": steps_per_second,
        }
        self.trackers.scalars({f"train/{name}": value for name, value in {**summary, **logged}.items()}, step)
        self.window, self.window_start, self.window_first_step = [], time.perf_counter(), step


@dataclass(frozen=True)
class TrackerSettings:
    """Which trackers a run reports to and where: the training flags of the same names (the scripts' training
    arguments give theirs, CommonTrainingArguments.tracker_settings)."""

    output_dir: str
    report_to: tuple[str, ...]
    run_name: str | None
    logging_dir: str | None

    def tensorboard_dir(self) -> str:
        """Where TensorBoard's event files go: --logging_dir, or OUTPUT_DIR/tensorboard."""
        return self.logging_dir or os.path.join(self.output_dir, "tensorboard")


class TensorBoardWriter:
    """The event files of the run in OUTPUT_DIR (`output_dir`), in `directory` (TrackerSettings.tensorboard_dir),
    written with the tensorboard package alone (no TensorFlow). It opens with the arguments, the model config and an
    HParams summary: the hyperparameters, and the scalars (`metric_tags`) whose last values TensorBoard's HParams tab
    compares runs by."""

    def __init__(self, output_dir: str, directory: str, arguments: dict, model_config: dict, metric_tags: list[str]):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2, self._text_pb = event_pb2, summary_pb2, text_pb
        made_logs = not os.path.isdir(directory)
        earlier_logs = set() if made_logs else set(os.listdir(directory))
        self._writer = EventFileWriter(directory)
        # The event file just created (named by the time, host and process) is the run's, and the folder if it made
        # it, where they are inside the output directory (--logging_dir, or a link, may put them elsewhere).
        inside = os.path.relpath(os.path.realpath(directory), os.path.realpath(output_dir))
        if not inside.startswith(os.pardir):
            folder = "" if inside == os.curdir else f"{inside}/"
            written = [folder + name for name in sorted(set(os.listdir(directory)) - earlier_logs)]
            record_run_files(output_dir, written + ([folder] if made_logs and folder else []))
        self.text("arguments", markdown_table(arguments, "argument"))
        config_json = json.dumps(model_config, indent=2, sort_keys=True)
        self.text("model_config", "\n".join("    " + line for line in config_json.split("\n")))
        hparams = hyperparameters(arguments, model_config)

        def data_type(value):
            if isinstance(value, bool):
                return api_pb2.DATA_TYPE_BOOL
            return api_pb2.DATA_TYPE_STRING if isinstance(value, str) else api_pb2.DATA_TYPE_FLOAT64

        # Declared with types but no ranges of values: a range would hide the runs outside it.
        experiment = api_pb2.Experiment(
            hparam_infos=[api_pb2.HParamInfo(name=name, type=data_type(value)) for name, value in hparams.items()],
            metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_tags],
        )
        summary_metadata = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(experiment=experiment))
        declaration = self._summary_pb2.Summary.Value(
            tag=metadata.EXPERIMENT_TAG, metadata=summary_metadata, tensor=metadata.NULL_TENSOR
        )
        self._write(self._summary_pb2.Summary(value=[declaration]), 0)
        # Named after the output directory: runs with the same hyperparameters would otherwise share a row.
        self._write(summary_v2.hparams_pb(hparams, trial_id=os.path.abspath(output_dir)), 0)

    def _write(self, summary, step: int):
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalars(self, values: dict, step: int):
        summary_values = [
            self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()
        ]
        self._write(self._summary_pb2.Summary(value=summary_values), step)

    def text(self, tag: str, markdown: str, step: int = 0):
        self._write(self._text_pb(tag, markdown), step)

    def results(self, results: dict, step: int):
        self.text("results", markdown_table(results, "result"), step)

    def close(self):
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run. W&B's own environment variables choose the project, mode and local directory
    (WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR, ...)."""

    def __init__(self, name: str, run_id: str | None, arguments: dict, model_config: dict):
        import wandb

        self._wandb = wandb
        try:
            self.run = wandb.init(
                name=name,
                id=run_id,
                resume="allow" if run_id else None,
                config={**arguments, "model_config": model_config},
                allow_val_change=True,  # a resumed run may change --max_steps, for one
            )
        except wandb.errors.Error as error:  # not logged in, for one
            raise UsageError(f"--report_to wandb cannot start a run: {error}") from None
        self.run_id = self.run.id
        # Plotted against the training step as a value, not W&B's own step counter: that one must only grow,
        # and a resumed run logs again the steps the interrupted run logged after its last checkpoint.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def scalars(self, values: dict, step: int):
        self.run.log({**values, "train/global_step": step})

    def text(self, tag: str, markdown: str, step: int = 0):
        self.run.log({tag: self._wandb.Html(f"<pre>{html.escape(markdown)}</pre>"), "train/global_step": step})

    def results(self, results: dict, step: int):
        self.run.summary.update(results)

    def close(self):
        self.run.finish()


class MlflowTracker:
    """An MLflow run. MLflow's own environment variables choose where it goes (MLFLOW_TRACKING_URI,
    MLFLOW_EXPERIMENT_NAME, ...)."""

    def __init__(self, name: str, run_id: str | None, arguments: dict, model_config: dict):
        import mlflow

        self._mlflow = mlflow
        try:
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name)
        except mlflow.exceptions.MlflowException as error:
            raise UsageError(f"--report_to mlflow cannot start a run: {error}") from None
        self.run_id = run.info.run_id
        parameters = {**arguments, **{f"model_config/{key}": value for key, value in model_config.items()}}
        # MLflow keeps a parameter's first value: a resumed run adds only the parameters new to it.
        logged = run.data.params
        changed = sorted(name for name, value in parameters.items() if logged.get(name, str(value)) != str(value))
        if changed:
            logger.warning("MLflow keeps the values the run started with for %s", ", ".join(changed))
        mlflow.log_params({name: value for name, value in parameters.items() if name not in logged})

    def scalars(self, values: dict, step: int):
        self._mlflow.log_metrics(values, step=step)

    def text(self, tag: str, markdown: str, step: int = 0):
        self._mlflow.log_text(markdown, f"{tag}/step-{step}.md")

    def results(self, results: dict, step: int):
        numbers = {name: value for name, value in results.items() if type(value) in (int, float)}
        self._mlflow.log_metrics(numbers, step=step)

    def close(self):
        self._mlflow.end_run()


class JsonLinesLog:
    """A tracker that writes each log line's scalars to OUTPUT_DIR/`name`, one JSON object a line with the step, under
    the names of the log without their train/ prefix (run_grpo_flax.py's grpo_log.jsonl: TRL's names). The file is
    the run's (recorded in run_files.json, never written through a link): a run from the start writes it anew, a
    resumed one appends to it."""

    def __init__(self, output_dir: str, name: str, resumed: bool):
        record_run_files(output_dir, [name])
        self.file = open(unlinked(os.path.join(output_dir, name)), "a" if resumed else "w")

    def scalars(self, values: dict, step: int):
        logged = {name.removeprefix("train/"): value for name, value in values.items()}
        self.file.write(json.dumps(logged | {"step": step}) + "\n")
        self.file.flush()

    def text(self, tag: str, markdown: str, step: int = 0):
        pass

    def results(self, results: dict, step: int):
        pass

    def close(self):
        self.file.close()


# The trackers of --report_to, each imported from the package of its name (TensorBoard's is a requirement).
TRACKERS = ["tensorboard", "wandb", "mlflow"]


def trackers_to_report(report_to: str | list[str]) -> list[str]:
    """--report_to as a list of trackers, as the Hugging Face Trainer reads it: names (a comma list or several
    values), `all` for TensorBoard and every tracker installed, or `none`."""
    values = [report_to] if isinstance(report_to, str) else report_to
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in [*TRACKERS, "all", "none"]]
    if unknown:
        raise UsageError(
            f"--report_to {unknown[0]} is not a tracker; choose from {', '.join(TRACKERS)}, all or none "
            "(several as a comma list)"
        )
    if "none" in names:
        return []
    if "all" in names:
        return [name for name in TRACKERS if importlib.util.find_spec(name)]
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--report_to {missing[0]} needs the {missing[0]} package: pip install {missing[0]}")
    return list(dict.fromkeys(names))


class Trackers:
    """The trackers of --report_to, given the same scalars, texts and results."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def scalars(self, values: dict, step: int):
        for tracker in self.trackers:
            tracker.scalars(values, step)

    def text(self, tag: str, markdown: str, step: int = 0):
        for tracker in self.trackers:
            tracker.text(tag, markdown, step)

    def results(self, results: dict, step: int):
        for tracker in self.trackers:
            tracker.results(results, step)

    def close(self):
        for tracker in self.trackers:
            tracker.close()


def open_trackers(settings: TrackerSettings, progress, arguments: dict, config, metric_tags: list) -> Trackers:
    """The trackers of --report_to, on process 0 only, given the run's arguments and model config. W&B and MLflow runs
    are named after the output directory; a run resumed from a checkpoint (`progress` past step 0) reports into the
    runs it started (their ids are in TRACKER_RUNS_FILE)."""
    resumed, model_config = progress.step > 0, config.to_diff_dict()
    if jax.process_index() != 0:
        return Trackers([])
    output_dir = settings.output_dir
    ids_path = os.path.join(output_dir, TRACKER_RUNS_FILE)
    run_ids = {}
    if resumed and os.path.isfile(ids_path):
        with open(ids_path) as file:
            run_ids = json.load(file)
    trackers = []
    for tracker in settings.report_to:
        if tracker == "tensorboard":
            trackers.append(
                TensorBoardWriter(output_dir, settings.tensorboard_dir(), arguments, model_config, metric_tags)
            )
            continue
        tracker_class = {"wandb": WandbTracker, "mlflow": MlflowTracker}[tracker]
        name = settings.run_name or os.path.basename(os.path.abspath(output_dir))
        trackers.append(tracker_class(name, run_ids.get(tracker), arguments, model_config))
        if trackers[-1].run_id != run_ids.get(tracker):
            run_ids[tracker] = trackers[-1].run_id
            write_json(ids_path, run_ids)
    return Trackers(trackers)


# Arguments about where a run reads and writes, how often it reports and saves, and how it runs, rather than what
# it learns: left out of TensorBoard's HParams table, which then shows what differs between experiments.
NOT_HYPERPARAMETERS = set(
    "output_dir overwrite_output_dir do_train do_eval cache_dir overwrite_cache preprocessing_num_workers "
    "preprocessing_piece_mb packed_data_dir packed_tokens_per_shard allow_pickle_weights mesh_shape "
    "per_device_eval_batch_size "
    "logging_steps eval_steps save_steps save_total_limit resume_from_checkpoint report_to sample_prompt "
    "sample_tokens fill_mask_text fill_mask_top_k run_name chat_template_path logging_dir logging_first_step "
    "eval_strategy save_strategy eval_on_start max_shard_size".split()
)


def hyperparameters(arguments: dict, model_config: dict) -> dict:
    """What defines an experiment, for TensorBoard's HParams tab: the arguments that do and the model config,
    those that are bools, numbers or strings."""
    values = {name: value for name, value in arguments.items() if name not in NOT_HYPERPARAMETERS}
    values.update((f"model_config/{name}", value) for name, value in model_config.items())
    return {name: value for name, value in values.items() if type(value) in (bool, int, float, str)}


def markdown_table(values: dict, name_header: str) -> str:
    """A markdown table of name | value, for TensorBoard's text tab."""
    rows = [f"| {name_header} | value |", "| --- | --- |"]
    rows += [f"| {name} | {value} |" for name, value in sorted(values.items())]
    return "\n".join(rows)


def logs_at_step(step: int, is_last: bool, logging_steps: int, logging_first_step: bool) -> bool:
    """Whether the loop logs after `step`: every --logging_steps, at the last step, and at step 1 with
    --logging_first_step."""
    return step % logging_steps == 0 or is_last or (logging_first_step and step == 1)
