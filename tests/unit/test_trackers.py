"""--report_to: TensorBoard's HParams summary, W&B in offline mode and MLflow in a local file store, each read
back from what it wrote; all_results.json; and one tiny training run reporting to all of them, repeated."""

import glob
import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO_DIR
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from test_clm import tiny_gpt2_dir_of_512_tokens

from flax_lm.errors import UsageError
from flax_lm.run import tracking
from flax_lm.run.output_dir import write_all_results
from flax_lm.run.record import MetricSums, TrainingProgress

REPO = str(REPO_DIR)
sys.path.insert(0, REPO)
import run_clm_flax  # noqa: E402

CORPUS = os.path.join(REPO, "tests", "fixtures", "en")
ARGUMENTS = {"learning_rate": 3e-3, "adafactor": False, "lr_scheduler_type": "cosine", "output_dir": "x", "seed": 7}
MODEL_CONFIG = {"n_layer": 2, "n_embd": 32, "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"]}
METRIC_TAGS = ["eval/loss", "eval/perplexity", "eval/bits_per_byte"]


def open_trackers(report_to, output_dir, resumed=False, arguments=ARGUMENTS):
    training_args = run_clm_flax.TrainingArguments(output_dir=str(output_dir), report_to=report_to)
    progress = TrainingProgress([MetricSums(0, {"loss_sum": 0.0})], step=5 if resumed else 0)
    config = SimpleNamespace(to_diff_dict=lambda: MODEL_CONFIG)  # what the trackers read of a transformers config
    return tracking.open_trackers(training_args.tracker_settings(), progress, arguments, config, METRIC_TAGS)


