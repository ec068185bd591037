"""benchmarks/gpu_suite.py, the project's train steps beside their PyTorch peers on a GPU: a side that fails or hangs
is reported, not waited for; the fine-tuning rows pack whole examples with the loss on their completions; the T5
row's two sides train on the same span-corrupted batch. (Its CPU
smoke, which measures each model on both sides: tests/end_to_end/test_gpu_suite_runs.py.)"""

import importlib.util
import json
import sys

import numpy as np
import pytest
from conftest import REPO_DIR
from transformers import T5Config


def load_benchmark(name: str):
    sys.path.insert(0, str(REPO_DIR / "benchmarks"))
    specification = importlib.util.spec_from_file_location(name, REPO_DIR / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


@pytest.fixture
def suite():
    return load_benchmark("gpu_suite")


def test_a_side_that_fails_is_reported_with_its_last_error_line(suite, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text("print('setting up')\nraise ValueError('Bias must have same seq length as QKV')\n")
    result = suite.run_side(suite.Side("failing", [str(script)]), 60, str(tmp_path), "failing", smoke=True)
    assert result["error"] == "ValueError: Bias must have same seq length as QKV"


def test_a_side_that_outruns_its_time_is_stopped_and_reported(suite, tmp_path):
    script = tmp_path / "hanging.py"
    script.write_text("import time\nprint('compiling', flush=True)\ntime.sleep(60)\n")
    result = suite.run_side(suite.Side("hanging", [str(script)]), 2, str(tmp_path), "hanging", smoke=True)
    assert result["error"] == "stopped after 2 s; last line: compiling" and result["seconds"] < 30


def test_a_failed_side_is_a_row_of_the_table_and_the_others_keep_their_ratio(suite, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "--smoke"])
    arguments = suite.parse_arguments()
    measured = dict(
        train_tokens_per_second=1000.0, peak_memory_bytes=1e9, seconds_to_first_step=5.0, flops_per_token=1e6
    )
    measurements = [
        {"row": "llama", "model": "Llama", "side": "flax_lm", **measured},
        {"row": "llama", "model": "Llama", "side": "peer", **measured, "train_tokens_per_second": 500.0},
        {
            "row": "llama",
            "model": "Llama",
            "side": "fp8",
            **measured,
            "train_tokens_per_second": 1500.0,
            "variant": True,
        },
        {"row": "roberta", "model": "RoBERTa", "side": "flax_lm", "flops_per_token": 1e6, "error": "ValueError: x"},
        {"row": "roberta", "model": "RoBERTa", "side": "peer", **measured},
    ]
    text = suite.summarize(measurements, None, arguments)["text"]
    assert "| Llama | peer | 500 | 2.00 |" in text
    assert "| Llama | fp8 | 1,500 | 1.50 |" in text  # a setting of the project's side: its speed to the project's
    assert "| RoBERTa | flax_lm | failed: ValueError: x | – | – | – | – |" in text
    assert "| RoBERTa | peer | 1,000 | – |" in text  # no ratio without the project's side


def test_sides_that_the_time_budget_leaves_no_room_for_are_reported_as_not_run(suite, tmp_path, monkeypatch, capsys):
    json_path = tmp_path / "suite.json"
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "--smoke", "--time_budget", "30", "--json", str(json_path)])
    suite.main()
    printed = capsys.readouterr().out
    measurements = json.loads(json_path.read_text())["measurements"]
    assert len(measurements) == 12  # every side of the five training rows
    assert {m["error"] for m in measurements} == {"not run: the suite's --time_budget was spent"}
    assert printed.count("| failed: not run: the suite's --time_budget was spent |") == 12


def test_post_training_rows_run_when_named_and_report_both_sides_or_why_not(suite, tmp_path, monkeypatch, capsys):
    json_path = tmp_path / "suite.json"
    argv = ["gpu_suite.py", "--smoke", "--rows", "dpo", "grpo", "--time_budget", "30", "--json", str(json_path)]
    monkeypatch.setattr(sys, "argv", argv)
    suite.main()
    printed = capsys.readouterr().out
    report = json.loads(json_path.read_text())
    assert report["measurements"] == [] and set(report["post_training"]) == {"dpo", "grpo"}
    assert printed.count("failed: not run: the suite's --time_budget was spent") == 2
    measured = {"flax_lm": {"steps_per_second": 3.0}, "trl": {"steps_per_second": 0.5}, "command": "benchmark_dpo.py"}
    assert suite.post_training_table({"dpo": measured})[-1] == "| dpo | 3.00 | 0.50 | 6.00 | benchmark_dpo.py |"


def test_packed_example_rows_hold_whole_examples_with_the_loss_on_their_completions():
    shared = load_benchmark("suite_shared")
    rows = shared.packed_example_rows(batch_size=3, sequence_length=256, vocab_size=100)
    for input_ids, weights, positions in zip(rows["input_ids"], rows["weights"], rows["position_ids"]):
        starts = np.flatnonzero(input_ids == shared.BOS_TOKEN_ID)
        assert len(starts) >= 2 and starts[0] == 0  # several examples, the first at the start
        assert np.all(positions[starts] == 0) and np.all(np.diff(positions)[np.diff(positions) != 1] < 0)
        ends = np.flatnonzero(input_ids == shared.EOS_TOKEN_ID)
        for start in starts:
            end = ends[ends > start][0]  # each example ends in EOS: none cut at the row's end
            example_weights = weights[start : end + 1]
            # Weight 0 on BOS and the prompt, then 1 on the completion and its EOS, nothing after.
            first_weighted = np.flatnonzero(example_weights)[0]
            assert first_weighted >= 2 and np.all(example_weights[first_weighted:] == 1)
            assert np.all(example_weights[:first_weighted] == 0)
        last_end = ends[ends > starts[-1]][0]
        assert np.all(weights[last_end + 1 :] == 0)  # the padding after the last example is not trained on


def test_the_t5_peer_trains_on_the_batch_benchmark_t5_corrupts_for_the_project():
    shared, benchmark_t5 = load_benchmark("suite_shared"), load_benchmark("benchmark_t5")
    peer = shared.span_corrupted_batch(batch_size=3, input_length=64, vocab_size=256)
    config = T5Config(vocab_size=256)
    make_batch = benchmark_t5.batch_maker(config, 64)
    rows = benchmark_t5.random_rows(config, make_batch, 3)
    ours = make_batch(rows, np.arange(3), 3, (0,))
    assert peer["row_length"] == make_batch.row_length == 70
    np.testing.assert_array_equal(peer["input_ids"], ours["input_ids"])
    np.testing.assert_array_equal(peer["labels"], ours["labels"])
    assert (peer["input_ids"] >= 256 - shared.T5_SENTINELS).any()  # corrupted: sentinels stand for the spans
