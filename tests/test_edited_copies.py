"""A training script copied and edited, as a researcher does: what the edit changes must never give a silently wrong
result or lose the run. The token cache follows the code that makes the rows; a checkpoint resumes in a copy that
sums another metric; checkpoints that exist but cannot be read stop the run and stay; a schedule added to the copy's
table is taken by its flag; and a model edited off the architecture its export names is refused before it trains.

Each case runs a copy of run_clm_flax.py, edited by exact replacements, in a fresh process, as a user runs it."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from safetensors import safe_open
from test_clm import OFFLINE_ENV, model_dir_with_config, tiny_config
from transformers import AutoTokenizer, GPT2LMHeadModel, RobertaConfig, RobertaForMaskedLM

from flax_lm.errors import UsageError
from flax_lm.hf_io import save_model
from flax_lm.models import gpt2, roberta
from flax_lm.packed import PackedBlocks, read_packed_index
from flax_lm.train_state import abstract_model_params

CORPUS = FIXTURES_DIR / "en"


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("edited-copies-model"), n_layer=1)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """Offline, with a datasets cache of its own and one compilation cache, so each program is compiled once."""
    return {
        **OFFLINE_ENV,
        "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("compilation-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def edited_copy(source, target, replacements: dict[str, str] | None = None):
    """Copy `source` to `target`, replacing each key of `replacements` (which must occur exactly once) by its value."""
    text = open(source).read()
    for old, new in (replacements or {}).items():
        assert text.count(old) == 1, f"{os.path.basename(source)} no longer holds exactly one {old!r}"
        text = text.replace(old, new)
    with open(target, "w") as file:
        file.write(text)
    return str(target)


def run_copy(script, environment, *arguments):
    return subprocess.run(
        [sys.executable, script, *map(str, arguments)],
        env=environment,
        cwd=os.path.dirname(script),
        capture_output=True,
        text=True,
        timeout=300,
    )


def training_arguments(model_dir, output_dir, *extra):
    return [
        "--output_dir", output_dir, "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", CORPUS / "train.txt", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--seed", "0", "--sample_tokens", "0", "--logging_steps", "1", *extra,
    ]  # fmt: skip


def progress_record(checkpoint) -> dict:
    return json.loads((checkpoint / "progress" / "metadata").read_text())


def snapshot(directory) -> dict:
    """Every file under `directory` with its size and modification time, but the lock (which names its holder)."""
    return {
        os.path.relpath(os.path.join(root, name), directory): (
            os.path.getsize(os.path.join(root, name)),
            os.path.getmtime(os.path.join(root, name)),
        )
        for root, _, names in os.walk(directory)
        for name in names
        if name != ".lock"
    }


# ----------------------------------------------------------------------------------------------------
# The token cache and --packed_data_dir follow the code that makes the rows
# ----------------------------------------------------------------------------------------------------

# An edit of the text pipeline that changes every block: its tokens in reverse order.
REVERSED_BLOCKS = {
    "            yield np.asarray(tokens[:usable], dtype=np.int32).reshape(-1, block_size)\n": (
        "            yield np.asarray(tokens[:usable], dtype=np.int32).reshape(-1, block_size)[:, ::-1]\n"
    )
}


def packed_corpora(cache_dir) -> set[str]:
    return {name for name in os.listdir(cache_dir) if name.startswith("packed-") and not name.endswith(".tmp")}


def train_blocks(directory) -> np.ndarray:
    index = read_packed_index(str(directory))
    return np.asarray(PackedBlocks(str(directory), index["splits"]["train"], index["block_size"]))


def test_token_cache_is_reused_by_the_same_code_and_packed_again_after_an_edit_of_pack_blocks(
    model_dir, environment, tmp_path
):
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py")
    cache_dir = tmp_path / "cache"
    run = [
        *training_arguments(model_dir, tmp_path / "first", "--do_train", "--max_steps", "1"),
        "--cache_dir",
        cache_dir,
    ]
    first = run_copy(script, environment, *run)
    assert first.returncode == 0, first.stderr[-3000:]
    (unedited_corpus,) = packed_corpora(cache_dir)

    run[run.index("--output_dir") + 1] = tmp_path / "second"
    second = run_copy(script, environment, *run)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Loading packed train blocks from cache" in second.stderr
    assert packed_corpora(cache_dir) == {unedited_corpus}

    edited_copy(script, script, REVERSED_BLOCKS)  # in place: the file's name is part of the code's fingerprint
    run[run.index("--output_dir") + 1] = tmp_path / "edited"
    third = run_copy(script, environment, *run)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Loading packed train blocks from cache" not in third.stderr
    (edited_corpus,) = packed_corpora(cache_dir) - {unedited_corpus}
    unedited_blocks = train_blocks(cache_dir / unedited_corpus)
    np.testing.assert_array_equal(train_blocks(cache_dir / edited_corpus), unedited_blocks[:, ::-1])


@pytest.fixture(scope="module")
def packed_data_dir(model_dir, environment, tmp_path_factory):
    """The test corpus packed into a --packed_data_dir by the unedited script (neither --do_train nor --do_eval)."""
    directory = tmp_path_factory.mktemp("packed-by-script")
    script = edited_copy(REPO_DIR / "run_clm_flax.py", directory / "run_clm_flax.py")
    arguments = training_arguments(model_dir, directory / "unused", "--packed_data_dir", directory / "packed")
    result = run_copy(script, environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "packed", arguments


def test_packed_data_dir_of_other_code_is_used_with_a_warning_naming_overwrite_cache(
    packed_data_dir, environment, tmp_path
):
    packed_dir, arguments = packed_data_dir
    script = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "run_clm_flax.py")
    (tmp_path / "edited").mkdir()  # the same file name: it is part of the code's fingerprint
    edited = edited_copy(script, tmp_path / "edited" / "run_clm_flax.py", REVERSED_BLOCKS)
    index_time = os.path.getmtime(packed_dir / "index.json")

    unedited = run_copy(script, environment, *arguments)
    assert unedited.returncode == 0, unedited.stderr[-3000:]
    assert "packed by other code" not in unedited.stderr
    result = run_copy(edited, environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"--packed_data_dir {packed_dir} was packed by other code than this script's tokenized_rows" in result.stderr
    )
    assert "add --overwrite_cache to pack it again" in result.stderr
    assert os.path.getmtime(packed_dir / "index.json") == index_time


def test_packed_data_dir_that_records_no_code_fingerprint_loads_without_a_warning(
    packed_data_dir, environment, tmp_path
):
    packed, arguments = packed_data_dir
    packed_dir = tmp_path / "packed"
    shutil.copytree(packed, packed_dir)
    index = json.loads((packed_dir / "index.json").read_text())
    del index["code_fingerprint"]  # as written before the code was fingerprinted
    (packed_dir / "index.json").write_text(json.dumps(index))
    edited = edited_copy(REPO_DIR / "run_clm_flax.py", tmp_path / "edited.py", REVERSED_BLOCKS)

    arguments = [*arguments[: arguments.index("--packed_data_dir")], "--packed_data_dir", packed_dir]
    result = run_copy(edited, environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "packed by other code" not in result.stderr
    assert f"packed data: {packed_dir}" in result.stdout


# ----------------------------------------------------------------------------------------------------
# Checkpoints: a metric sum added or dropped since they were written, and checkpoints none of which can be read
# ----------------------------------------------------------------------------------------------------

# One more sum of the train step, shown in the log line and train_results.json: the sequences trained on.
SEQUENCE_COUNT = {
    'TRAIN_METRIC_SUMS = ("loss_sum", "token_count")': (
        'TRAIN_METRIC_SUMS = ("loss_sum", "token_count", "sequence_count")'
    ),
    '        return loss_sum, {"loss_sum": loss_sum, "token_count": token_count}\n': (
        "        sums = {'loss_sum': loss_sum, 'token_count': token_count}\n"
        "        return loss_sum, sums | {'sequence_count': jnp.float32(input_ids.shape[0])}\n"
    ),
    '    return {"loss": sums["loss_sum"] / max(sums["token_count"], 1.0)}': (
        '    return {"loss": sums["loss_sum"] / max(sums["token_count"], 1.0), "sequences": sums["sequence_count"]}'
    ),
}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The unedited script and a copy that sums SEQUENCE_COUNT too."""
    directory = tmp_path_factory.mktemp("scripts")
    unedited = edited_copy(REPO_DIR / "run_clm_flax.py", directory / "run_clm_flax.py")
    return unedited, edited_copy(unedited, directory / "with_sequence_count.py", SEQUENCE_COUNT)


