"""The package shows its parts: each subpackage says what it holds, and a script written for the flat layout of 0.3
stops at its first import of a moved module with one line naming the new one."""

import importlib
import os
import pkgutil
import subprocess
import sys

import pytest

import flax_lm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subpackages():
    return [info.name for info in pkgutil.iter_modules(flax_lm.__path__) if info.ispkg]


@pytest.mark.parametrize("name", subpackages())
def test_each_subpackage_says_what_it_holds_and_is_in_the_package_map(name):
    package = importlib.import_module(f"flax_lm.{name}")
    assert package.__doc__ and len(package.__doc__.split()) > 10, f"flax_lm/{name}/__init__.py has no docstring"
    assert f"{name}/" in flax_lm.__doc__, f"flax_lm/__init__.py's map does not name {name}/"


def test_every_moved_module_of_the_flat_layout_exists_where_its_refusal_sends_the_user():
    for old, new in flax_lm.MOVED_MODULES.items():
        assert importlib.util.find_spec(f"flax_lm.{new}") is not None, f"flax_lm.{old} is said to be flax_lm.{new}"
    for old, new in flax_lm.MODULES_NOW_SUBPACKAGES.items():
        assert importlib.util.find_spec(f"flax_lm.{new}") is not None, f"flax_lm.{old} is said to be flax_lm.{new}"


@pytest.mark.parametrize(
    "statement, new_import",
    [
        ("from flax_lm.run_dir import open_output_dir", "flax_lm.run.output_dir"),
        ("import flax_lm.sampling", "flax_lm.generation.sampling"),
        ("from flax_lm import hf_io", "flax_lm.models.huggingface"),
        ("from flax_lm.data import load_data", "from flax_lm.data.loading import load_data"),
        ("from flax_lm.training import set_up_training", "from flax_lm.training.setup import set_up_training"),
    ],
)
def test_a_script_of_the_flat_layout_is_refused_in_one_line_naming_the_new_import(tmp_path, statement, new_import):
    script = tmp_path / "old_script.py"
    script.write_text(f"{statement}\nprint('ran')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 1 and "ran" not in result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert new_import in result.stderr and "Traceback" not in result.stderr


def test_a_name_that_never_existed_is_still_an_ordinary_import_error():
    with pytest.raises(ImportError):
        from flax_lm.data import no_such_function  # noqa: F401


def test_a_checkpoint_of_the_flat_layouts_stock_model_resumes_and_other_code_does_not():
    """Moving the modules changed the stock models' import lines, so their fingerprints: the fingerprints of 0.3's
    stock modules, verified against the same transformers classes, count as the same code; others do not."""
    from test_clm import tiny_config

    from flax_lm.models.model_code import EARLIER_VERIFIED_FINGERPRINTS, load_model_code

    model_code = load_model_code(tiny_config(), None, True, "run_clm_flax.py")
    assert model_code.claims_architecture
    assert all(model_code.computes_as(earlier) for earlier in EARLIER_VERIFIED_FINGERPRINTS["gpt2"])
    assert model_code.computes_as(model_code.fingerprint)
    assert not model_code.computes_as("0123456789abcdef")
    # Another model's earlier code is other code.
    assert not any(model_code.computes_as(earlier) for earlier in EARLIER_VERIFIED_FINGERPRINTS["llama"])
