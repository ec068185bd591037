"""Tensor parallelism (the tensor axis of --mesh_shape): attention heads, MLP columns and the vocabulary split over
devices train, checkpoint and generate exactly as on one device; and FSDP, which the same run checks. Every test runs
its work in processes of their own with forced CPU devices."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import CHECKS_DIR, FIXTURES_DIR, REPO_DIR
from safetensors.numpy import load_file
from test_clm import OFFLINE_ENV, model_dir_with_config, run_clm_flax, run_script, scalars

CORPUS = FIXTURES_DIR / "en"
# The tensor axis alone over every device, and mixed with the data and fsdp axes (a split by 2 alone adds no path).
MESH_SHAPES = ["tensor=8", "data=2,fsdp=2,tensor=2"]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def devices_env(count: int) -> dict:
    # Compiling is most of these runs' time: XLA skips LLVM's optimisations, which change no result.
    flags = f"--xla_force_host_platform_device_count={count} --xla_backend_optimization_level=0"
    return {**OFFLINE_ENV, "XLA_FLAGS": flags}


def check_results(script: str, *arguments) -> dict:
    """The results a script of checks/ prints as its last line of JSON, run over 8 forced CPU devices."""
    command = [sys.executable, str(CHECKS_DIR / script), *arguments]
    # Its compiles on two busy cores took 8 minutes of wall time once: a limit well above that.
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=devices_env(8))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mesh_results():
    """checks/tensor_parallel_check.py's results: CLM (GPT-2 with dropout, and Llama) and MLM steps with remat and 2
    micro-batches, on one device and on each mesh of MESH_SHAPES over 8 devices (GPT-2 also on fsdp=8); and CLM steps
    with each other --optim (without remat or micro-batches) on one device and on data=2,fsdp=2,tensor=2."""
    return check_results("tensor_parallel_check.py", *MESH_SHAPES)


@pytest.mark.parametrize(
    "script, mesh_shape",
    [(script, mesh) for script in ("clm", "llama", "mlm") for mesh in MESH_SHAPES]
    + [("gemma", "tensor=8"), ("olmo2", "tensor=8")]  # the other decoders: where their heads are split
    + [("mixtral", "fsdp=2,expert=2,tensor=2")],  # a mixture of experts: its experts split over devices
)
def test_every_mix_of_data_fsdp_and_tensor_trains_as_one_device(mesh_results, script, mesh_shape):
    one_device, mesh = mesh_results[script]["one device"], mesh_results[script][mesh_shape]
    np.testing.assert_allclose(mesh["losses"], one_device["losses"], rtol=1e-5)
    assert mesh["largest_weight_difference"] < 1e-5
    if script == "mixtral":  # a device holds half the experts, halved by fsdp and by tensor
        experts = {path: share for path, share in mesh["shares"].items() if "/experts/" in path}
        assert len(experts) == 3 and set(experts.values()) == {1 / 8}  # the one layer's three matrices


@pytest.mark.parametrize("optim", ["muon", "adafactor"])
def test_each_optimizer_trains_on_a_mesh_as_on_one_device_with_its_state_split_like_the_parameters(
    mesh_results, optim
):
    results = mesh_results[f"clm {optim}"]
    one_device, mesh = results["one device"], results["data=2,fsdp=2,tensor=2"]
    np.testing.assert_allclose(mesh["losses"], one_device["losses"], rtol=1e-5)
    assert mesh["largest_weight_difference"] < 1e-5  # but the keys' bias: see tensor_parallel_check.without_key_bias
    # Split over fsdp and tensor, four ways, as AdamW's is: a replicated state would leave each device all of it.
    adamw_share = mesh_results["clm"]["data=2,fsdp=2,tensor=2"]["state_share"]
    assert mesh["state_share"] == pytest.approx(adamw_share, abs=0.02) and adamw_share < 0.3


def test_fsdp_divides_the_state_over_devices_and_keeps_the_losses(mesh_results):
    one_device, fsdp = mesh_results["clm"]["one device"], mesh_results["clm"]["fsdp=8"]
    np.testing.assert_allclose(fsdp["losses"], one_device["losses"], rtol=1e-5)
    assert fsdp["largest_weight_difference"] < 1e-5
    # Biases are left whole (they are tiny), so a device holds a little more than an eighth of the parameters and
    # the optimizer state.
    assert fsdp["bytes_share"] < 1 / (0.9 * 8), fsdp["bytes_share"]


# The matrices every decoder of common.py splits (Llama's, Gemma's, OLMo 2's).
LLAMA_SPLIT = (
    "q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "o_proj/kernel", "gate_proj/kernel", "up_proj/kernel",
    "down_proj/kernel", "embed_tokens/embedding",
)  # fmt: skip


@pytest.mark.parametrize("script", ["clm", "llama", "gemma", "olmo2", "mlm"])
def test_a_tensor_axis_of_eight_leaves_each_device_an_eighth_of_every_split_matrix(mesh_results, script):
    shares = mesh_results[script]["tensor=8"]["shares"]
    split = {
        "clm": ("attn/c_attn/kernel", "attn/c_proj/kernel", "mlp/c_fc/kernel", "mlp/c_proj/kernel", "wte/embedding"),
        "mlm": (
            "self/query/kernel", "self/key/kernel", "self/value/kernel", "attention/output/dense/kernel",
            "intermediate/dense/kernel", "layer_0/output/dense/kernel", "word_embeddings/embedding",
        ),
    }.get(script, LLAMA_SPLIT)  # fmt: skip
    matrices = {name: share for name, share in shares.items() if name.endswith(split)}
    assert len(matrices) >= len(split)
    assert set(matrices.values()) == {1 / 8}, matrices


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer and a GPT-2 of one layer and 4 heads, which tensor=4 splits."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("tensor-model"), n_layer=1, n_head=4)


def arguments(model_dir, output_dir, *extra):
    # Dropout is on (the config's default 0.1): a resumed run on another mesh must draw the same masks.
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", str(CORPUS / "train.txt"), "--do_train", "--block_size", "32",
        "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--seed", "0", "--sample_tokens", "0",
        "--max_steps", "6", "--logging_steps", "1", *extra,
    ]  # fmt: skip


def resume_copy(run_dir, new_dir, newest_kept: int):
    """A copy of `run_dir` as if stopped right after its checkpoint of step `newest_kept` was written."""
    shutil.copytree(run_dir, new_dir)
    for step in os.listdir(new_dir / "checkpoints"):
        if int(step) > newest_kept:
            shutil.rmtree(new_dir / "checkpoints" / step)
    shutil.rmtree(new_dir / "tensorboard")
    (new_dir / "model.safetensors").unlink()


def assert_continues_like(resumed_dir, uninterrupted_dir, first_step: int):
    losses, expected = dict(scalars(resumed_dir, "train/loss")), dict(scalars(uninterrupted_dir, "train/loss"))
    assert sorted(losses) == list(range(first_step, 7))
    np.testing.assert_allclose([losses[step] for step in losses], [expected[step] for step in losses], rtol=1e-5)
    final, reference = (
        load_file(str(resumed_dir / "model.safetensors")),
        load_file(str(uninterrupted_dir / "model.safetensors")),
    )
    for name in reference:
        np.testing.assert_allclose(final[name], reference[name], atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """A run of 6 steps on data=8 that saved checkpoints at steps 3 and 6: the reference of the resumed runs, and the
    trained model that generation splits."""
    output_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_script(arguments(model_dir, output_dir, "--save_steps", "3"), env=devices_env(8))
    return output_dir


def test_one_device_trains_the_batch_of_eight_data_parallel_devices_to_the_same_losses_and_weights(
    model_dir, uninterrupted, tmp_path, monkeypatch
):
    """The uninterrupted run's 8 rows a step, one on each device of data=8, all on the one device of this process:
    the script's batches and dropout masks do not depend on the devices."""
    one_device = tmp_path / "one-device"
    command_line = arguments(model_dir, one_device)
    command_line[command_line.index("--per_device_train_batch_size") + 1] = "8"
    monkeypatch.setattr(sys, "argv", ["run_clm_flax.py", *command_line])
    run_clm_flax.main()
    assert_continues_like(one_device, uninterrupted, first_step=1)


