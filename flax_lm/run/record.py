"""What a training checkpoint records of the run that wrote it, and what a resumed run must agree with.

Every checkpoint records the run's progress (the step, and the sums of the train step's metrics, each over the steps
it covers) and a description of the run: its arguments, and fingerprints of what the arguments name but do not hold
(the model code, the config, the tokenizer, the training rows). A resume compares the description with its own: a
difference in what changes the training (data, tokenizer, model, loss-relevant flags, optimizer and schedule) is
refused in one line naming each, unless --allow_resume_changes names them; those are then recorded with the step they
start at, in every later checkpoint and in train_results.json. What changes nothing of the training (a longer run,
the logging, evaluation and save intervals, the trackers, the mesh) needs no flag.
"""

import difflib
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from flax_lm.errors import UsageError
from flax_lm.run.best_model import BestModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeSettings:
    """What a resume compares and allows: the training flags --resume_from_checkpoint and --allow_resume_changes (its
    names, as allowed_resume_changes checked them), and what the run does (the scripts' training arguments give
    theirs, CommonTrainingArguments.resume_settings)."""

    resume_from_checkpoint: str | None
    allowed_changes: tuple[str, ...]
    do_train: bool
    overwrite_output_dir: bool

    def allows(self, name: str) -> bool:
        return name in self.allowed_changes or "all" in self.allowed_changes


@dataclass
class MetricSums:
    """The sums of some of the train step's metrics over the finite steps after `from_step`."""

    from_step: int
    sums: dict[str, float]


@dataclass
class TrainingProgress:
    """How far training has come: the step, and the sums of the train step's metrics (the script's
    TRAIN_METRIC_SUMS). The sums come in windows, each counting from the step it started at: a resumed run whose
    script sums a metric its checkpoint does not record counts every sum again from the resume in a window of its
    own, so that a ratio of sums (train_metrics) always covers the steps its parts cover. Every checkpoint records it,
    with the changes a resume allowed."""

    windows: list[MetricSums]
    step: int = 0
    resume_changes: list[dict] = field(default_factory=list)
    # The run's segments, one per process that trained it: {"from_step", "to_step", "runtime_seconds", "tokens"},
    # those of earlier segments as their checkpoints recorded them, the last one this process's, up to its last save.
    segments: list[dict] = field(default_factory=list)
    best_model: BestModel | None = None  # with --metric_for_best_model

    def segment_done(self, from_step: int, to_step: int, runtime_seconds: float, tokens: int):
        """This process's segment so far (from `from_step`, where it started or resumed, to `to_step`)."""
        segment = {"from_step": from_step, "to_step": to_step, "runtime_seconds": runtime_seconds, "tokens": tokens}
        if self.segments and self.segments[-1]["from_step"] == from_step:
            self.segments[-1] = segment
        else:
            self.segments.append(segment)

    @classmethod
    def start(cls, metric_names) -> "TrainingProgress":
        return cls([MetricSums(0, dict.fromkeys(metric_names, 0.0))])

    @property
    def metric_names(self) -> list[str]:
        return list(self.windows[-1].sums)

    def add(self, step_metrics: list[dict]):
        for window in self.windows:
            for metrics in step_metrics:
                for name in window.sums:
                    window.sums[name] += float(metrics[name])

    def summary(self) -> MetricSums:
        """The sums of every metric over the most steps that all of them cover."""
        return next(window for window in self.windows if set(window.sums) == set(self.metric_names))

    def record(self, **details) -> dict:
        windows = [{"from_step": window.from_step, "sums": window.sums} for window in self.windows]
        best_model = {"best_model": self.best_model.record()} if self.best_model else {}
        return {
            "step": self.step,
            "metric_windows": windows,
            "resume_changes": self.resume_changes,
            "segments": self.segments,
            **best_model,
            **details,
        }

    @classmethod
    def from_record(cls, record: dict, metric_names) -> "TrainingProgress":
        """The progress a checkpoint recorded, for a script that sums `metric_names`: sums the script no longer makes
        are left out; if it makes one the record lacks (a metric added to the script since), every sum counts again
        from the checkpoint's step in a window of its own; both with a warning."""
        step = record["step"]
        if "metric_windows" in record:
            windows = [MetricSums(window["from_step"], window["sums"]) for window in record["metric_windows"]]
        else:  # as checkpoints recorded the sums before they had windows: "train_NAME", from the first step
            recorded = {key[len("train_") :]: value for key, value in record.items() if key.startswith("train_")}
            windows = [MetricSums(0, recorded)]
        dropped = sorted({name for window in windows for name in window.sums} - set(metric_names))
        if dropped:
            logger.warning("The checkpoint's training sums of %s are no longer summed; left out", ", ".join(dropped))
        windows = [
            MetricSums(w.from_step, {n: float(v) for n, v in w.sums.items() if n in metric_names}) for w in windows
        ]
        if not any(set(window.sums) == set(metric_names) for window in windows):
            missing = sorted(set(metric_names) - set(windows[-1].sums))
            logger.warning(
                "The checkpoint records no training sum of %s: every training metric counts from step %d on, so "
                "train_results.json's averages cover the steps after this resume (train_metrics_from_step)",
                ", ".join(missing),
                step,
            )
            windows.append(MetricSums(step, dict.fromkeys(metric_names, 0.0)))
        # A segment past the checkpoint's step was recorded by a later checkpoint that this resume does not continue.
        segments = [segment for segment in record.get("segments", []) if segment["to_step"] <= step]
        return cls(windows, step, list(record.get("resume_changes", [])), segments)