def wandb_records(run_dir: str) -> list:
    """The records of an offline W&B run: a LevelDB-style log of protobuf records after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as file:
        data = file.read()
    assert data[:4] == b":W&B"
    records, position, pending, block = [], 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # too short for a header: padding to the next block
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_items(records, kind: str) -> list[dict]:
    """The key/value items of each history, summary or config record, values decoded from JSON."""
    field = {"history": "item", "summary": "update", "config": "update"}[kind]
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in getattr(getattr(record, kind), field)
        }
        for record in records
        if record.WhichOneof("record_type") == kind
    ]


def hparams_plugin_data(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    experiment = hparams_metadata.parse_experiment_plugin_data(content[hparams_metadata.EXPERIMENT_TAG])
    session = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
    return events, experiment, session


def test_report_to_takes_the_trainers_values():
    assert tracking.trackers_to_report(["tensorboard"]) == ["tensorboard"]
    assert tracking.trackers_to_report(["wandb,mlflow"]) == ["wandb", "mlflow"]
    assert tracking.trackers_to_report(["wandb", "tensorboard,wandb"]) == ["wandb", "tensorboard"]
    assert tracking.trackers_to_report("mlflow") == ["mlflow"]  # as a JSON file of arguments gives it
    assert tracking.trackers_to_report(["none"]) == []
    assert tracking.trackers_to_report(["all"]) == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(UsageError, match="--report_to comet is not a tracker; choose from tensorboard"):
        tracking.trackers_to_report(["tensorboard,comet"])


def test_a_tracker_not_installed_is_one_clear_line_and_left_out_of_all(monkeypatch):
    find_spec = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name)
    )
    with pytest.raises(UsageError, match="^--report_to wandb needs the wandb package: pip install wandb$"):
        tracking.trackers_to_report(["tensorboard,wandb"])
    assert tracking.trackers_to_report(["all"]) == ["tensorboard", "mlflow"]


def test_tensorboard_gets_an_hparams_summary_and_the_model_config(tmp_path):
    trackers = open_trackers(["tensorboard"], tmp_path)
    trackers.scalars({"eval/loss": 2.5, "eval/perplexity": 12.2}, 10)
    trackers.results({"eval_loss": 2.5, "step": 10}, 10)
    trackers.close()

    events, experiment, session = hparams_plugin_data(tmp_path / "tensorboard")
    assert [metric.name.tag for metric in experiment.metric_infos] == METRIC_TAGS
    hparams = {name: value.WhichOneof("kind") for name, value in session.hparams.items()}
    # The arguments that define the experiment and the model config, typed; not where the run writes.
    assert hparams == {
        "learning_rate": "number_value",
        "adafactor": "bool_value",
        "lr_scheduler_type": "string_value",
        "seed": "number_value",
        "model_config/n_layer": "number_value",
        "model_config/n_embd": "number_value",
        "model_config/activation_function": "string_value",
    }
    assert session.hparams["learning_rate"].number_value == 3e-3
    assert session.group_name == str(tmp_path)  # a row of its own in the HParams table
    assert {info.name: info.type for info in experiment.hparam_infos}["adafactor"] == 2  # DATA_TYPE_BOOL
    assert events.Scalars("eval/loss")[-1].value == 2.5  # the HParams tab's metric value

    texts = {
        tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.PluginTagToContent("text")
    }
    assert "| learning_rate | 0.003 |" in texts["arguments"]
    assert json.loads(texts["model_config"]) == MODEL_CONFIG  # indented as a code block
    assert "| eval_loss | 2.5 |" in texts["results"]


def test_wandb_offline_run_holds_what_was_reported_and_resumes_into_the_same_run(tracker_env, tmp_path):
    import wandb

    output_dir = tmp_path / "gpt2-small-run"
    output_dir.mkdir()
    trackers = open_trackers(["wandb"], output_dir)
    trackers.scalars({"train/loss": 4.0, "train/learning_rate": 1e-3}, 5)
    trackers.text("samples", "    Once upon a <time>", 5)
    trackers.results({"train_loss": 4.25, "epoch": None}, 5)
    trackers.close()
    run_id = json.loads((output_dir / "tracker_runs.json").read_text())["wandb"]

    # Resumed: the same run, whose config may change (W&B keeps the newest values).
    trackers = open_trackers(["wandb"], output_dir, resumed=True, arguments={**ARGUMENTS, "learning_rate": 1e-3})
    trackers.scalars({"train/loss": 3.0}, 10)
    trackers.close()
    assert json.loads((output_dir / "tracker_runs.json").read_text()) == {"wandb": run_id}
    wandb.teardown()  # the W&B service writes the offline files on its own time: wait for it to end

    first, resumed = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    # offline-run-DATE_TIME-ID, with -1 added by W&B when both runs started in the same second
    for run_dir in (first, resumed):
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", os.path.basename(run_dir)), run_dir
    records = wandb_records(first)
    [run] = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert run.display_name == "gpt2-small-run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["learning_rate"] == 3e-3 and config["model_config"] == MODEL_CONFIG
    history = wandb_items(records, "history")
    assert [(row["train/global_step"], row["train/loss"]) for row in history if "train/loss" in row] == [(5, 4.0)]
    [sample] = [row for row in history if "samples/path" in row]
    assert sample["train/global_step"] == 5 and sample["samples/_type"] == "html-file"
    with open(os.path.join(first, "files", sample["samples/path"])) as file:
        assert "<pre>    Once upon a &lt;time&gt;</pre>" in file.read()
    summary = {key: value for update in wandb_items(records, "summary") for key, value in update.items()}
    assert summary["train_loss"] == 4.25 and summary["epoch"] is None
    history = wandb_items(wandb_records(resumed), "history")
    assert [(row["train/global_step"], row["train/loss"]) for row in history] == [(10, 3.0)]


def test_mlflow_file_store_run_holds_what_was_reported_and_resumes_into_the_same_run(tracker_env, tmp_path, caplog):
    import mlflow
    from mlflow import MlflowClient

    output_dir = tmp_path / "gpt2-small-run"
    output_dir.mkdir()
    trackers = open_trackers(["mlflow"], output_dir)
    trackers.scalars({"train/loss": 4.0}, 5)
    trackers.text("samples", "    Once upon a time", 5)
    trackers.results({"train_loss": 4.25, "epoch": None, "step": 5}, 5)
    trackers.close()
    run_id = json.loads((output_dir / "tracker_runs.json").read_text())["mlflow"]

    trackers = open_trackers(["mlflow"], output_dir, resumed=True, arguments={**ARGUMENTS, "learning_rate": 1e-3})
    trackers.scalars({"train/loss": 3.0}, 10)
    trackers.close()
    assert "MLflow keeps the values the run started with for learning_rate" in caplog.text

    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "gpt2-small-run" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.003" and run.data.params["model_config/n_layer"] == "2"
    history = client.get_metric_history(run_id, "train/loss")
    assert [(metric.step, metric.value) for metric in history] == [(5, 4.0), (10, 3.0)]
    assert run.data.metrics["train_loss"] == 4.25 and "epoch" not in run.data.metrics
    assert mlflow.artifacts.load_text(f"{run.info.artifact_uri}/samples/step-5.md") == "    Once upon a time"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_tracker_that_cannot_start_a_run_is_one_clear_line(tmp_path, monkeypatch):
    import wandb

    def not_logged_in(**settings):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", not_logged_in)
    with pytest.raises(UsageError, match="^--report_to wandb cannot start a run: No API key configured"):
        open_trackers(["wandb"], tmp_path)
    # MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(UsageError, match="^--report_to mlflow cannot start a run: .*MLFLOW_ALLOW_FILE_STORE"):
        open_trackers(["mlflow"], tmp_path)
    assert not (tmp_path / "tracker_runs.json").exists()


def test_all_results_merges_train_and_eval_results_with_the_hugging_face_names(tmp_path):
    train = {"train_loss": 3.5, "train_samples": 100, "epochs": 2.0, "train_runtime_seconds": 9.0, "train_steps": 20}
    evaluation = {"eval_loss": 3.25, "eval_perplexity": 25.8, "eval_samples": 10, "eval_tokens": 320, "step": 20}
    (tmp_path / "train_results.json").write_text(json.dumps(train))
    (tmp_path / "eval_results.json").write_text(json.dumps(evaluation))
    expected = {
        **{"train_loss": 3.5, "train_samples": 100, "epoch": 2.0, "train_runtime": 9.0, "train_steps": 20},
        **{"eval_loss": 3.25, "perplexity": 25.8, "eval_samples": 10, "eval_tokens": 320, "step": 20},
    }
    assert write_all_results(str(tmp_path)) == expected
    assert json.loads((tmp_path / "all_results.json").read_text()) == expected


def test_all_results_leaves_out_an_evaluation_of_another_step_than_the_training(tmp_path, caplog):
    train = {"train_loss": 3.5, "train_samples": 100, "train_steps": 30}
    evaluation = {"eval_loss": 3.25, "eval_perplexity": 25.8, "eval_samples": 10, "step": 20}
    (tmp_path / "train_results.json").write_text(json.dumps(train))
    (tmp_path / "eval_results.json").write_text(json.dumps(evaluation))
    assert write_all_results(str(tmp_path)) == train
    assert json.loads((tmp_path / "all_results.json").read_text()) == train
    assert json.loads((tmp_path / "eval_results.json").read_text()) == evaluation
    assert caplog.messages == [
        "eval_results.json holds the evaluation of step 20, not of the trained model's step 30, so all_results.json "
        "leaves it out; resume with --do_eval to evaluate the trained model"
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_gpt2_dir_of_512_tokens(tmp_path_factory.mktemp("tiny-gpt2"))


def test_an_unknown_tracker_stops_the_script_before_any_work(model_dir, tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    arguments = ["--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir, "--do_train"]
    arguments += ["--train_file", os.path.join(CORPUS, "train.txt"), "--report_to", "tensorboard", "comet"]
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *map(str, arguments)])
    with pytest.raises(UsageError, match="--report_to comet is not a tracker"):
        run_clm_flax.main()
    assert not output_dir.exists()
