"""A training run reports to every tracker, and its repeat into the same runs."""

import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from test_clm import tiny_gpt2_dir_of_512_tokens
from test_trackers import hparams_plugin_data, wandb_items, wandb_records

from flax_lm.run.output_dir import HUGGING_FACE_RESULT_NAMES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_gpt2_dir_of_512_tokens(tmp_path_factory.mktemp("tiny-gpt2"))


def test_training_run_reports_to_all_trackers_and_its_repeat_reports_into_the_same_runs(
    model_dir, tmp_path, tracker_env
):
    from mlflow import MlflowClient

    output_dir = tmp_path / "output"
    env = {**os.environ, **tracker_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    arguments = [
        *("--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir),
        *("--train_file", FIXTURES_DIR / "en" / "train.txt", "--max_train_samples", 20),
        *("--validation_file", FIXTURES_DIR / "en" / "validation.txt", "--max_eval_samples", 10),
        *("--block_size", 32, "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 8),
        *("--do_train", "--do_eval", "--max_steps", 2, "--logging_steps", 2, "--sample_tokens", 0),
        *("--report_to", "all", "--resume_from_checkpoint", "--run_name", "tiny-run"),
    ]
    command = [sys.executable, str(REPO_DIR / "run_clm_flax.py"), *map(str, arguments)]
    # The second time, the run is complete: it resumes only to report the results again, into the same runs.
    for _ in range(2):
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "The run is complete" in result.stderr

    train_results = json.loads((output_dir / "train_results.json").read_text())
    eval_results = json.loads((output_dir / "eval_results.json").read_text())
    all_results = json.loads((output_dir / "all_results.json").read_text())
    assert train_results["train_samples"] == 20 and 0 < eval_results["eval_samples"] <= 10
    assert all_results == {
        **{HUGGING_FACE_RESULT_NAMES.get(key, key): value for key, value in train_results.items()},
        **{HUGGING_FACE_RESULT_NAMES.get(key, key): value for key, value in eval_results.items()},
    }
    assert {"train_runtime", "epoch", "perplexity"} <= all_results.keys()
    run_ids = json.loads((output_dir / "tracker_runs.json").read_text())

    # TensorBoard: the HParams summary, whose metrics are the scalars the evaluation wrote.
    events, experiment, session = hparams_plugin_data(output_dir / "tensorboard")
    assert session.group_name == str(output_dir)
    assert session.hparams["learning_rate"].number_value == 5e-5
    assert session.hparams["model_config/n_layer"].number_value == 2
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(all_results["eval_loss"], rel=1e-6)

    # W&B: one run in two offline parts, named by --run_name, with the results in its summary.
    parts = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(parts) == 2 and all(part.endswith(run_ids["wandb"]) for part in parts)
    records = wandb_records(parts[0])
    [run] = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert run.display_name == "tiny-run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["max_steps"] == 2 and config["model_config"]["n_layer"] == 2
    history = [row for row in wandb_items(records, "history") if "train/loss" in row]
    assert [row["train/global_step"] for row in history] == [2]
    for part in parts:
        summary = {
            key: value for update in wandb_items(wandb_records(part), "summary") for key, value in update.items()
        }
        assert summary["eval_loss"] == pytest.approx(all_results["eval_loss"])

    # MLflow: one run, with the scalars and the final results.
    client = MlflowClient(tracking_uri=tracker_env["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_ids["mlflow"])
    assert run.info.run_name == "tiny-run" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "2" and run.data.params["model_config/n_layer"] == "2"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")] == [2]
    assert run.data.metrics["perplexity"] == pytest.approx(all_results["perplexity"])
