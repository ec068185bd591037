"""The registry of model families (flax_lm/models/__init__.py FAMILIES): each family registers the model types its
model.py computes and presets of those types, no preset name twice; and what a script or model file written for
flax_lm 0.4's flat flax_lm/models/ meets: a moved name refused in one line, a copy of a 0.4 module run as it was."""

import sys

import pytest
from conftest import REPO_DIR

from flax_lm.errors import UsageError
from flax_lm.models import (
    FAMILIES,
    check_model_type,
    config_class,
    encoder_decoder_types,
    family,
    import_model_file,
    model_module,
    model_types,
    presets,
    stock_module,
)
from flax_lm.models.model_code import EARLIER_VERIFIED_FINGERPRINTS, module_code_fingerprint


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_registers_what_its_module_computes(name):
    registered = family(name)
    module = stock_module(next(iter(registered.config_classes)))
    assert module.__name__ == f"flax_lm.models.{name}.model"
    assert set(registered.config_classes) == set(module.HF_ARCHITECTURES)
    for model_type in registered.config_classes:
        assert config_class(model_type).model_type == model_type
    assert {model_type for model_type, _ in registered.presets.values()} <= set(registered.config_classes)


def test_no_two_families_register_a_preset_of_one_name():
    assert len(presets()) == sum(len(family(name).presets) for name in FAMILIES)


@pytest.mark.parametrize(
    "statement, new_import",
    [
        ("from flax_lm.models.gpt2 import FlaxGPT2LMHeadModel", "from flax_lm.models.gpt2.model import"),
        ("from flax_lm.models.llama import MODEL_CLASS", "from flax_lm.models.llama.model import"),
        ("from flax_lm.models.common import rotate", "flax_lm.models.shared.common"),
    ],
)
def test_an_import_of_a_0_4_model_module_is_refused_in_one_line_naming_the_new_one(statement, new_import):
    """The refusal is a SystemExit, which Python prints as the one line a user reads, without a traceback."""
    with pytest.raises(SystemExit) as refusal:
        exec(statement, {})
    message = str(refusal.value)
    assert message.startswith("error: ") and "\n" not in message and new_import in message


def test_a_copy_of_a_0_4_module_runs_as_it_was_with_the_fingerprint_its_runs_recorded(tmp_path):
    """flax_lm 0.4's gpt2.py, which imported flax_lm.models.common (shared/common.py now, byte for byte), loads as a
    --model_file with the fingerprint 0.4 verified, so its runs resume and its exports load."""
    text = (REPO_DIR / "flax_lm" / "models" / "gpt2" / "model.py").read_text()
    text = text.replace("from flax_lm.models.shared.common import", "from flax_lm.models.common import")
    text = text.replace(
        "flax_lm/models/README.md says what one holds", "flax_lm/models/__init__.py says what one holds"
    )
    (tmp_path / "my_gpt2.py").write_text(text)
    module = import_model_file(str(tmp_path / "my_gpt2.py"))
    assert module_code_fingerprint(module) in EARLIER_VERIFIED_FINGERPRINTS["gpt2"]
    assert "flax_lm.models.common" not in sys.modules  # only the model file's import finds it


@pytest.mark.parametrize("generates_text, script", [(True, "run_clm_flax.py"), (False, "run_mlm_flax.py")])
def test_the_causal_and_masked_scripts_refuse_an_encoder_decoder_in_one_line_naming_its_script(generates_text, script):
    assert "t5" not in model_types(generates_text) and encoder_decoder_types() == ["t5"]
    refusal = f"^{script} does not train T5 \\(model type 't5', an encoder-decoder\\); run_t5_mlm_flax.py trains it$"
    with pytest.raises(UsageError, match=refusal):
        check_model_type("t5", generates_text)  # --model_type t5
    with pytest.raises(UsageError, match=refusal):
        model_module("t5", None, generates_text, script)  # a T5 config.json


def test_the_t5_script_s_lookup_takes_t5_alone():
    assert model_module("t5", None, False, "run_t5_mlm_flax.py", encoder_decoder=True).ENCODER_DECODER
    with pytest.raises(
        UsageError, match="run_t5_mlm_flax.py trains encoder-decoders \\(t5\\), not model type 'llama'"
    ):
        model_module("llama", None, False, "run_t5_mlm_flax.py", encoder_decoder=True)