@pytest.fixture(scope="module")
def two_step_run(model_dir, environment, scripts, tmp_path_factory):
    """A run of the unedited script: 2 steps, checkpoints at 1 and 2."""
    output_dir = tmp_path_factory.mktemp("two-steps")
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "2", "--save_steps", "1")
    result = run_copy(scripts[0], environment, *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(output_dir / "checkpoints"), key=int) == ["1", "2"]
    return output_dir


def tokens_per_step(record) -> int:
    """The tokens a step predicts: every one of a block but the last."""
    return record["global_batch_size"] * (record["block_size"] - 1)


@pytest.fixture(scope="module")
def resumed_with_sequence_count(model_dir, environment, scripts, two_step_run, tmp_path_factory):
    """The two-step run, resumed to step 4 by the copy that sums one more metric."""
    output_dir = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(two_step_run, output_dir)
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "4", "--save_steps", "1")
    result = run_copy(scripts[1], environment, *arguments, "--resume_from_checkpoint")
    return output_dir, result


def test_a_checkpoint_without_a_metric_sum_added_since_resumes_from_its_step(resumed_with_sequence_count):
    output_dir, result = resumed_with_sequence_count
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {output_dir}/checkpoints/2 at step 2" in result.stderr
    assert "The checkpoint records no training sum of sequence_count: counted from step 2 on" in result.stderr
    assert not (output_dir / "discarded-checkpoints").exists()
    record = progress_record(output_dir / "checkpoints" / "4")
    # The sums the checkpoint had go on from it; the added one counts the two steps since the resume.
    assert record["train_token_count"] == 4 * tokens_per_step(record)
    assert record["train_sequence_count"] == 2 * record["global_batch_size"]
    train_results = json.loads((output_dir / "train_results.json").read_text())
    assert train_results["train_sequences"] == 2 * record["global_batch_size"]