def test_checkpoints_move_between_data_and_tensor_parallel_meshes(model_dir, uninterrupted, tmp_path):
    """A run on data=8 saved at step 3 resumes on data=2,tensor=4; that run's step-4 checkpoint resumes on data=8;
    both end with the losses and weights of the uninterrupted data=8 run."""
    on_tensor = tmp_path / "on-tensor"
    resume_copy(uninterrupted, on_tensor, newest_kept=3)
    result = run_script(
        arguments(
            model_dir, on_tensor, "--save_steps", "2", "--resume_from_checkpoint", "--mesh_shape", "data=2,tensor=4"
        ),
        env=devices_env(8),
    )
    assert "at step 3" in result.stderr and "'tensor': 4" in result.stderr
    assert_continues_like(on_tensor, uninterrupted, first_step=4)

    back_on_data = tmp_path / "back-on-data"
    resume_copy(on_tensor, back_on_data, newest_kept=4)
    result = run_script(arguments(model_dir, back_on_data, "--resume_from_checkpoint"), env=devices_env(8))
    assert "at step 4" in result.stderr and "'tensor': 1" in result.stderr
    assert_continues_like(back_on_data, uninterrupted, first_step=5)


def test_greedy_generation_split_over_four_devices_gives_the_ids_of_one(uninterrupted):
    command = [
        sys.executable, str(REPO_DIR / "generate_flax.py"), "--model_name_or_path", str(uninterrupted),
        "--json_output", "--max_new_tokens", "12", "--prompt", "The", "--prompt", "It was a long", "--prompt", "",
    ]  # fmt: skip
    texts = {}
    for name, extra, env in (("one", [], OFFLINE_ENV), ("tensor=4", ["--mesh_shape", "tensor=4"], devices_env(4))):
        result = subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        texts[name] = [json.loads(line) for line in result.stdout.splitlines()]
    assert "'tensor': 4" in result.stderr
    assert len(texts["one"]) == 3 and all(row["new_tokens"] > 0 for row in texts["one"])
    assert texts["tensor=4"] == texts["one"]


def test_generation_on_a_mesh_with_rows_split_is_refused(model_dir, tmp_path):
    command = [sys.executable, str(REPO_DIR / "generate_flax.py"), "--model_name_or_path", model_dir]
    result = subprocess.run(
        [*command, "--prompt", "The", "--mesh_shape", "data=2,tensor=2"],
        capture_output=True,
        text=True,
        env=devices_env(4),
        timeout=300,
    )
    assert result.returncode == 2
    assert last_line(result.stderr).endswith(
        "generation splits the model over the tensor and expert axes alone; give tensor=4 (all devices), or for a "
        "mixture of experts tensor and expert sizes that multiply to it, or make fewer devices visible"
    )


def test_the_training_script_refuses_a_tensor_size_before_any_work(model_dir, tmp_path):
    result = run_script(
        arguments(model_dir, tmp_path / "out", "--mesh_shape", "tensor=8"), env=devices_env(8), check=False
    )
    assert result.returncode == 2
    assert last_line(result.stderr).endswith(
        "--mesh_shape tensor=8 does not divide the attention heads (n_head) 4: choose a tensor size that divides "
        "it, or change the config"
    )
    assert not (tmp_path / "out").exists()
