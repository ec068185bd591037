"""run_grpo_flax.py as a user runs it, with LoRA's adapters and the KL term to the base model: a run saves
checkpoints, exports a PEFT adapter, logs TRL's names to TensorBoard and grpo_log.jsonl and records its files; the
same run resumed from its first checkpoint samples the same completions and ends with the uninterrupted run's metrics
and adapter."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_grpo_parity import save_tiny_llama


def test_a_grpo_run_with_adapters_resumes_to_the_metrics_and_adapter_of_an_uninterrupted_run(run_tool, tmp_path):
    model_dir = save_tiny_llama(tmp_path / "model", 0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(4) for b in range(4)))
    flags = [
        "--model_name_or_path", model_dir, "--train_file", prompts, "--num_generations", 4,
        "--per_device_train_batch_size", 8, "--max_completion_length", 4, "--max_steps", 4, "--logging_steps", 2,
        "--save_steps", 2, "--learning_rate", 1e-2, "--beta", 0.04, "--lora_rank", 4, "--reward_funcs", "short",
    ]  # fmt: skip
    output_dir = tmp_path / "run"
    result = run_tool("run_grpo_flax.py", *flags, "--output_dir", output_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "adapter_config.json").is_file() and (output_dir / "checkpoints" / "2").is_dir()
    logged = [json.loads(line) for line in (output_dir / "grpo_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [2, 4]
    assert logged[-1]["kl"] > 0  # the adapters moved the policy away from the base model, the reference
    # Each line's rates are of the steps since the line before (not of the run so far, compilation and all): of the
    # same seconds, so that their ratio is a step's tokens, of 8 prompts of 4 tokens and their completions.
    for row in logged:
        tokens_per_step = 8 * (4 + row["completions/mean_length"])
        assert row["tokens_per_second"] / row["steps_per_second"] == pytest.approx(tokens_per_step), row
    # The record of the run's files (what --overwrite_output_dir removes) has all but the export, the lock and itself.
    recorded = set(json.loads((output_dir / "run_files.json").read_text())["paths"])
    run_folders = ("checkpoints", "code", "tensorboard")
    written = {path.name for path in output_dir.iterdir() if path.name not in run_folders} | {
        f"{folder}/{path.name}" for folder in run_folders for path in (output_dir / folder).iterdir()
    }
    export = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert written - export - {".lock", "run_files.json"} <= recorded, written - recorded

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    trl_names = ["loss", "reward", "reward_std", "kl", "completions/mean_length", "clip_ratio/region_mean"]
    assert {f"train/{name}" for name in trl_names + ["rewards/short/mean"]} <= set(events.Tags()["scalars"])

    # The run interrupted after step 2: its directory as the save of step 2 left it, then the same command resumed.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "4")
    (resumed_dir / "grpo_log.jsonl").write_text(json.dumps(logged[0]) + "\n")
    result = run_tool("run_grpo_flax.py", *flags, "--output_dir", resumed_dir, "--resume_from_checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from" in result.stderr
    resumed = [json.loads(line) for line in (resumed_dir / "grpo_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in resumed] == [2, 4]
    for name in trl_names + ["grad_norm"]:
        assert resumed[1][name] == logged[1][name], name
    adapter, resumed_adapter = (
        load_file(directory / "adapter_model.safetensors") for directory in (output_dir, resumed_dir)
    )
    for name, weight in adapter.items():
        np.testing.assert_array_equal(resumed_adapter[name], weight, err_msg=name)
