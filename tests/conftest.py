"""Shared test helpers: run a script of the repository offline, small tokenizers trained on the test corpus, and a
tiny GPT-2 with the Generator that generate_flax.py decodes it with, and its server in a process of its own."""

import contextlib
import os
import queue
import resource
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flax_lm.models import stock_module
from flax_lm.models.huggingface import ModelLoading
from flax_lm.models.model_code import ModelCode, load_model_code

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
FIXTURES_DIR = TESTS_DIR / "fixtures"
# The scripts the tests run or import that are no tests (tensor_parallel_check.py, read_with_transformers.py ...).
CHECKS_DIR = REPO_DIR / "checks"
# The multilingual corpus (English, Norwegian, Turkish, Korean) plus about 110 KB of English prose.
TOKENIZER_TRAINING_FILES = sorted((FIXTURES_DIR / "corpus").glob("*.txt")) + [FIXTURES_DIR / "en" / "train.txt"]


# The tests in three tiers: tests/unit, in-process and fast (`python -m pytest tests/unit` while editing);
# tests/parity, our models against transformers' PyTorch models and `generate` (logits on every route, decoding, the
# probe of an export); and tests/end_to_end, the scripts run as users run them, the server, parity across routes,
# several processes. A test module imports
# another's helpers by its name (test_clm's tiny configs, say) whichever tier it is in and whichever tier pytest runs,
# and a script or a check by its name.
TIERS = ("unit", "parity", "end_to_end")
for directory in [TESTS_DIR / tier for tier in TIERS] + [CHECKS_DIR, REPO_DIR]:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))

# A user's environment, made from requirements.txt, has no PyTorch; this one has it (the parity tests' reference), and
# transformers imports it whenever it is installed: four fifths of a script's start-up, in CPU time. So the scripts
# the tests start run as in a user's environment, PyTorch hidden, unless a test needs it there (lm-eval's model, the
# probe of an edited model file).
WITHOUT_TORCH_DIR = FIXTURES_DIR / "without_torch"


def script_environment(torch: bool = False, **variables) -> dict:
    """This process's environment, offline, for a script the tests start: PyTorch hidden unless `torch`
    (tests/fixtures/without_torch/sitecustomize.py), and `variables` besides."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **variables}
    if not torch:
        paths = [str(WITHOUT_TORCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


# The files that run longest, started first: with `--dist loadfile` a worker takes a whole file, and a long file begun
# last (the alphabet puts test_tensor_parallel.py near the end) keeps one worker busy after the other has finished.
# Paths below tests/.
LONGEST_FILES_FIRST = [
    "end_to_end/test_tensor_parallel.py", "end_to_end/test_mlm.py", "end_to_end/test_edited_copies.py",
    "parity/test_models.py", "end_to_end/test_run_safety.py", "parity/test_moe.py",
    "end_to_end/test_gpu_suite_runs.py", "end_to_end/test_distributed.py", "parity/test_generate.py",
    "end_to_end/test_resume.py", "end_to_end/test_serve.py", "end_to_end/test_finetune.py",
    "end_to_end/test_mlm_scale.py", "end_to_end/test_steps_per_call.py", "end_to_end/test_clm_runs.py",
    "end_to_end/test_lora_runs.py", "unit/test_scaling.py", "end_to_end/test_grpo_runs.py",
    "end_to_end/test_dpo_runs.py", "end_to_end/test_generate_runs.py", "end_to_end/test_harness.py",
    "parity/test_t5.py", "parity/test_grpo_parity.py", "end_to_end/test_published_checkpoints.py",
    "end_to_end/test_expert_parallel.py", "parity/test_clm_parity.py", "end_to_end/test_pipeline.py",
    "parity/test_deepseek.py", "parity/test_lora_parity.py", "parity/test_dpo_parity.py", "end_to_end/test_t5_runs.py",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.relative_to(TESTS_DIR).as_posix()
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: the other files keep their order, and every file its tests' order


def pytest_configure(config):
    # pytest-xdist hands out the files of --dist loadfile by their number of tests, most first, unless told to keep
    # the order of the collection: the order above, without which a long file of few tests starts last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# --cpu-durations=N: the CPU seconds each test costs, user and system, of the test process and of the scripts it
# started and waited for, from its set-up to its teardown (a session fixture counts in the first test that asks for
# it). Wall times say little on a shared machine; CPU seconds are what the suite costs on two cores whatever the load.
def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests and the N files that take the most CPU seconds (0: all), with the suite's total",
    )


def cpu_seconds() -> float:
    """CPU seconds, user and system, of this process and of its children that have been waited for."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