def test_a_checkpoint_with_a_metric_sum_dropped_since_resumes_from_its_step(
    model_dir, environment, scripts, resumed_with_sequence_count, tmp_path
):
    output_dir = tmp_path / "run"
    shutil.copytree(resumed_with_sequence_count[0], output_dir)
    assert "train_sequence_count" in progress_record(output_dir / "checkpoints" / "4")
    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "6", "--save_steps", "1")
    result = run_copy(scripts[0], environment, *arguments, "--resume_from_checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {output_dir}/checkpoints/4 at step 4" in result.stderr
    assert "The checkpoint's training sums of sequence_count are no longer summed; left out" in result.stderr
    assert not (output_dir / "discarded-checkpoints").exists()
    record = progress_record(output_dir / "checkpoints" / "6")
    assert "train_sequence_count" not in record
    assert record["train_token_count"] == 6 * tokens_per_step(record)


def test_checkpoints_none_of_which_can_be_read_stop_the_resume_and_stay_as_they_are(
    model_dir, environment, scripts, two_step_run, tmp_path
):
    output_dir = tmp_path / "run"
    shutil.copytree(two_step_run, output_dir)
    (output_dir / "checkpoints" / "2" / "progress" / "metadata").write_text('{"step": 2, "tr')
    (output_dir / "checkpoints" / "1" / "state" / "_METADATA").write_text('{"tree_metadata": {')
    before = snapshot(output_dir)

    arguments = training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "4", "--save_steps", "1")
    result = run_copy(scripts[0], environment, *arguments, "--resume_from_checkpoint")
    assert result.returncode == 2, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        f"error: --resume_from_checkpoint: every training checkpoint in {output_dir}/checkpoints is unreadable "
        "(steps 2, 1; step 2: "
    )
    assert last_line.endswith(
        "they are left as they are: restore them from a copy to resume, or pass --overwrite_output_dir without "
        "--resume_from_checkpoint to start a new run"
    )
    assert "Traceback" not in result.stderr
    assert snapshot(output_dir) == before


