#!/usr/bin/env python3
"""The README's first command on a machine that has only what requirements.txt installs.

The test environment holds more (PyTorch, lm-eval, the trackers, and whatever they pull in), so a module that imports
an undeclared library passes the tests and fails for a new user. Run this in a virtual environment made from
requirements.txt alone; it checks that every module of flax_lm imports, that every script of the repository and of
benchmarks/ answers --help, and that quickstart.sh trains (its default mode, or those named):

    python3 -m venv /tmp/fresh && /tmp/fresh/bin/pip install -r requirements.txt
    /tmp/fresh/bin/python checks/fresh_environment_check.py [--quickstart_modes clm llama mlm chat]

.ci/run runs it before it installs the test requirements. It needs no network. Not a pytest module: pytest would run
it in the test environment, where it proves nothing.
"""

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
# The files run as programs (a module the benchmarks share, without a main, answers nothing).
SCRIPTS = [
    path
    for path in sorted(REPO_DIR.glob("*.py")) + sorted((REPO_DIR / "benchmarks").glob("*.py"))
    if 'if __name__ == "__main__":' in path.read_text()
]
# Only the test requirements install these: finding one means this is not an environment of requirements.txt alone.
TEST_ONLY_MODULES = ("pytest", "torch")
QUICKSTART_MODES = ("clm", "llama", "mlm", "chat")
# The directory each mode trains into, and a final eval result that shows the model learned: the bits per byte of the
# causal models (untrained, a uniform guess over 4,096 tokens: 12 bits a token of a few bytes; they end near 1.9), the
# loss of the masked one (untrained, about 9 nats, the logarithm of its 8,192 tokens; it ends near 6.6) and of the
# chat model (untrained, about 5.8, of its 320 tokens; it ends near 0.02).
QUICKSTART_RUNS = {
    "clm": ("gpt2-tiny-trained", "eval_bits_per_byte", 2.5),
    "llama": ("llama-tiny-trained", "eval_bits_per_byte", 2.5),
    "mlm": ("roberta-tiny-trained", "eval_loss", 7.5),
    "chat": ("gpt2-chat-trained", "eval_loss", 0.5),
}


def optional_modules() -> dict[str, str]:
    """The import name of each optional dependency (pyproject.toml's extras, as the installed package declares
    them), with the extra that installs it."""
    modules = {}
    for requirement in importlib.metadata.requires("flax-lm") or []:
        if extra := re.search(r"""extra == ["']([^"']+)["']""", requirement):
            distribution = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0)
            modules[re.sub(r"[-.]+", "_", distribution).lower()] = extra.group(1)
    return modules


def check_imports() -> list[str]:
    """Import every module of flax_lm, subpackages included; a failure names the module and what it lacked. A module
    that needs an optional dependency (lm-eval for --eval_tasks) is reported, not failed."""
    import flax_lm

    failures = []
    optional = optional_modules()
    modules = [module.name for module in pkgutil.walk_packages(flax_lm.__path__, "flax_lm.", onerror=failures.append)]
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            missing = (error.name or "").partition(".")[0]
            if missing in optional:
                print(f"  {name}: needs {missing}, of the optional extra '{optional[missing]}'")
            else:
                failures.append(f"{name} does not import: {error}")
        except Exception as error:  # any other failure at import is as fatal to a user
            failures.append(f"{name} does not import: {type(error).__name__}: {error}")
    print(f"imports: {len(modules) - len(failures)} of the {len(modules)} modules of flax_lm")
    return failures


def answers_help(script: Path, environment: dict) -> str | None:
    """None when `script --help` exits 0 with a usage; else what went wrong, with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, env=environment, timeout=300
    )
    if done.returncode == 0 and "usage" in done.stdout.lower():
        return None
    last_lines = " | ".join(done.stderr.strip().splitlines()[-3:])
    return f"{script.relative_to(REPO_DIR)} --help exited {done.returncode}: {last_lines or done.stdout[-300:]}"


def check_help(environment: dict) -> list[str]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        failures = [failure for failure in pool.map(lambda s: answers_help(s, environment), SCRIPTS) if failure]
    print(f"--help: {len(SCRIPTS) - len(failures)} of the {len(SCRIPTS)} scripts answer")
    return failures


def check_quickstart(mode: str, environment: dict) -> list[str]:
    with tempfile.TemporaryDirectory(prefix=f"quickstart-{mode}-") as work_dir:
        start = time.perf_counter()
        done = subprocess.run(
            [str(REPO_DIR / "quickstart.sh"), mode, work_dir], capture_output=True, text=True, env=environment
        )
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            output = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            return [
                f"./quickstart.sh {mode} exited {done.returncode} after {seconds:.0f} s; its last lines:\n{output}"
            ]
        run_dir, metric, ceiling = QUICKSTART_RUNS[mode]
        results_path = Path(work_dir) / run_dir / "eval_results.json"
        if not results_path.exists():
            return [f"./quickstart.sh {mode} exited 0 but wrote no {run_dir}/eval_results.json"]
        value = json.loads(results_path.read_text())[metric]
        if not (math.isfinite(value) and value < ceiling):
            return [f"./quickstart.sh {mode} ended at {metric} {value}, not below {ceiling}: it did not learn"]
        print(f"./quickstart.sh {mode}: {seconds:.0f} s, {metric} {value:.4f}")
        return []


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quickstart_modes",
        nargs="*",
        choices=QUICKSTART_MODES,
        default=["clm"],
        help="the quickstart.sh modes to run (default: clm, the README's command; none: no quickstart)",
    )
    arguments = parser.parse_args()
    test_only = [module for module in TEST_ONLY_MODULES if importlib.util.find_spec(module)]
    if test_only:
        raise SystemExit(
            f"error: {', '.join(test_only)} installed here: run this check in a virtual environment made from "
            "requirements.txt alone (python3 -m venv --clear /tmp/fresh && /tmp/fresh/bin/pip install -r "
            "requirements.txt), where it proves what a new user's first command meets"
        )
    # The scripts and quickstart.sh run from this environment, offline, as the README says they can.
    environment = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    environment["PATH"] = os.path.dirname(sys.executable) + os.pathsep + environment.get("PATH", "")
    environment.pop("PYTHONPATH", None)

    failures = check_imports() + check_help(environment)
    for mode in arguments.quickstart_modes:
        failures += check_quickstart(mode, environment)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    if failures:
        raise SystemExit(1)
    print("the README's commands work with requirements.txt alone")


if __name__ == "__main__":
    main()
