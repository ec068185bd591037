"""Trainer's best model: --metric_for_best_model compared at each evaluation of a saved step, the best step's
checkpoint kept whatever --save_total_limit says, and with --load_best_model_at_end its weights exported and evaluated
at the end of training. The best so far is in every checkpoint's progress record, so that it survives a resume."""

import logging
import math
from dataclasses import dataclass

import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BestModelSettings:
    """Which evaluation metric chooses the best model and what is done with it: the training flags
    --metric_for_best_model (Trainer's naming: eval_loss), --greater_is_better and --load_best_model_at_end (the
    scripts' training arguments give theirs, CommonTrainingArguments.best_model_settings)."""

    metric: str
    greater_is_better: bool
    load_at_end: bool


@dataclass
class BestModel:
    """The best value of one evaluation metric (Trainer's naming: eval_loss) so far, and the step it was of."""

    metric: str
    greater_is_better: bool
    step: int | None = None
    value: float | None = None
    evaluated_step: int = 0  # the newest step whose evaluation was compared

    @classmethod
    def for_settings(cls, settings: BestModelSettings | None, record: dict | None = None) -> "BestModel | None":
        """The best model of a run with --metric_for_best_model (`settings`; None without it), from a checkpoint's
        progress `record` where it holds one for the same metric and direction."""
        if settings is None:
            return None
        best = cls(settings.metric, settings.greater_is_better)
        recorded = (record or {}).get("best_model")
        if recorded and (recorded["metric"], recorded["greater_is_better"]) == (best.metric, best.greater_is_better):
            best.step, best.value = recorded["step"], recorded["value"]
            best.evaluated_step = recorded["evaluated_step"]
        elif recorded:
            logger.warning(
                "The checkpoint's best model is by %s (%s is better); this run compares %s (%s is better) from here",
                recorded["metric"],
                "greater" if recorded["greater_is_better"] else "smaller",
                best.metric,
                "greater" if best.greater_is_better else "smaller",
            )
        return best

    def record(self) -> dict:
        return {
            "metric": self.metric,
            "greater_is_better": self.greater_is_better,
            "step": self.step,
            "value": self.value,
            "evaluated_step": self.evaluated_step,
        }

    def consider(self, results: dict, step: int):
        """Compare the evaluation `results` of `step` (the script's names, without eval_) with the best so far."""
        value = results.get(self.metric.removeprefix("eval_"))
        self.evaluated_step = max(self.evaluated_step, step)
        if value is None or not math.isfinite(value):
            logger.warning("step %d: no finite %s to compare for the best model", step, self.metric)
            return
        if self.step is None or (value > self.value if self.greater_is_better else value < self.value):
            self.step, self.value = step, float(value)
            logger.info("step %d: the best model so far (%s %.6g)", step, self.metric, value)

    def results(self, output_dir: str) -> dict:
        """What train_results.json says of it, in the names of Trainer's trainer_state.json."""
        checkpoint = None if self.step is None else f"{output_dir.rstrip('/')}/checkpoints/{self.step}"
        return {"best_model_checkpoint": checkpoint, "best_metric": self.value, "best_global_step": self.step}


class KeepStep(ocp.checkpoint_managers.PreservationPolicy):
    """Orbax keeps the checkpoint of the step `step_to_keep()` names (the best so far), whatever else it deletes."""

    def __init__(self, step_to_keep):
        self.step_to_keep = step_to_keep

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        step = self.step_to_keep()
        return [checkpoint.step == step for checkpoint in checkpoints]
