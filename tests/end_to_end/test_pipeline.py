"""The quickstart in miniature: tokenizer, config and training chained through the command-line tools, for each
causal model type."""

import importlib.util
import json
import shlex
import shutil

import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_tools_chain_into_a_trained_model_that_transformers_loads(run_tool, test_tokenizer_dirs, model_type, tmp_path):
    model_dir = shutil.copytree(test_tokenizer_dirs[model_type], tmp_path / f"{model_type}-tiny")
    result = run_tool("create_config.py", "--preset", f"{model_type}-tiny", "--tokenizer_dir", model_dir)
    assert result.returncode == 0, result.stderr

    output_dir = tmp_path / "trained"
    result = run_tool(
        "run_clm_flax.py",
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", FIXTURES_DIR / "en" / "train.txt", "--do_train", "--do_eval",
        "--block_size", 64, "--per_device_train_batch_size", 8, "--max_steps", 20, "--logging_steps", 10,
        "--learning_rate", 3e-3, "--sample_tokens", 5, "--eval_steps", 10,
        "--sample_prompt", "The gardener", "--sample_prompt", "Once upon",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((output_dir / "eval_results.json").read_text())["eval_loss"] < 6.5  # ln(1000) = 6.9
    samples = [line for line in result.stdout.splitlines() if line.startswith("sample from")]
    assert len(samples) == 2 and "'The gardener" in samples[0] and "'Once upon" in samples[1]
    # Samples at the evaluation of step 10 and at the last one, in TensorBoard's text tab.
    events = EventFileLoader(str(next((output_dir / "tensorboard").glob("events.*")))).Load()
    sample_steps = [event.step for event in events if any(value.tag == "samples" for value in event.summary.value)]
    assert sample_steps == [10, 20]

    generator = pipeline(
        "text-generation",
        model=AutoModelForCausalLM.from_pretrained(output_dir),
        tokenizer=AutoTokenizer.from_pretrained(output_dir),
    )
    text = generator("The gardener", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("The gardener") and len(text) > len("The gardener")


def quickstart_commands() -> dict[str, list[str]]:
    """The arguments quickstart.sh gives each tool for GPT-2 (its clm task), continuation lines joined and the
    branch's shell variables ($model_type, $shape) filled in."""
    text = (REPO_DIR / "quickstart.sh").read_text().replace("\\\n", " ")
    causal_branch = text.split('if [ "$task" != mlm ]; then')[1].split("\nelse\n")[0]
    settings_line = next(line for line in causal_branch.splitlines() if 'if [ "$task" = clm ]; then' in line)
    settings = dict(
        word.split("=", 1) for word in shlex.split(settings_line.split("then", 1)[1].split(";")[0]) if "=" in word
    )
    commands = {}
    for line in causal_branch.splitlines():
        command = shlex.split(line.replace("$model_type", settings["model_type"]), comments=True)
        if command and command[0].startswith("./"):
            expanded = [
                word
                for argument in command
                for word in (shlex.split(settings["shape"]) if argument == "$shape" else [argument])
            ]
            commands[expanded[0].removeprefix("./")] = expanded[1:]
    return commands


def test_quickstart_runs_the_recommended_recipe_of_the_time_to_quality_benchmark():
    specification = importlib.util.spec_from_file_location(
        "benchmark_time_to_quality", REPO_DIR / "benchmarks" / "benchmark_time_to_quality.py"
    )
    benchmark = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(benchmark)
    recipe, commands = benchmark.RECIPES["recommended"], quickstart_commands()

    def value_of(tool: str, flag: str):
        arguments = commands[tool]
        return arguments[arguments.index(flag) + 1]

    assert value_of("train_tokenizer.py", "--vocab_size") == str(recipe.vocab_size)
    assert value_of("train_tokenizer.py", "--model_max_length") == str(recipe.positions)
    assert value_of("create_config.py", "--preset") == recipe.preset
    config = commands["create_config.py"]
    assert set(recipe.config) <= set(config[config.index("--set") + 1 :])
    flags = dict(zip(recipe.training[::2], recipe.training[1::2]))
    assert {flag: value_of("run_clm_flax.py", flag) for flag in flags} == flags