CPU_SECONDS_AT = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[CPU_SECONDS_AT] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds to each phase's report the CPU seconds since the end of the phase before (its start, for set-up): the
    reports travel from pytest-xdist's workers to the process that prints the summary."""
    report = (yield).get_result()
    now = cpu_seconds()
    report.user_properties.append(("cpu_seconds", now - item.stash.get(CPU_SECONDS_AT, now)))
    item.stash[CPU_SECONDS_AT] = now


CPU_SECONDS_BY_TEST = defaultdict(float)


def pytest_runtest_logreport(report):
    CPU_SECONDS_BY_TEST[report.nodeid] += sum(value for name, value in report.user_properties if name == "cpu_seconds")


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("cpu_durations")
    if count is None or not CPU_SECONDS_BY_TEST:
        return
    by_file = defaultdict(float)
    for nodeid, seconds in CPU_SECONDS_BY_TEST.items():
        by_file[nodeid.split("::")[0]] += seconds
    for title, table in [("tests", CPU_SECONDS_BY_TEST), ("files", by_file)]:
        ranked = sorted(table.items(), key=lambda pair: pair[1], reverse=True)
        terminalreporter.write_sep("=", f"CPU seconds of the {title}, most first")
        for name, seconds in ranked[: count or None]:
            terminalreporter.write_line(f"{seconds:8.1f}s {name}")
    terminalreporter.write_line(f"{sum(CPU_SECONDS_BY_TEST.values()):8.1f}s in all, {len(CPU_SECONDS_BY_TEST)} tests")


def stock_code(config) -> ModelCode:
    """The code of `config`'s model as flax_lm ships it, loaded as the tools load it (save_model takes it)."""
    module = stock_module(config.model_type)
    encoder_decoder = getattr(module, "ENCODER_DECODER", False)
    return load_model_code(config, None, module.GENERATES_TEXT, "the tests", encoder_decoder=encoder_decoder)


@pytest.fixture(scope="session")
def run_tool(tmp_path_factory):
    """Run a script of the repository in a fresh Python process, offline; returns the CompletedProcess."""
    hf_home = tmp_path_factory.mktemp("hf_home")

    def run(script, *args, cwd=None):
        env = script_environment(HF_HOME=str(hf_home))
        command = [sys.executable, str(REPO_DIR / script), *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)

    return run


@pytest.fixture(scope="session")
def test_tokenizer_dirs(run_tool, tmp_path_factory):
    """A GPT-2, a Llama and a RoBERTa tokenizer of 1000 tokens with model_max_length 256, trained side by side."""
    output_dirs = {
        model_type: tmp_path_factory.mktemp(f"{model_type}_tokenizer") for model_type in ["gpt2", "llama", "roberta"]
    }

    def train(model_type):
        return run_tool(
            "train_tokenizer.py",
            "--train_file", *TOKENIZER_TRAINING_FILES,
            "--model_type", model_type,
            "--vocab_size", 1000,
            "--model_max_length", 256,
            "--output_dir", output_dirs[model_type],
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=len(output_dirs)) as pool:
        results = dict(zip(output_dirs, pool.map(train, output_dirs)))
    for result in results.values():
        assert result.returncode == 0, result.stderr
    return output_dirs


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(test_tokenizer_dirs):
    """The GPT-2 test tokenizer. Shared by all tests: copy it before writing into it."""
    return test_tokenizer_dirs["gpt2"]


@pytest.fixture(scope="session")
def llama_tokenizer_dir(test_tokenizer_dirs):
    """The Llama test tokenizer (BOS before each text). Shared by all tests: copy it before writing into it."""
    return test_tokenizer_dirs["llama"]