# ----------------------------------------------------------------------------------------------------
# The run's description, and the comparison of a resume with it
# ----------------------------------------------------------------------------------------------------

# Arguments that change neither what a run trains on nor how: a resumed run may give them anew. Paths are here where
# what they name is compared by its content instead (the tokenizer, the config, the data) or not at all (where the
# output, the caches and the trackers go); the batch per device and the accumulation where the global batch they make
# is compared instead (the same global batch trains alike on any number of devices); --model_type where the config it
# chooses is compared instead; --skip_nonfinite_steps changes only the steps it skips, each of which is logged;
# --skip_export_check and --merge_adapters only what the exports are; --lora_adapter only the adapters a new run starts
# from.
FREE_ON_RESUME = {
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "allow_resume_changes", "do_train", "do_eval",
    "max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps", "save_total_limit", "report_to",
    "per_device_eval_batch_size", "validation_file", "max_eval_samples", "sample_prompt", "sample_tokens",
    "eval_tasks", "eval_tasks_path", "eval_tasks_limit", "fill_mask_text", "fill_mask_top_k", "cache_dir",
    "compilation_cache_dir", "overwrite_cache", "preprocessing_num_workers", "packed_data_dir",
    "packed_tokens_per_shard", "steps_per_call", "mesh_shape", "gradient_checkpointing", "ignore_data_skip",
    "model_name_or_path", "model_type", "config_name", "tokenizer_name", "model_file", "train_file", "dataset_name",
    "dataset_config_name", "data_mixture", "allow_pickle_weights", "coordinator_address", "num_processes",
    "process_id", "local_device_ids", "per_device_train_batch_size", "gradient_accumulation_steps",
    "skip_nonfinite_steps", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "skip_export_check", "preprocessing_piece_mb", "merge_adapters", "lora_adapter",
}  # fmt: skip

# Arguments that change the training, added to the scripts since checkpoints were first written, with the value a
# checkpoint that does not record them trained with: they are compared as that value.
VALUES_BEFORE_RECORDED = {"fp8": False, "lora_rank": None}

# The fingerprints a run's description holds beside its arguments, with what they are of, for the messages.
FINGERPRINTS = {
    "model_code": "the model code (--model_file)",
    "config": "the model config (--config_name)",
    "tokenizer": "the tokenizer (--tokenizer_name)",
    "training_data": "the training data (--train_file, --dataset_name, --data_mixture; or the rows held out of it, "
    "which --do_eval and --validation_split_percentage choose)",
}
# What else a description holds and a resume compares, with what it is of.
SETTINGS = {"global_batch_size": "the global batch", "mixture_weights": "the mixture's weights"}


def allowed_resume_changes(values: list[str] | None, resumes: bool, argument_names: set[str]) -> list[str]:
    """The names --allow_resume_changes gives (its `values`: comma separated, in one value or several), each checked
    against what a resume (`resumes`: --resume_from_checkpoint) of the script of `argument_names` compares: all, the
    fingerprints and settings, and the arguments that change the training (those outside FREE_ON_RESUME). A name that
    is none of them (a misspelt flag) would let nothing through: refused in one line listing those it may be."""
    names = [name.strip() for value in values or [] for name in value.split(",")]
    names = [name for name in names if name]
    if names and not resumes:
        raise UsageError("--allow_resume_changes names what a resume may change; add --resume_from_checkpoint")
    valid = ["all", *FINGERPRINTS, *SETTINGS, *sorted(argument_names - FREE_ON_RESUME - {"token"})]
    if unknown := [name for name in names if name not in valid]:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(
            f"--allow_resume_changes {unknown[0]} is nothing a resume compares{hint}; name some of {', '.join(valid)}"
        )
    return names


