"""The settings each part of flax_lm receives, filled from the flags here and nowhere else: a part takes the values
it uses (a frozen dataclass beside the code that uses it: OptimizerSettings in flax_lm/training/optimizers.py,
OutputDirSettings in flax_lm/run/output_dir.py ...), never a whole argument object. The argument dataclasses of
arguments.py inherit these methods: `training_args.optimizer_settings()`."""

import logging
from collections.abc import Callable
from dataclasses import fields

from flax_lm.command_line.model_loading import model_loading
from flax_lm.devices.processes import ProcessGroup
from flax_lm.evaluation.validation import EvaluationSchedule
from flax_lm.models.huggingface import read_exported_params
from flax_lm.run.best_model import BestModelSettings
from flax_lm.run.output_dir import OutputDirSettings
from flax_lm.run.record import ResumeSettings
from flax_lm.run.tracking import TrackerSettings
from flax_lm.training.lifecycle import RunSettings, TrainingSettings
from flax_lm.training.optimizers import OptimizerSettings

logger = logging.getLogger(__name__)


def from_flags(settings_class, arguments, **values):
    """A `settings_class`: the fields `values` gives, and each other field the flag of its name in `arguments`."""
    flags = {item.name: getattr(arguments, item.name) for item in fields(settings_class) if item.name not in values}
    return settings_class(**flags, **values)


class ModelSettingsFromFlags:
    """What the model arguments (ModelArguments) give the package."""

    def pretrained_weights(self) -> Callable | None:
        """What reads the weights of --model_name_or_path in a model's layout, from (model_code, abstract_params)
        (flax_lm.training.lifecycle.initial_state); None without one."""
        source = self.model_name_or_path
        if not source:
            return None

        def read(model_code, abstract_params):
            params = read_exported_params(source, model_loading(self), model_code, abstract_params)
            logger.info("Loaded weights from %s", source)
            return params

        return read


class TrainingSettingsFromFlags:
    """What the training arguments (CommonTrainingArguments) give the package, once checked
    (check_common_arguments) and, for the evaluation and save intervals, once the run's steps are counted
    (apply_strategies)."""

    def optimizer_settings(self) -> OptimizerSettings:
        return from_flags(OptimizerSettings, self, trains=self.do_train)

    def training_settings(self) -> TrainingSettings:
        return from_flags(TrainingSettings, self, optimizer=self.optimizer_settings())

    def output_dir_settings(self) -> OutputDirSettings:
        return from_flags(OutputDirSettings, self)

    def resume_settings(self) -> ResumeSettings:
        return from_flags(ResumeSettings, self, allowed_changes=tuple(self.allow_resume_changes or ()))

    def best_model_settings(self) -> BestModelSettings | None:
        if not self.metric_for_best_model:
            return None
        return BestModelSettings(self.metric_for_best_model, self.greater_is_better, self.load_best_model_at_end)

    def tracker_settings(self) -> TrackerSettings:
        return from_flags(TrackerSettings, self, report_to=tuple(self.report_to))

    def evaluation_schedule(self) -> EvaluationSchedule:
        return EvaluationSchedule(self.do_eval, self.eval_on_start, self.eval_steps or self.logging_steps)

    def run_settings(self) -> RunSettings:
        trackers = self.tracker_settings()
        return RunSettings(
            output=self.output_dir_settings(),
            do_eval=self.do_eval,
            resume=self.resume_settings(),
            best_model=self.best_model_settings(),
            tensorboard_dir=trackers.tensorboard_dir() if "tensorboard" in trackers.report_to else None,
        )


class ProcessGroupFromFlags:
    """What the distributed arguments (DistributedArguments) give the package."""

    def process_group(self) -> ProcessGroup:
        return from_flags(ProcessGroup, self)
