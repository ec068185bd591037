"""benchmarks/gpu_suite.py's CPU smoke, each side of each row in a process of its own: it measures each model on both
sides and prints the table its JSON holds."""

import json
import re
import sys

from test_gpu_suite import load_benchmark


def number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell))


def test_the_smoke_measures_the_rows_on_both_sides_and_its_json_holds_the_printed_table(tmp_path, monkeypatch, capsys):
    suite = load_benchmark("gpu_suite")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    json_path = tmp_path / "suite.json"
    # The Llama's pretraining row is left out: its fine-tuning row runs the same model and peer class, with packed
    # examples and the loss mask besides, and each row is two processes that import jax or torch.
    rows = [*(row for row in suite.TRAINING_ROWS if row != "llama"), suite.T5_ROW, suite.GENERATION_ROW]
    argv = ["gpu_suite.py", "--smoke", "--steps", "1", "--rounds", "1", "--rows", *rows, "--json", str(json_path)]
    monkeypatch.setattr(sys, "argv", argv)
    suite.main()
    printed = capsys.readouterr().out
    report = json.loads(json_path.read_text())

    expected_sides = [
        ("gpt2", "flax_lm"), ("gpt2", "transformers GPT2LMHeadModel"), ("gpt2", "lean GPT (peers/lean_gpt.py)"),
        ("gpt2", "flax_lm --fp8"),
        ("llama_finetune", "flax_lm"), ("llama_finetune", "transformers LlamaForCausalLM"),
        ("qwen3_moe", "flax_lm"), ("qwen3_moe", "transformers Qwen3MoeForCausalLM"),
        ("roberta", "flax_lm"), ("roberta", "transformers RobertaForMaskedLM"),
        ("t5", "flax_lm"), ("t5", "transformers T5ForConditionalGeneration, Adafactor"),
    ]  # fmt: skip
    measurements = report["measurements"]
    assert [(m["row"], m["side"]) for m in measurements] == expected_sides
    failures = [f"{m['row']}, {m['side']}: {m['error']}" for m in measurements if "error" in m]
    assert not failures, failures
    for row in {m["row"] for m in measurements}:  # both sides train the same model
        assert len({m["parameters"] for m in measurements if m["row"] == row}) == 1, row
    # T5's FLOPs a token of text, counted from the shape here and by benchmark_t5.py from its weights (norms too).
    t5 = next(m for m in measurements if m["row"] == "t5" and m["side"] == "flax_lm")
    counted_there = t5["model_tflops_per_second"] * 1e12 / t5["train_tokens_per_second"]
    assert abs(counted_there / t5["flops_per_token"] - 1) < 0.01, (counted_there, t5["flops_per_token"])

    table = [line.split(" | ") for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    training_table = table[1 : 1 + len(expected_sides)]  # after the header, before the generation table's
    for cells, measurement in zip(training_table, measurements, strict=True):
        model, side, tokens_per_second, ratio, mfu, memory, first_step = (cell.strip(" |") for cell in cells)
        assert (model, side) == (measurement["model"], measurement["side"])
        assert abs(number(tokens_per_second) - measurement["train_tokens_per_second"]) <= 0.5
        assert number(tokens_per_second) > 0
        assert number(mfu) > 0 and abs(number(mfu) / 100 - measurement["mfu"]) <= 0.0005
        assert number(memory) > 0 and abs(number(memory) * 1e9 - measurement["peak_memory_bytes"]) <= 0.005e9
        assert number(first_step) > 0 and abs(number(first_step) - measurement["seconds_to_first_step"]) <= 0.05
        if side == "flax_lm":
            assert ratio == "–" and measurement["ratio"] is None
        else:
            assert number(ratio) > 0 and abs(number(ratio) - measurement["ratio"]) <= 0.005

    generation = report["generation"]
    assert "error" not in generation, generation["error"]
    generation_table = table[2 + len(expected_sides) :]
    assert [int(number(cells[0].split(",")[0])) for cells in generation_table] == [1, 4]  # "| batch 1, greedy"
    for cells, row in zip(generation_table, generation["rows"], strict=True):
        assert number(cells[1]) > 0 and abs(number(cells[1]) - row["jax_tokens_per_second"]) <= 0.5
        assert number(cells[2]) > 0 and abs(number(cells[2]) - row["torch_tokens_per_second"]) <= 0.5
    assert "torch" in report["versions"] and "jax" in report["versions"] and report["card"] == "cpu"
