"""Multi-process training: two processes of four CPU devices each train exactly as one process of eight.

The runs share one machine: the processes find each other through a coordinator on 127.0.0.1, as
hosts of a cluster do through process 0's address. The two-process run is stopped by a signal to
process 1 alone and resumed from the checkpoint both processes wrote, on a mesh whose tensor axis spans both
processes (tensor=8, where the stopped run had data=8), so the comparison with the single-process run also covers
the stop agreement, the collective checkpoint, its move to another mesh, tensor parallelism across processes
(training, evaluation, sampling and export) and the resume.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FIXTURES_DIR, REPO_DIR
from safetensors.numpy import load_file
from test_clm import OFFLINE_ENV, model_dir_with_config, run_clm_flax, scalars
from test_harness import write_local_tasks
from test_resume import losses_per_process

from flax_lm.command_line.arguments import DistributedArguments
from flax_lm.devices import mesh, processes
from flax_lm.errors import UsageError

CORPUS = FIXTURES_DIR / "en"
MAX_STEPS = 10
RUN_TIMEOUT_SECONDS = 300


@pytest.fixture(scope="module")
def model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """The 1000-token test tokenizer and a one-layer GPT-2 of 8 heads, which tensor=8 splits. Dropout stays on: the
    runs then agree only if the global batch is the same row for row, and every mask the same, whatever the number
    of processes and the mesh."""
    return model_dir_with_config(gpt2_tokenizer_dir, tmp_path_factory.mktemp("distributed-model"), n_layer=1, n_head=8)


def arguments(model_dir, output_dir, *extra):
    # A global batch of 16 (2 per device on 8 devices); 37 evaluation blocks leave the last batch padded.
    return [
        "--output_dir", str(output_dir), "--config_name", model_dir, "--tokenizer_name", model_dir,
        "--train_file", str(CORPUS / "train.txt"), "--validation_file", str(CORPUS / "validation.txt"),
        "--max_eval_samples", "37", "--do_train", "--do_eval", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--learning_rate", "1e-3",
        "--seed", "0", "--max_steps", str(MAX_STEPS), "--logging_steps", "1", "--eval_steps", "5",
        "--save_steps", "1000", "--sample_tokens", "0", *extra,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(devices_per_process: int, hf_home, compilation_cache) -> dict:
    # Compiling is most of these runs' time: XLA skips LLVM's optimisations (half the compile time; every run
    # compiles alike), and the resumed run finds the stopped run's programs in the cache.
    return {
        **OFFLINE_ENV, "HF_HOME": str(hf_home), "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": (
            f"--xla_force_host_platform_device_count={devices_per_process} --xla_backend_optimization_level=0"
        ),
        "JAX_COMPILATION_CACHE_DIR": str(compilation_cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }  # fmt: skip


class Processes:
    """The processes of one run, each with its output in log files (read back on failure)."""

    def __init__(
        self, argument_list, num_processes: int, devices_per_process: int, log_dir, cache_dir, script="run_clm_flax.py"
    ):
        coordinator = ["--coordinator_address", f"127.0.0.1:{free_port()}", "--num_processes", str(num_processes)]
        self.logs, self.processes = [], []
        for process_id in range(num_processes):
            distributed = [*coordinator, "--process_id", str(process_id)] if num_processes > 1 else []
            stdout, stderr = (log_dir / f"process{process_id}.{stream}" for stream in ("out", "err"))
            self.logs.append((stdout, stderr))
            with open(stdout, "w") as out, open(stderr, "w") as err:
                self.processes.append(subprocess.Popen(
                    [sys.executable, str(REPO_DIR / script), *argument_list, *distributed],
                    env=environment(devices_per_process, cache_dir / "hf_home", cache_dir / "jax"), stdout=out,
                    stderr=err, cwd=REPO_DIR,
                ))  # fmt: skip

    def stdout(self, process_id: int) -> str:
        return self.logs[process_id][0].read_text()

    def stderr(self, process_id: int) -> str:
        return self.logs[process_id][1].read_text()

    def report(self) -> str:
        return "\n".join(
            f"--- process {index} (exit {process.poll()}) stderr:\n{self.stderr(index)[-3000:]}"
            for index, process in enumerate(self.processes)
        )

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    def wait_until(self, condition, what: str):
        deadline = time.time() + RUN_TIMEOUT_SECONDS
        while not condition():
            if time.time() > deadline or any(process.poll() is not None for process in self.processes):
                self.kill()
                pytest.fail(f"the run ended or timed out before {what}\n{self.report()}")
            time.sleep(0.005)

    def wait(self):
        """Wait for every process to exit 0; on a failure or a timeout kill them all and show their logs."""
        deadline = time.time() + RUN_TIMEOUT_SECONDS
        try:
            for process in self.processes:
                process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run did not finish within {RUN_TIMEOUT_SECONDS} s\n{self.report()}")
        if any(process.returncode != 0 for process in self.processes):
            self.kill()
            pytest.fail(f"a process failed\n{self.report()}")
        return self


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """One process of 8 devices trained to the end; meanwhile two processes of 4 devices, stopped by a
    signal to process 1, then resumed to the end. The two-process runs share one data cache and one
    compilation cache, as hosts share a disk."""
    logs = {name: tmp_path_factory.mktemp(name) for name in ("single", "stopped", "resumed")}
    caches = {name: tmp_path_factory.mktemp(f"{name}-caches") for name in ("single", "two")}
    single_dir, two_dir = tmp_path_factory.mktemp("single-output"), tmp_path_factory.mktemp("two-output")
    # lm-eval tasks scored at each evaluation of the finished runs: a multiple-choice one and a perplexity.
    tasks_dir = tmp_path_factory.mktemp("tasks")
    write_local_tasks(tasks_dir, model_dir)
    tasks = ["--eval_tasks", "tiny_choice,tiny_texts", "--eval_tasks_path", str(tasks_dir)]

    single = Processes(arguments(model_dir, single_dir, *tasks), 1, 8, logs["single"], caches["single"])
    stopped = Processes(arguments(model_dir, two_dir), 2, 4, logs["stopped"], caches["two"])
    try:
        # Process 0 logs step 1 once both processes have run it, so process 1 is in the training loop.
        stopped.wait_until(lambda: "step 1: loss" in stopped.stderr(0), "process 0 logged step 1")
        stopped.processes[1].send_signal(signal.SIGINT)
        stopped.wait()
        stopped_checkpoints = os.listdir(two_dir / "checkpoints")
        stopped_losses = losses_per_process(two_dir)[0]
        resumed_arguments = ["--resume_from_checkpoint", "--sample_tokens", "4", "--mesh_shape", "tensor=8", *tasks]
        resumed = Processes(
            arguments(model_dir, two_dir, *resumed_arguments), 2, 4, logs["resumed"], caches["two"]
        ).wait()
        single.wait()
    finally:
        single.kill()
    return {
        "single": single, "single_dir": single_dir, "stopped": stopped, "stopped_checkpoints": stopped_checkpoints,
        "stop_step": max(stopped_losses), "stopped_losses": stopped_losses, "resumed": resumed, "two_dir": two_dir,
    }  # fmt: skip


def test_a_signal_to_one_process_stops_every_process_at_the_same_step_with_a_checkpoint(runs):
    stop_step = runs["stop_step"]
    assert runs["stopped_checkpoints"] == [str(stop_step)]
    assert 1 <= stop_step < MAX_STEPS, "the signal should stop the run before its end"
    assert sorted(runs["stopped_losses"]) == list(range(1, stop_step + 1))
    stdout = runs["stopped"].stdout(0)
    assert f"Stopped by a signal to another process after step {stop_step}" in stdout
    assert "--resume_from_checkpoint" in stdout
    assert "Stopped by" not in runs["stopped"].stdout(1), "only process 0 reports"


def test_two_processes_log_the_same_losses_as_one(runs):
    single_losses = losses_per_process(runs["single_dir"])[0]
    # The stopped run's event file first, then the resumed run's.
    stopped_losses, resumed_losses = losses_per_process(runs["two_dir"])
    assert sorted(single_losses) == list(range(1, MAX_STEPS + 1))
    assert sorted(resumed_losses) == list(range(runs["stop_step"] + 1, MAX_STEPS + 1))
    two_process_losses = {**stopped_losses, **resumed_losses}
    assert sorted(two_process_losses) == sorted(single_losses)
    for step, loss in single_losses.items():
        assert two_process_losses[step] == pytest.approx(loss, rel=1e-5), f"step {step}"


def test_two_processes_export_the_same_weights_as_one(runs):
    single = load_file(str(runs["single_dir"] / "model.safetensors"))
    two = load_file(str(runs["two_dir"] / "model.safetensors"))
    assert single.keys() == two.keys()
    for name in single:
        np.testing.assert_allclose(two[name], single[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_two_processes_evaluate_the_same_as_one(runs):
    single = json.loads((runs["single_dir"] / "eval_results.json").read_text())
    two = json.loads((runs["two_dir"] / "eval_results.json").read_text())
    assert two["eval_tokens"] == single["eval_tokens"] == 37 * 31
    assert two["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


def test_two_processes_score_the_evaluation_tasks_as_one(runs):
    single = json.loads((runs["single_dir"] / "eval_results.json").read_text())
    two = json.loads((runs["two_dir"] / "eval_results.json").read_text())
    metrics = ["tiny_choice_acc", "tiny_choice_acc_norm", "tiny_texts_word_perplexity", "tiny_texts_bits_per_byte"]
    assert {f"eval_{metric}" for metric in metrics} <= single.keys()
    assert [two[f"eval_{metric}"] for metric in metrics] == pytest.approx(
        [single[f"eval_{metric}"] for metric in metrics], rel=1e-5
    )
    # Scored at each evaluation, not only at the end.
    assert [step for step, _ in scalars(runs["single_dir"], "eval/tiny_choice/acc")] == [5, MAX_STEPS]


def test_only_process_0_writes_results_logs_and_the_sample(runs):
    two_dir, resumed = runs["two_dir"], runs["resumed"]
    assert (two_dir / "train_results.json").is_file() and (two_dir / "config.json").is_file()
    assert len(os.listdir(two_dir / "tensorboard")) == 2, "one event file per run, from process 0"
    assert "sample from" in resumed.stdout(0) and "eval perplexity" in resumed.stdout(0)
    process_1_output = resumed.stdout(1)
    assert "sample from" not in process_1_output and "eval perplexity" not in process_1_output
    assert "INFO" not in resumed.stderr(1), "process 1 logs only errors"


# ----------------------------------------------------------------------------------------------------
# In the same process: when the distributed runtime is started, and how each process's rows are chosen
# ----------------------------------------------------------------------------------------------------

LAUNCHER_VARIABLES = ["SLURM_STEP_NODELIST", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"]


@pytest.fixture
def initialize_calls(monkeypatch):
    """The calls the script makes to jax.distributed.initialize, which is replaced by a recorder; no
    launcher in the environment and no Cloud TPU."""
    calls = []
    monkeypatch.setattr(processes.jax.distributed, "initialize", lambda **settings: calls.append(settings))
    monkeypatch.setattr(processes, "on_cloud_tpu_vm", lambda: False)
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return calls


def distributed_arguments(**settings):
    return DistributedArguments(**settings).process_group()


def test_a_single_process_never_starts_the_distributed_runtime(initialize_calls, monkeypatch):
    processes.initialize_distributed(distributed_arguments())
    # A Slurm batch script (no srun) with --ntasks 4 is still one process.
    monkeypatch.setenv("SLURM_NTASKS", "4")
    processes.initialize_distributed(distributed_arguments())
    # As is a run started by hand with --num_processes 1.
    processes.initialize_distributed(
        distributed_arguments(coordinator_address="10.0.0.1:1234", num_processes=1, process_id=0)
    )
    assert initialize_calls == []


def test_explicit_flags_start_the_distributed_runtime_with_them(initialize_calls):
    processes.initialize_distributed(
        distributed_arguments(
            coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, local_device_ids="0,1"
        )
    )
    assert initialize_calls == [
        dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, local_device_ids=[0, 1])
    ]


@pytest.mark.parametrize(
    "launcher_environment",
    [{"SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "16"}, {"OMPI_COMM_WORLD_SIZE": "8"}],
    ids=["srun", "mpirun"],
)
def test_tasks_of_a_launcher_leave_the_settings_to_jax(initialize_calls, monkeypatch, launcher_environment):
    for name, value in launcher_environment.items():
        monkeypatch.setenv(name, value)
    processes.initialize_distributed(distributed_arguments())
    assert initialize_calls == [
        dict(coordinator_address=None, num_processes=None, process_id=None, local_device_ids=None)
    ]


def test_a_launcher_jax_cannot_read_asks_for_the_flags(initialize_calls, monkeypatch):
    def undetected(**settings):  # what jax.distributed.initialize raises when it finds no coordinator
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(processes.jax.distributed, "initialize", undetected)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="Open MPI started this process.*pass --coordinator_address"):
        processes.initialize_distributed(distributed_arguments())


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(coordinator_address="10.0.0.1:1234"), "go together"),
        (dict(num_processes=2, process_id=0), "go together"),
        (dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=2), "--process_id 2 is not in 0..1"),
        (dict(coordinator_address="10.0.0.1", num_processes=2, process_id=0), "has no port"),
        (dict(local_device_ids="0,1"), "applies to multi-process runs"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=0, local_device_ids="0;1"), "comma-separated"),
    ],
)
def test_inconsistent_distributed_flags_are_refused(initialize_calls, settings, message):
    with pytest.raises(UsageError, match=message):
        processes.initialize_distributed(distributed_arguments(**settings))
    assert initialize_calls == []


def test_the_processes_rows_make_up_the_single_process_batch(monkeypatch):
    blocks = np.arange(40 * 2).reshape(40, 2)
    single = [batch["input_ids"] for batch in run_clm_flax.train_batches(blocks, 8, seed=1, epoch=0)]
    monkeypatch.setattr(mesh.jax, "process_count", lambda: 2)
    per_process = []
    for process_index in range(2):
        monkeypatch.setattr(mesh.jax, "process_index", lambda index=process_index: index)
        per_process.append([batch["input_ids"] for batch in run_clm_flax.train_batches(blocks, 8, seed=1, epoch=0)])
    for step, batch in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([per_process[0][step], per_process[1][step]]), batch)
