"""Every third-party module the code imports is declared: the package's and the scripts' imports in pyproject.toml
(its dependencies, or an optional extra where one flag needs it), the benchmarks' there or in requirements-test.txt.
An undeclared import works wherever something else happened to install it, and fails on a user's fresh machine;
checks/fresh_environment_check.py proves the other half, that the declared dependencies alone run the README's
commands.
"""

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import CHECKS_DIR, REPO_DIR

PACKAGE_AND_SCRIPTS = sorted(REPO_DIR.glob("flax_lm/**/*.py")) + sorted(REPO_DIR.glob("*.py"))
BENCHMARKS = sorted(REPO_DIR.glob("benchmarks/**/*.py"))  # the PyTorch peers of benchmarks/peers/ too
# The project's own modules: the package, and the scripts and benchmarks that import one another.
PROJECT_MODULES = {"flax_lm"} | {path.stem for path in REPO_DIR.glob("*.py")} | {path.stem for path in BENCHMARKS}


def normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a requirement line names: "lm_eval[api,hf]==0.4.13" -> "lm-eval"."""
    return normalized(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((REPO_DIR / "pyproject.toml").read_text())["project"]
    extras = [requirement for group in project.get("optional-dependencies", {}).values() for requirement in group]
    return {requirement_name(requirement) for requirement in project["dependencies"] + extras}


def requirements_of_the_tests() -> set[str]:
    lines = (REPO_DIR / "requirements-test.txt").read_text().splitlines()
    return {requirement_name(line) for line in lines if line.strip() and not line.lstrip().startswith(("#", "-"))}


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the modules a file imports absolutely, less the standard library and the project."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names - set(sys.stdlib_module_names) - PROJECT_MODULES


@functools.cache
def module_providers() -> dict[str, set[str]]:
    """The distributions that provide each importable top-level module (the test environment installs every
    requirement, so every declared distribution is there to be asked)."""
    return {
        module: {normalized(distribution) for distribution in distributions}
        for module, distributions in importlib.metadata.packages_distributions().items()
    }


def undeclared_imports(path: Path, declared: set[str]) -> list[str]:
    """ "FILE imports MODULE (its distribution)" for each import that no declared distribution provides."""
    found = []
    for module in sorted(third_party_imports(path)):
        distributions = module_providers().get(module, set())
        if not distributions & declared:
            provided_by = ", ".join(sorted(distributions)) or "no installed distribution"
            name = path.relative_to(REPO_DIR) if path.is_relative_to(REPO_DIR) else path.name
            found.append(f"{name} imports {module} ({provided_by}), which is not declared")
    return found


def test_the_import_scan_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "import os, numpy as np\nimport jax.numpy\nfrom yaml import safe_load\nfrom . import sibling\n"
        "import flax_lm.errors\nimport run_clm_flax\n\ndef later():\n    import jinja2\n"
    )
    assert third_party_imports(source) == {"numpy", "jax", "yaml", "jinja2"}


def test_an_undeclared_import_is_named(tmp_path):
    source = tmp_path / "uses_jinja.py"
    source.write_text("import jinja2\nimport numpy\n")
    assert undeclared_imports(source, pyproject_requirements()) == []
    assert undeclared_imports(source, pyproject_requirements() - {"jinja2"}) == [
        "uses_jinja.py imports jinja2 (jinja2), which is not declared"
    ]


@pytest.mark.parametrize("path", PACKAGE_AND_SCRIPTS, ids=lambda path: str(path.relative_to(REPO_DIR)))
def test_the_package_and_scripts_import_only_declared_dependencies(path):
    found = undeclared_imports(path, pyproject_requirements())
    assert not found, "; ".join(found) + ": add it to pyproject.toml's dependencies (or an optional extra)"


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda path: str(path.relative_to(REPO_DIR)))
def test_the_benchmarks_import_only_declared_dependencies(path):
    found = undeclared_imports(path, pyproject_requirements() | requirements_of_the_tests())
    assert not found, "; ".join(found) + ": add it to pyproject.toml or requirements-test.txt"


def test_the_fresh_environment_check_refuses_an_environment_with_the_test_requirements(monkeypatch):
    """It proves something only where requirements.txt alone was installed: here, among the test requirements, it
    stops in one line saying where to run it, before any check."""
    spec = importlib.util.spec_from_file_location("fresh_environment_check", CHECKS_DIR / "fresh_environment_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(sys, "argv", ["fresh_environment_check.py"])
    with pytest.raises(SystemExit) as stopped:
        check.main()
    message = str(stopped.value.code)
    assert message.startswith("error: pytest, torch installed here") and "requirements.txt alone" in message, message