def json_fingerprint(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_fingerprint(config) -> str:
    """Of what the config says of the model: its values but for the file's bookkeeping and the architecture named."""
    values = config.to_dict()
    for bookkeeping in ("transformers_version", "_name_or_path", "architectures", "flax_lm_model_file"):
        values.pop(bookkeeping, None)
    return json_fingerprint(values)


def rows_fingerprint(rows) -> str | None:
    """Of the training rows: a packed corpus's split by its index entry (its shards' checksums) and the rows taken
    of it; a mixture by its sources' names, weights and rows; rows in memory by their bytes; None for a stream, whose
    arguments stand for it."""
    if rows is None:
        return None
    if hasattr(rows, "sources"):  # a Mixture
        return json_fingerprint(
            [
                [name, float(weight), rows_fingerprint(source)]
                for name, weight, source in zip(rows.names, rows.weights, rows.sources)
            ]
        )
    if hasattr(rows, "split_entry"):  # PackedBlocks
        return json_fingerprint([rows.split_entry, list(rows.row_shape), rows.start, rows.stop])
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()[:16]


def describe_run(
    arguments: dict, config, tokenizer_fingerprint: str, model_code, train_rows, global_batch_size
) -> dict:
    """What each checkpoint records of the run, and a resume compares with its own."""
    return {
        "arguments": arguments,
        "model_code": {"file": model_code.description, "fingerprint": model_code.fingerprint},
        "config": config_fingerprint(config),
        "tokenizer": tokenizer_fingerprint,
        "training_data": rows_fingerprint(train_rows),
        "global_batch_size": global_batch_size,
        "mixture_weights": dict(zip(train_rows.names, map(float, train_rows.weights)))
        if hasattr(train_rows, "names")
        else None,
    }


def check_model_code(model_code, progress_record: dict):
    """Refuse to resume a checkpoint that other model code trained (the fingerprint its record holds; checkpoints
    written before it was recorded hold none): its weights would be computed by code they were not trained with. Asked
    before the checkpoint's arrays are compared with the model's, whose shapes other code may change."""
    recorded = progress_record.get("run", progress_record).get("model_code")
    if recorded is not None and (ignored := model_code.fields_ignored_by(recorded["fingerprint"])):
        raise UsageError(
            f"the checkpoint was trained with earlier model code ({recorded['file']}, fingerprint "
            f"{recorded['fingerprint']}) that read nothing of {', '.join(ignored)}, which the config sets: its "
            "weights were trained without them; resume with a config that leaves them out, or start a new run"
        )
    if recorded is not None and not model_code.computes_as(recorded["fingerprint"]):
        raise UsageError(
            f"the checkpoint was trained with other model code ({recorded['file']}, fingerprint "
            f"{recorded['fingerprint']}) than this run's ({model_code.description}, fingerprint "
            f"{model_code.fingerprint}); resume with the code it was trained with (a model file of your own: "
            "--model_file)"
        )


# Arguments that choose the optimizer state's structure: a checkpoint of another value cannot be restored at all.
OPTIMIZER_STATE_ARGUMENTS = ("optim",)


def check_recorded_optimizer(run: dict, progress_record: dict):
    """Refuse, naming the argument, a checkpoint whose optimizer state another optimizer made (`run`: this run's
    description): asked before the checkpoint's arrays are compared with this run's, whose shapes it explains."""
    recorded = progress_record.get("run", progress_record).get("arguments", {})
    for name in OPTIMIZER_STATE_ARGUMENTS:
        current = run["arguments"].get(name)
        if name in recorded and recorded[name] != current:
            difference = describe_difference(name, (recorded[name], current))
            raise UsageError(
                f"the checkpoint holds the state of another optimizer ({difference}), which --allow_resume_changes "
                f"cannot carry over; resume with --{name} {recorded[name]}, or start a new run from the exported "
                "weights (--model_name_or_path)"
            )


def run_differences(recorded: dict, current: dict) -> dict[str, tuple]:
    """{name: (recorded, current)} of what differs between two run descriptions and changes the training: arguments
    outside FREE_ON_RESUME, and the fingerprints. What the record does not hold (an argument added to the script
    since, a fingerprint older checkpoints lack) is not compared, but for VALUES_BEFORE_RECORDED."""
    differences = {}
    recorded_arguments = {**VALUES_BEFORE_RECORDED, **recorded.get("arguments", {})}
    for name, value in current["arguments"].items():
        if name in FREE_ON_RESUME or name not in recorded_arguments:
            continue
        if json.dumps(recorded_arguments[name], default=str) != json.dumps(value, default=str):
            differences[name] = (recorded_arguments[name], value)
    for name in (*FINGERPRINTS, *SETTINGS):
        before, now = recorded.get(name), current.get(name)
        if name == "model_code":
            before, now = before and before["fingerprint"], now["fingerprint"]
        if before is not None and now is not None and before != now:
            differences[name] = (before, now)
    return differences


def describe_difference(name: str, values: tuple) -> str:
    recorded, current = values
    if name in FINGERPRINTS:
        return f"{FINGERPRINTS[name]}: fingerprint {recorded} there, {current} here"
    if name in SETTINGS:
        return f"{SETTINGS[name]}: {recorded} there, {current} here"
    return f"--{name} {recorded} there, {current} here"


def resume_differences(record: dict, run: dict, model_code) -> tuple[dict[str, tuple], str | None]:
    """What differs between the run a checkpoint recorded and this one (`run`: describe_run's), as run_differences
    gives it, and the checkpoint's model code fingerprint where it is an earlier verified version of this run's (then
    no difference)."""
    # Checkpoints written before the run was described record its arguments and global batch beside the progress.
    recorded = record.get("run") or {
        "arguments": record.get("arguments", {}),
        "global_batch_size": record.get("global_batch_size"),
    }
    differences = run_differences(recorded, run)
    if "model_code" in differences and model_code.computes_as(differences["model_code"][0]):
        return differences, differences.pop("model_code")[0]
    return differences, None


def refuse_differences(differences: dict[str, tuple], step: int, setup, resume: ResumeSettings):
    """Refuse, in one line naming each, the differences --allow_resume_changes does not name; none where the
    checkpoint ends the run (what differs changes no step)."""
    if step == setup.total_steps and resume.do_train:
        return
    refused = {name: values for name, values in differences.items() if not resume.allows(name)}
    if refused:
        names = ",".join(refused)
        raise UsageError(
            f"the resumed run differs from the checkpoint's in what it trains: "
            f"{'; '.join(describe_difference(name, values) for name, values in refused.items())}; resume with what it "
            f"was trained with, or pass --allow_resume_changes {names} to train on with the change (recorded with "
            f"step {step})"
        )


def check_recorded_run(run: dict, setup, resume: ResumeSettings, record: dict):
    """What a resume asks of a checkpoint's record before its arrays are compared with this run's: the model code
    that trained it (check_model_code), and no difference in what trains that --allow_resume_changes does not name.
    Another optimizer changes the arrays of the optimizer state, so the refusal names --optim (or the flag that
    differs), never an array's shape."""
    check_model_code(setup.model_code, record)
    differences, _ = resume_differences(record, run, setup.model_code)
    refuse_differences(differences, record["step"], setup, resume)


def check_resumed_run(record: dict, run: dict, progress: TrainingProgress, setup, resume: ResumeSettings):
    """Compare the run a checkpoint recorded with this one (`run`: describe_run's). A difference that changes the
    training is refused in one line naming each, unless --allow_resume_changes names it (or all);
    an allowed one is logged and added to `progress.resume_changes` with the step it starts at. Refuses a checkpoint
    beyond this run's last step."""
    if resume.overwrite_output_dir:
        logger.warning("--overwrite_output_dir is ignored: --resume_from_checkpoint continues the run in it")
    differences, earlier_verified = resume_differences(record, run, setup.model_code)
    if earlier_verified:
        logger.info(
            "The checkpoint's model code (fingerprint %s) is an earlier verified version of %s (fingerprint %s)",
            earlier_verified,
            setup.model_code.description,
            setup.model_code.fingerprint,
        )
    if record["step"] == setup.total_steps and resume.do_train:
        logger.info("The run is complete (step %d of %d): nothing left to train", record["step"], setup.total_steps)
        return  # what differs changes no step
    refuse_differences(differences, record["step"], setup, resume)
    for name, values in differences.items():
        logger.warning(
            "Resumed with a change allowed from step %d: %s", record["step"], describe_difference(name, values)
        )
        progress.resume_changes.append({"step": record["step"], "name": name, "from": values[0], "to": values[1]})
    if not resume.do_train:
        return
    if record["step"] > setup.total_steps:
        raise UsageError(
            f"the checkpoint is at step {record['step']}, after this run's last step {setup.total_steps}; "
            "raise --max_steps or --num_train_epochs to train further"
        )
    # A checkpoint of warmup_stable_decay's stable phase resumed with another --max_steps trains on at the peak, its
    # decay at the end of the new run. Elsewhere another --max_steps, or an allowed change of the schedule, changes the
    # rate of the step resumed. A checkpoint that records no rate is not compared.
    resumed_rate, scheduled_rate = record.get("learning_rate"), float(setup.learning_rate_schedule(record["step"] - 1))
    if resumed_rate is not None and not math.isclose(resumed_rate, scheduled_rate, rel_tol=1e-5):
        logger.warning(
            "The checkpoint's step %d trained at learning rate %.6g, this run's schedule has %.6g there: the learning "
            "rate jumps at the resume (another --max_steps outside the stable phase of warmup_stable_decay, or an "
            "allowed change of the schedule)",
            record["step"],
            resumed_rate,
            scheduled_rate,
        )
