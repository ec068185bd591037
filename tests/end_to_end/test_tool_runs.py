"""The tools run as a user runs them, in processes of their own: their log lines, their --help without PyTorch, and
a script's import of the flat layout refused in one line."""

import re
import subprocess
import sys

import pytest
from conftest import REPO_DIR
from test_clm import OFFLINE_ENV, run_clm_flax
from test_hostile_inputs import SCRIPTS

from flax_lm.command_line import start
from flax_lm.devices import processes


def test_the_tools_log_in_the_format_of_the_training_scripts(run_tool, gpt2_tokenizer_dir, tmp_path):
    result = run_tool(
        "create_config.py", "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_tokenizer_dir, "--output_dir", tmp_path
    )
    assert result.returncode == 0, result.stderr
    (log_line,) = [line for line in result.stdout.splitlines() if "From the tokenizer" in line]
    # LOG_FORMAT: the time, the level, the logger and the message.
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO __main__: From the tokenizer in .*", log_line)
    assert SCRIPTS["create_config"].LOG_FORMAT == processes.LOG_FORMAT == SCRIPTS["train_tokenizer"].LOG_FORMAT
    # The training scripts log through flax_lm.command_line.start.start_run, which sets up processes.setup_logging.
    assert run_clm_flax.start_run is start.start_run is SCRIPTS["run_mlm_flax"].start_run
    assert start.setup_logging is processes.setup_logging


@pytest.mark.parametrize(
    "script", ["run_clm_flax.py", "run_mlm_flax.py", "generate_flax.py", "create_config.py", "train_tokenizer.py"]
)
def test_no_tool_warns_that_pytorch_is_missing_where_it_is(script):
    """transformers warns on import where PyTorch is missing; the tools need it only to compare with PyTorch or read a
    pickle, and a newcomer reads the warning as an error. Here PyTorch is made missing for the process."""
    runner = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = [{script!r}, '--help']; runpy.run_path({script!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", runner], cwd=REPO_DIR, capture_output=True, text=True, timeout=120, env=OFFLINE_ENV
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "PyTorch was not found" not in result.stderr


@pytest.mark.parametrize(
    "statement, new_import",
    [
        ("from flax_lm.run_dir import open_output_dir", "flax_lm.run.output_dir"),
        ("import flax_lm.sampling", "flax_lm.generation.sampling"),
        ("from flax_lm import hf_io", "flax_lm.models.huggingface"),
        ("from flax_lm.data import load_data", "from flax_lm.data.loading import load_data"),
        ("from flax_lm.training import set_up_training", "from flax_lm.training.lifecycle import set_up_training"),
        ("from flax_lm.training.setup import set_up_training", "flax_lm.training.lifecycle"),
    ],
)
def test_a_script_of_the_flat_layout_is_refused_in_one_line_naming_the_new_import(tmp_path, statement, new_import):
    script = tmp_path / "old_script.py"
    script.write_text(f"{statement}\nprint('ran')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO_DIR)
    assert result.returncode == 1 and "ran" not in result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert new_import in result.stderr and "Traceback" not in result.stderr
