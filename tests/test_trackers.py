"""--report_to: TensorBoard's HParams summary, W&B in offline mode and MLflow in a local file store, each read
back from what it wrote; all_results.json; and one tiny training run reporting to all of them, repeated."""

import glob
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, PreTrainedTokenizerFast

from flax_lm.errors import UsageError
from flax_lm.run import tracking
from flax_lm.run.output_dir import HUGGING_FACE_RESULT_NAMES, write_all_results
from flax_lm.run.record import MetricSums, TrainingProgress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import run_clm_flax  # noqa: E402

CORPUS = os.path.join(REPO, "tests", "fixtures", "en")
ARGUMENTS = {"learning_rate": 3e-3, "adafactor": False, "lr_scheduler_type": "cosine", "output_dir": "x", "seed": 7}
MODEL_CONFIG = {"n_layer": 2, "n_embd": 32, "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"]}
METRIC_TAGS = ["eval/loss", "eval/perplexity", "eval/bits_per_byte"]


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    """W&B offline and MLflow in a file store, both under tmp_path."""
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        # MLflow refuses a file store unless told: it would rather have a database or a server.
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


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
    """A byte-level BPE tokenizer of 512 tokens trained on the English fixture corpus, and a tiny GPT-2 config."""
    directory = str(tmp_path_factory.mktemp("tiny-gpt2"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train([os.path.join(CORPUS, "train.txt")], trainer)
    special_tokens = {name: "<|endoftext|>" for name in ("bos_token", "eos_token", "unk_token")}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=64, **special_tokens).save_pretrained(
        directory
    )
    GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2).save_pretrained(directory)
    return directory


def test_an_unknown_tracker_stops_the_script_before_any_work(model_dir, tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    arguments = ["--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir, "--do_train"]
    arguments += ["--train_file", os.path.join(CORPUS, "train.txt"), "--report_to", "tensorboard", "comet"]
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *map(str, arguments)])
    with pytest.raises(UsageError, match="--report_to comet is not a tracker"):
        run_clm_flax.main()
    assert not output_dir.exists()


def test_training_run_reports_to_all_trackers_and_its_repeat_reports_into_the_same_runs(
    model_dir, tmp_path, tracker_env
):
    from mlflow import MlflowClient

    output_dir = tmp_path / "output"
    env = {**os.environ, **tracker_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    arguments = [
        *("--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir),
        *("--train_file", os.path.join(CORPUS, "train.txt"), "--max_train_samples", 20),
        *("--validation_file", os.path.join(CORPUS, "validation.txt"), "--max_eval_samples", 10),
        *("--block_size", 32, "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 8),
        *("--do_train", "--do_eval", "--max_steps", 2, "--logging_steps", 2, "--sample_tokens", 0),
        *("--report_to", "all", "--resume_from_checkpoint", "--run_name", "tiny-run"),
    ]
    command = [sys.executable, os.path.join(REPO, "run_clm_flax.py"), *map(str, arguments)]
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