# ----------------------------------------------------------------------------------------------------
# The schedules (and optimizers) a copy adds to its own table
# ----------------------------------------------------------------------------------------------------


def test_a_schedule_added_to_a_copy_s_table_is_taken_by_its_flag(model_dir, tmp_path, monkeypatch):
    """LEARNING_RATE_SCHEDULES is the script's, and --lr_scheduler_type takes what it names: no edit of flax_lm."""
    table_end = '    "warmup_stable_decay": warmup_stable_decay,\n}\n'
    added = '    "inverse_sqrt": lambda args, *_: lambda step: args.learning_rate / jnp.sqrt(step + 1.0),\n'
    script = edited_copy(
        REPO_DIR / "run_clm_flax.py", tmp_path / "inverse_sqrt.py", {table_end: table_end[:-2] + added + "}\n"}
    )
    specification = importlib.util.spec_from_file_location("inverse_sqrt", script)
    copy = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(copy)
    arguments = training_arguments(model_dir, tmp_path / "run", "--lr_scheduler_type", "inverse_sqrt")
    monkeypatch.setattr(sys, "argv", [script, *map(str, arguments), "--learning_rate", "1e-2"])
    model_args, data_args, training_args, _ = copy.parse_arguments(
        copy.ModelArguments, copy.DataTrainingArguments, copy.TrainingArguments
    )
    copy.check_arguments(model_args, data_args, training_args)
    schedule = copy.learning_rate_schedule(training_args, total_steps=4)
    np.testing.assert_allclose([schedule(step) for step in range(4)], 1e-2 / np.sqrt([1, 2, 3, 4]), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# The export names an architecture: the parameters must map onto it
# ----------------------------------------------------------------------------------------------------

GPT2_CONFIGS = {
    "tied": {},
    "untied": dict(tie_word_embeddings=False),
    "n_inner": dict(n_inner=48, n_layer=3),
}
ROBERTA_CONFIGS = {
    "one layer": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
    "three layers": dict(
        hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=80, type_vocab_size=2
    ),
}


def roberta_config(**overrides) -> RobertaConfig:
    settings = dict(vocab_size=300, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return RobertaConfig(**{**settings, **overrides})


def saved_shapes(torch_model, directory) -> dict[str, tuple]:
    torch_model.save_pretrained(directory)
    with safe_open(os.path.join(directory, "model.safetensors"), "np") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}


@pytest.mark.parametrize("variant", GPT2_CONFIGS)
def test_gpt2_architecture_shapes_are_those_transformers_saves(variant, tmp_path):
    config = tiny_config(**GPT2_CONFIGS[variant])
    assert gpt2.hf_architecture_shapes(config) == saved_shapes(GPT2LMHeadModel(config), tmp_path)


@pytest.mark.parametrize("variant", ROBERTA_CONFIGS)
def test_roberta_architecture_shapes_are_those_transformers_saves(variant, tmp_path):
    config = roberta_config(**ROBERTA_CONFIGS[variant])
    assert roberta.hf_architecture_shapes(config) == saved_shapes(RobertaForMaskedLM(config), tmp_path)


@pytest.mark.parametrize(
    "model, config",
    [
        (gpt2, tiny_config()),
        (gpt2, tiny_config(tie_word_embeddings=False, n_inner=48)),
        (roberta, roberta_config(**ROBERTA_CONFIGS["one layer"])),
    ],
    ids=["gpt2 tied", "gpt2 untied", "roberta"],
)
def test_hf_shapes_of_abstract_parameters_are_those_of_to_hf_state_dict(model, config):
    flax_model = gpt2.FlaxGPT2LMHeadModel(config) if model is gpt2 else roberta.FlaxRobertaForMaskedLM(config)
    dummy_input = jnp.zeros((1, 8), jnp.int32)
    params = nn.meta.unbox(flax_model.init(jax.random.key(0), dummy_input)["params"])
    written = {name: tensor.shape for name, tensor in model.to_hf_state_dict(params).items()}
    assert model.hf_shapes(abstract_model_params(flax_model, dummy_input)) == written
    assert written == model.hf_architecture_shapes(config)


# Edits of a copy of flax_lm/models/gpt2.py: a parameter of GPT2LMHeadModel removed, and one it does not have added.
MODEL_EDITS = {
    "position embedding removed": (
        {
            '        self.wpe = embed(config.n_positions, ("positions", "embed"))\n': "",
            'self.look_up(self.wte, "vocab", input_ids) + self.look_up(self.wpe, "positions", positions)': (
                'self.look_up(self.wte, "vocab", input_ids)'
            ),
        },
        "no parameter maps onto GPT2LMHeadModel's transformer.wpe.weight (64, 32)",
    ),
    "logit scale added": (
        {
            "        logits = logits.astype(jnp.float32)\n": (
                '        logits = logits.astype(jnp.float32) * self.param("logit_scale", nn.initializers.ones, ())\n'
            )
        },
        "the parameter logit_scale () is not part of GPT2LMHeadModel",
    ),
}


@pytest.mark.parametrize("edit", MODEL_EDITS)
def test_a_model_edited_off_its_architecture_is_refused_before_training(edit, model_dir, environment, tmp_path):
    replacements, problem = MODEL_EDITS[edit]
    edited_copy(REPO_DIR / "flax_lm" / "models" / "gpt2.py", tmp_path / "my_gpt2.py", replacements)
    script = edited_copy(
        REPO_DIR / "run_clm_flax.py",
        tmp_path / "run_clm_flax.py",
        {
            "from flax_lm.models import gpt2\n": "import my_gpt2 as gpt2\n",
            "from flax_lm.models.gpt2 import": "from my_gpt2 import",
        },
    )
    output_dir = tmp_path / "output"
    result = run_copy(
        script, environment, *training_arguments(model_dir, output_dir, "--do_train", "--max_steps", "2")
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the model no longer maps onto GPT2LMHeadModel, which its export names in config.json: "
        f"{problem}; map the model onto it in to_hf_state_dict and hf_shapes of my_gpt2, or name there an "
        "architecture the model fits (HF_ARCHITECTURE, and its tensors in hf_architecture_shapes)"
    )
    assert "Traceback" not in result.stderr
    assert not output_dir.exists()


def test_save_model_refuses_a_parameter_off_the_architecture_and_writes_nothing(gpt2_tokenizer_dir, tmp_path):
    config = tiny_config()
    abstract = abstract_model_params(gpt2.FlaxGPT2LMHeadModel(config), jnp.zeros((1, 8), jnp.int32))
    params = jax.tree_util.tree_map(lambda leaf: np.zeros(leaf.shape, np.float32), abstract)
    params["transformer"]["ln_f"]["extra"] = np.zeros((2,), np.float32)
    output_dir = tmp_path / "export"
    with pytest.raises(UsageError, match=r"the parameter transformer\.ln_f\.extra \(2,\) is not part of GPT2LMH"):
        save_model(str(output_dir), params, config, AutoTokenizer.from_pretrained(gpt2_tokenizer_dir), gpt2)
    assert not output_dir.exists()