@pytest.fixture(scope="session")
def roberta_tokenizer_dir(test_tokenizer_dirs):
    """The RoBERTa test tokenizer. Shared by all tests: copy it before writing into it."""
    return test_tokenizer_dirs["roberta"]


@pytest.fixture(scope="session")
def tiny_gpt2_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """A tiny random GPT-2 saved by transformers (safetensors) beside the test tokenizer. Its weights are drawn
    wider than GPT-2's usual 0.02, so that greedy decoding wanders instead of repeating one token."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    directory = shutil.copytree(gpt2_tokenizer_dir, tmp_path_factory.mktemp("generate") / "tiny-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        initializer_range=0.3,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def generator(tiny_gpt2_dir):
    """generate_flax.py's Generator of the tiny GPT-2, 4 prompts to a batch."""
    sys.path.insert(0, str(REPO_DIR))
    import generate_flax

    model, params, tokenizer = generate_flax.load_model(ModelLoading(str(tiny_gpt2_dir)))
    return generate_flax.Generator(model, params, tokenizer, batch_size=4)


@contextlib.contextmanager
def server_process(model_dir, log_path, *arguments):
    """generate_flax.py --serve of `model_dir` on a free port of 127.0.0.1, offline, in a process of its own, with
    `arguments` besides: (the process, its URL, its log file). Killed at the end if it still runs."""
    log = open(log_path, "w+")  # a file, not a pipe: a full pipe would block the server
    command = [sys.executable, str(REPO_DIR / "generate_flax.py"), "--model_name_or_path", str(model_dir), "--serve"]
    environment = script_environment(TOKENIZERS_PARALLELISM="false")
    server = subprocess.Popen(
        [*command, "--port", "0", *map(str, arguments)], stdout=subprocess.PIPE, stderr=log, text=True, env=environment
    )
    try:
        lines = queue.Queue()

        def read_output():
            for line in server.stdout:
                lines.put(line)
            lines.put("(the server exited)")

        threading.Thread(target=read_output, daemon=True).start()
        first_line = lines.get(timeout=180)
        log.seek(0)
        assert "Serving" in first_line, log.read()[-3000:]
        yield server, first_line.split()[-1], log
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        log.close()


TRANSFORMERS_4_VERSION = "4.57.6"


@pytest.fixture(scope="session")
def transformers_4_python():
    """The Python of an environment with transformers 4.57 (and the PyTorch of this one), where the exports must read
    as well as in transformers 5: made once with pip under the user's cache directory, and reused. A test that needs it
    fails, with pip's words, where it cannot be made."""
    import filelock
    import torch

    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flax_lm-tests"
    environment = cache_dir / f"transformers-{TRANSFORMERS_4_VERSION}"
    made = environment / "made"  # written last: an environment without it was interrupted and is made again
    cache_dir.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{environment}.lock"):
        if not made.exists():
            shutil.rmtree(environment, ignore_errors=True)
            torch_version = torch.__version__.split("+")[0]
            packages = [
                f"transformers=={TRANSFORMERS_4_VERSION}",
                "tokenizers",
                "safetensors",
                f"torch=={torch_version}",
            ]
            for command in [
                [sys.executable, "-m", "venv", str(environment)],
                [str(environment / "bin" / "python"), "-m", "pip", "install", "--quiet", *packages],
            ]:
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    pytest.fail(f"cannot make the transformers {TRANSFORMERS_4_VERSION} environment: {result.stderr}")
            made.touch()
    return environment / "bin" / "python"


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    """W&B offline and MLflow in a file store, both under tmp_path."""
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        # MLflow refuses a file store unless told: it would rather have a database or a server.
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def gpt2_model_dir(gpt2_tokenizer_dir, tmp_path):
    """A copy of the GPT-2 test tokenizer, to write a config beside."""
    return Path(shutil.copytree(gpt2_tokenizer_dir, tmp_path / "model"))


@pytest.fixture
def roberta_model_dir(roberta_tokenizer_dir, tmp_path):
    """A copy of the RoBERTa test tokenizer, to write a config beside."""
    return Path(shutil.copytree(roberta_tokenizer_dir, tmp_path / "model"))
