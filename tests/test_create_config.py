"""Behaviour of create_config.py: the config it writes, the parameter count it prints, and the settings it refuses."""

import importlib.util
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
)

from flax_lm.command_line import tool_arguments

REPO_DIR = Path(__file__).resolve().parent.parent


def load_create_config_module():
    spec = importlib.util.spec_from_file_location("create_config", REPO_DIR / "create_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


create_config = load_create_config_module()


def assert_single_error_line(result, *expected_words):
    """A bad setting ends with status 2 and one line on stderr that says what is wrong, without a traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for word in expected_words:
        assert word in lines[0]


def printed_parameter_count(stdout):
    return int(re.search(r"parameters: ([\d,]+)", stdout).group(1).replace(",", ""))


def torch_parameter_count(model):
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.fixture
def gpt2_model_dir(gpt2_tokenizer_dir, tmp_path):
    return Path(shutil.copytree(gpt2_tokenizer_dir, tmp_path / "model"))


@pytest.fixture
def roberta_model_dir(roberta_tokenizer_dir, tmp_path):
    return Path(shutil.copytree(roberta_tokenizer_dir, tmp_path / "model"))


# ---------------------------------------------------------------------------------------------------------------------
# What is written
# ---------------------------------------------------------------------------------------------------------------------


def test_gpt2_config_goes_next_to_the_tokenizer_and_matches_it(run_tool, gpt2_model_dir):
    result = run_tool("create_config.py", "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir)

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(gpt2_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(gpt2_model_dir)
    assert isinstance(config, GPT2Config)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (2, 128, 2, 256)
    assert config.vocab_size == len(tokenizer) == 1000
    assert config.bos_token_id == config.eos_token_id == tokenizer.eos_token_id == 0
    assert config.architectures == ["GPT2LMHeadModel"]
    assert type(tokenizer).__name__ == "GPT2Tokenizer"  # the tokenizer still loads from the model directory
    assert printed_parameter_count(result.stdout) == torch_parameter_count(GPT2LMHeadModel(config))


def test_roberta_config_rounds_the_vocab_up_and_takes_the_special_ids(run_tool, roberta_model_dir):
    result = run_tool(
        "create_config.py",
        "--preset", "roberta-tiny",
        "--tokenizer_dir", roberta_model_dir,
        "--pad_vocab_to_multiple_of", 128,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(roberta_model_dir)
    assert isinstance(config, RobertaConfig)
    assert config.vocab_size == 1024  # the tokenizer's 1000, rounded up
    assert (config.bos_token_id, config.pad_token_id, config.eos_token_id) == (0, 1, 2)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 128, 512)
    assert config.max_position_embeddings == 258
    assert config.type_vocab_size == 1
    assert config.architectures == ["RobertaForMaskedLM"]
    assert printed_parameter_count(result.stdout) == torch_parameter_count(RobertaForMaskedLM(config))


def test_preset_and_overrides_from_a_json_arguments_file_without_a_tokenizer(run_tool, tmp_path):
    arguments = {
        "preset": "gpt2-mini",
        "output_dir": str(tmp_path / "model"),
        "overrides": ["n_layer=3", "resid_pdrop=0", "activation_function=gelu", "hidden_size=192"],
    }
    (tmp_path / "arguments.json").write_text(json.dumps(arguments))

    result = run_tool("create_config.py", tmp_path / "arguments.json")

    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(tmp_path / "model")
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (3, 192, 4, 512)
    assert config.resid_pdrop == 0.0
    assert config.activation_function == "gelu"
    assert config.vocab_size == 50257  # the preset's, as there is no tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# Parameter count
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2-tiny", {"vocab_size": 1000}),
        ("gpt2-tiny", {"vocab_size": 1000, "tie_word_embeddings": False, "n_inner": 300}),
        ("roberta-tiny", {"vocab_size": 1000}),
        ("roberta-tiny", {"vocab_size": 1000, "tie_word_embeddings": False, "type_vocab_size": 2}),
        ("qwen3-tiny", {"vocab_size": 1000}),
        ("gemma3-tiny", {"vocab_size": 1000}),
        ("olmo2-tiny", {"vocab_size": 1000, "tie_word_embeddings": False}),
        ("gpt-j-tiny", {"vocab_size": 1000, "tie_word_embeddings": True}),
        ("pythia-tiny", {"vocab_size": 1000, "attention_bias": False}),
        ("opt-tiny", {"vocab_size": 1000, "word_embed_proj_dim": 64, "tie_word_embeddings": False}),
        ("opt-tiny", {"vocab_size": 1000, "do_layer_norm_before": False, "enable_bias": False}),
    ],
)
def test_parameter_count_matches_the_pytorch_model(preset, overrides):
    model_type, preset_values = create_config.PRESETS[preset]
    config = create_config.CONFIG_CLASSES[model_type](**{**preset_values, **overrides})
    model_class = {"gpt2": GPT2LMHeadModel, "roberta": RobertaForMaskedLM}.get(model_type, AutoModelForCausalLM)
    model = model_class.from_config(config) if model_class is AutoModelForCausalLM else model_class(config)

    assert create_config.count_parameters(config) == torch_parameter_count(model)


# The parameter counts of the published models the family presets take their shapes from (their model cards: 0.6B,
# 268M, 1.48B, 134.5M; Pythia's table of sizes in the EleutherAI/pythia README; the tensors of the facebook/opt-125m
# and EleutherAI/gpt-j-6b weight files, whose model card's table says 6,053,381,344, 2,498,560 more than they hold).
PUBLISHED_PARAMETERS = {"qwen3-0.6b": 596_049_920, "gemma3-270m": 268_098_176, "olmo2-1b": 1_484_916_736,
                        "smollm-135m": 134_515_008, "pythia-160m": 162_322_944, "opt-125m": 125_239_296,
                        "gpt-j-6b": 6_050_882_784}  # fmt: skip


@pytest.mark.parametrize("preset", create_config.FAMILY_PRESETS)
def test_each_family_preset_is_a_config_its_module_computes(preset):
    model_type, preset_values = create_config.PRESETS[preset]
    config = create_config.CONFIG_CLASSES[model_type](**preset_values)
    create_config.check_config(config, preset)
    assert config.model_type == model_type
    if preset in PUBLISHED_PARAMETERS:
        assert create_config.count_parameters(config) == PUBLISHED_PARAMETERS[preset]


def test_parameter_count_of_gpt2_small_is_the_published_124m():
    model_type, preset_values = create_config.PRESETS["gpt2"]

    assert create_config.count_parameters(GPT2Config(**preset_values)) == 124_439_808


# ---------------------------------------------------------------------------------------------------------------------
# Refused settings
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refusals(run_tool, gpt2_tokenizer_dir, tmp_path_factory):
    """The refused settings its page names, each run as a user runs it, side by side (most of each run is Python
    starting up). Returns the scratch directory they ran in and their CompletedProcess by name.
    """
    scratch = tmp_path_factory.mktemp("refusals")
    shutil.copytree(gpt2_tokenizer_dir, scratch / "gpt2-vocab")
    cases = {
        "heads": ["--preset", "roberta-mini", "--output_dir", scratch / "heads", "--set", "num_attention_heads=3"],
        "vocab": ["--preset", "gpt2-tiny", "--tokenizer_dir", scratch / "gpt2-vocab", "--set", "vocab_size=999"],
        "unknown key": ["--preset", "gpt2-tiny", "--output_dir", scratch / "unknown", "--set", "n_layers=4"],
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_tool, "create_config.py", *args) for name, args in cases.items()}
    return scratch, {name: future.result() for name, future in futures.items()}


def test_hidden_size_not_divisible_by_heads_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["heads"], "hidden size 256", "3 attention heads")
    assert not (scratch / "heads" / "config.json").exists()


def test_vocab_smaller_than_the_tokenizer_is_refused(refusals):
    scratch, results = refusals

    assert_single_error_line(results["vocab"], "vocab_size 999", "1000")
    assert not (scratch / "gpt2-vocab" / "config.json").exists()


def test_unknown_key_is_refused_with_close_matches(refusals):
    scratch, results = refusals

    assert_single_error_line(results["unknown key"], "n_layers", "did you mean n_layer")
    assert not (scratch / "unknown" / "config.json").exists()


# The refusals below are checked by calling main() in this process, which is faster than starting a new one; the
# tests above show that a UsageError reaches the user as one line on stderr.


def run_main(monkeypatch, *args):
    monkeypatch.setattr("sys.argv", ["create_config.py", *map(str, args)])
    create_config.main()


def test_too_few_positions_for_the_tokenizer_are_refused(monkeypatch, roberta_model_dir):
    with pytest.raises(create_config.UsageError) as refusal:
        run_main(
            monkeypatch,
            "--preset", "roberta-tiny",
            "--tokenizer_dir", roberta_model_dir,
            "--set", "max_position_embeddings=130",
        )  # fmt: skip

    # RoBERTa's positions start after the padding id, so 130 positions hold 128 tokens, fewer than 256.
    message = str(refusal.value)
    assert "room for 128 tokens" in message and "model_max_length is 256" in message
    assert "--set max_position_embeddings=258" in message
    assert not (roberta_model_dir / "config.json").exists()


def test_model_type_contradicting_the_preset_is_refused(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="model_type=roberta contradicts the preset"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--output_dir", tmp_path, "--set", "model_type=roberta")

    assert not (tmp_path / "config.json").exists()


def test_two_names_for_one_value_must_agree(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="contradict each other"):
        run_main(
            monkeypatch, "--preset", "gpt2-tiny", "--output_dir", tmp_path, "--set", "n_embd=128", "hidden_size=256"
        )


def test_missing_tokenizer_dir_is_refused(monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match="--tokenizer_dir .*missing is not a directory"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", tmp_path / "missing")

    assert not (tmp_path / "missing").exists()


def test_existing_config_is_kept_unless_overwrite_is_given(monkeypatch, gpt2_model_dir):
    (gpt2_model_dir / "config.json").write_text('{"model_type": "gpt2", "n_layer": 7}')

    with pytest.raises(create_config.UsageError, match="already has a config.json; pass --overwrite"):
        run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir)
    assert (gpt2_model_dir / "config.json").read_text() == '{"model_type": "gpt2", "n_layer": 7}'

    run_main(monkeypatch, "--preset", "gpt2-tiny", "--tokenizer_dir", gpt2_model_dir, "--overwrite")
    assert AutoConfig.from_pretrained(gpt2_model_dir).n_layer == 2


def test_a_json_arguments_file_with_a_value_of_the_wrong_type_is_refused(monkeypatch, tmp_path):
    arguments = {"preset": "gpt2-tiny", "output_dir": str(tmp_path / "model"), "pad_vocab_to_multiple_of": "64"}
    (tmp_path / "arguments.json").write_text(json.dumps(arguments))

    message = "arguments.json: 'pad_vocab_to_multiple_of' must be of type int | None, not '64'"
    with pytest.raises(create_config.UsageError, match=re.escape(message)):
        run_main(monkeypatch, tmp_path / "arguments.json")
    assert not (tmp_path / "model").exists()


def test_arguments_are_parsed_by_the_one_definition_train_tokenizer_uses():
    """create_config.py and train_tokenizer.py share their argument parsing: flax_lm.command_line.tool_arguments, not
    a copy."""
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO_DIR / "train_tokenizer.py")
    train_tokenizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tokenizer)

    assert create_config.parse_arguments is tool_arguments.parse_arguments
    assert train_tokenizer.parse_arguments is tool_arguments.parse_arguments


@pytest.mark.parametrize(
    "arguments, message",
    [
        # Named before argparse would answer that --preset is required.
        (["--presett", "gpt2-tiny"], "unknown argument --presett; see --help"),
        (["--preset", "gpt2-tiny", "--tokenizer_dirr=x"], "unknown argument --tokenizer_dirr; see --help"),
        (["--preset", "gpt2-tiny", "stray"], "unexpected argument stray; flags start with --"),
    ],
)
def test_a_misspelt_or_stray_argument_is_refused_in_one_line_naming_it(arguments, message, monkeypatch, tmp_path):
    with pytest.raises(create_config.UsageError, match=re.escape(message)):
        run_main(monkeypatch, "--output_dir", tmp_path / "model", *arguments)
    assert not (tmp_path / "model").exists()
