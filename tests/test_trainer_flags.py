"""Trainer's flags for when a run evaluates, saves and logs, in a training run: evaluation and saving at the end of
each epoch, an evaluation before the first step, the first step logged, TensorBoard's events in --logging_dir."""

import json
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_clm import model_dir_with_config, run_script, training_arguments


def test_epoch_strategies_eval_on_start_logging_first_step_and_logging_dir(gpt2_tokenizer_dir, tmp_path):
    model_dir = model_dir_with_config(gpt2_tokenizer_dir, tmp_path / "model")
    output_dir, logging_dir = tmp_path / "run", tmp_path / "events"
    run_script(
        training_arguments(
            model_dir,
            output_dir,
            "--do_train",
            "--do_eval",
            "--num_train_epochs",
            "2",
            "--per_device_train_batch_size",
            "64",
            "--per_device_eval_batch_size",
            "64",
            "--eval_strategy",
            "epoch",
            "--save_strategy",
            "epoch",
            "--eval_on_start",
            "--logging_first_step",
            "--logging_steps",
            "1000",
            "--logging_dir",
            logging_dir,
            "--report_to",
            "tensorboard",
        )  # fmt: skip
    )
    train_results = json.loads((output_dir / "train_results.json").read_text())
    steps_per_epoch = train_results["train_steps"] // 2
    assert steps_per_epoch >= 3 and train_results["train_steps"] == 2 * steps_per_epoch
    events = EventAccumulator(str(logging_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("eval/loss")] == [0, steps_per_epoch, 2 * steps_per_epoch]
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2 * steps_per_epoch]
    assert sorted(int(name) for name in os.listdir(output_dir / "checkpoints")) == [
        steps_per_epoch,
        2 * steps_per_epoch,
    ]
    assert not (output_dir / "tensorboard").exists()
