"""Trainer's flags for when a run evaluates, saves and logs, in a training run: evaluation and saving at the end of
each epoch, an evaluation before the first step, the first step logged, TensorBoard's events in --logging_dir; the
best checkpoint by an evaluation metric exported at the end."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from safetensors.numpy import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_clm import CORPUS, abstract_params, model_dir_with_config, run_script, training_arguments
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

from flax_lm.models.gpt2 import model as gpt2


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


def test_load_best_model_at_end_exports_the_best_checkpoint_and_keeps_it_through_a_resume(
    gpt2_tokenizer_dir, tmp_path
):
    """With the greater eval_loss better, the first evaluated save (the least trained) is the best: it survives a
    resume and --save_total_limit 1, and its weights are the export that transformers scores as the log did."""
    model_dir = model_dir_with_config(gpt2_tokenizer_dir, tmp_path / "model")
    output_dir = tmp_path / "run"
    common = [
        "--do_train", "--do_eval", "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant", "--logging_steps", "2", "--eval_steps", "2", "--save_steps", "2",
        "--save_total_limit", "1", "--load_best_model_at_end", "--metric_for_best_model", "eval_loss",
        "--greater_is_better", "--sample_tokens", "0", "--report_to", "tensorboard",
    ]  # fmt: skip
    run_script(training_arguments(model_dir, output_dir, *common, "--max_steps", "4"))
    result = run_script(
        training_arguments(model_dir, output_dir, *common, "--max_steps", "6", "--resume_from_checkpoint")
    )
    assert "Exported the best model, of step 2" in result.stderr

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    eval_losses = {}
    for event in events.Scalars("eval/loss"):  # the resume evaluates its checkpoint, step 4, again
        eval_losses.setdefault(event.step, event.value)
    assert sorted(eval_losses) == [2, 4, 6] and max(eval_losses, key=eval_losses.get) == 2
    train_results = json.loads((output_dir / "train_results.json").read_text())
    assert train_results["best_global_step"] == 2 and train_results["exported_step"] == 2
    assert train_results["best_model_checkpoint"] == f"{output_dir}/checkpoints/2"
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    assert eval_results["step"] == 2
    assert eval_results["eval_loss"] == pytest.approx(train_results["best_metric"], rel=1e-6)
    assert eval_results["eval_loss"] == pytest.approx(eval_losses[2], rel=1e-5)
    all_results = json.loads((output_dir / "all_results.json").read_text())
    assert all_results["eval_loss"] == eval_results["eval_loss"]
    # --save_total_limit 1 keeps the newest and, beside it, the best.
    assert sorted(int(name) for name in os.listdir(output_dir / "checkpoints")) == [2, 6]

    config = GPT2Config.from_pretrained(str(output_dir))
    exported = gpt2.from_hf_state_dict(load_file(str(output_dir / "model.safetensors")), abstract_params(config))
    for step, equal in ((2, True), (6, False)):
        saved = ocp.StandardCheckpointer().restore(output_dir / "checkpoints" / str(step) / "state")["params"]
        same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), exported, saved)
        assert all(jax.tree_util.tree_leaves(same)) == equal

    tokenizer = AutoTokenizer.from_pretrained(str(output_dir))
    text = (Path(CORPUS) / "validation.txt").read_text()
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]  # one document, ended as training ends it
    blocks = torch.tensor(ids[: len(ids) // 32 * 32]).reshape(-1, 32)
    torch_model = AutoModelForCausalLM.from_pretrained(str(output_dir)).eval()
    with torch.no_grad():
        loss = torch_model(blocks, labels=blocks).loss.item()
    assert loss == pytest.approx(eval_results["eval_loss"], rel=1e-4)
