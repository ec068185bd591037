"""The package shows its parts: each subpackage says what it holds, and a script written for the flat layout of 0.3
stops at its first import of a moved module with one line naming the new one."""

import ast
import importlib
import os
import pkgutil

import pytest
from conftest import REPO_DIR

import flax_lm

REPO = str(REPO_DIR)


def subpackages():
    return [info.name for info in pkgutil.iter_modules(flax_lm.__path__) if info.ispkg]


@pytest.mark.parametrize("name", subpackages())
def test_each_subpackage_says_what_it_holds_and_is_in_the_package_map(name):
    package = importlib.import_module(f"flax_lm.{name}")
    assert package.__doc__ and len(package.__doc__.split()) > 10, f"flax_lm/{name}/__init__.py has no docstring"
    assert f"{name}/" in flax_lm.__doc__, f"flax_lm/__init__.py's map does not name {name}/"


def imported_subpackages(path: str) -> set[str]:
    """The subpackages of flax_lm (and errors) a module imports, anywhere in it (inside functions as well)."""
    with open(path) as file:
        tree = ast.parse(file.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        names.update(module.split(".")[1] for module in modules if module.startswith("flax_lm."))
    return names


def test_each_subpackage_imports_only_those_before_it_in_the_dependency_order():
    """No two subpackages import each other: each imports only errors.py and those before it in
    flax_lm.DEPENDENCY_ORDER, which lists every subpackage."""
    order = flax_lm.DEPENDENCY_ORDER
    assert sorted(order) == sorted(subpackages())
    package_dir = os.path.dirname(flax_lm.__file__)
    for position, name in enumerate(order):
        allowed = {name, "errors", *order[:position]}
        for directory, _, files in os.walk(os.path.join(package_dir, name)):
            for file_name in (file_name for file_name in files if file_name.endswith(".py")):
                path = os.path.join(directory, file_name)
                # flax_lm.moved_from_subpackage, of the package itself, is no subpackage.
                later = imported_subpackages(path) - allowed - {"moved_from_subpackage"}
                assert not later, f"{os.path.relpath(path, REPO)} imports {sorted(later)}, after {name} in the order"
    assert imported_subpackages(os.path.join(package_dir, "errors.py")) == set()


# Modules outside command_line/ whose functions still take the scripts' model arguments: the Hugging Face loading,
# which the model registry's own settings replace.
def test_no_function_outside_command_line_takes_a_whole_argument_object():
    """Each part of flax_lm receives the values it uses (its settings, filled from the flags by command_line/), so no
    function or method outside command_line/ has a parameter named like the tools' argument groups (training_args,
    model_args, data_args ...: *_args; a function's *args of any name aside)."""
    package_dir = os.path.dirname(flax_lm.__file__)
    taking = []
    for directory, _, files in os.walk(package_dir):
        for path in (os.path.join(directory, name) for name in files if name.endswith(".py")):
            relative = os.path.relpath(path, REPO)
            if relative.startswith("flax_lm/command_line/"):
                continue
            with open(path) as file:
                tree = ast.parse(file.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    arguments = node.args
                    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                    name = getattr(node, "name", "lambda")
                    taking += [f"{relative}: {name}({item.arg})" for item in parameters if item.arg.endswith("_args")]
    assert not taking, "; ".join(taking)


def test_every_moved_module_of_the_flat_layout_exists_where_its_refusal_sends_the_user():
    for old, new in flax_lm.MOVED_MODULES.items():
        assert importlib.util.find_spec(f"flax_lm.{new}") is not None, f"flax_lm.{old} is said to be flax_lm.{new}"
    for old, new in [*flax_lm.MODULES_NOW_SUBPACKAGES.items(), *flax_lm.RENAMED_MODULES.items()]:
        assert importlib.util.find_spec(f"flax_lm.{new}") is not None, f"flax_lm.{old} is said to be flax_lm.{new}"


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


def test_a_checkpoint_of_gpt2_code_that_ignored_a_block_option_the_config_sets_is_refused_naming_it():
    from test_clm import tiny_config

    from flax_lm.errors import UsageError
    from flax_lm.models.model_code import load_model_code
    from flax_lm.run.record import check_model_code

    before_the_options, with_the_options = "37d74b0550392686", "29b9bcfd3633837a"
    config = tiny_config()
    config.qk_norm, config.final_logit_softcapping = True, 30.0
    model_code = load_model_code(config, None, True, "run_clm_flax.py", exports=False)
    assert model_code.computes_as(with_the_options) and not model_code.computes_as(before_the_options)
    record = {"model_code": {"file": "flax_lm/models/gpt2.py", "fingerprint": before_the_options}}
    with pytest.raises(UsageError, match="read nothing of final_logit_softcapping, qk_norm, which the config sets"):
        check_model_code(model_code, record)
    check_model_code(model_code, {"model_code": {**record["model_code"], "fingerprint": with_the_options}})
    # Without the options, the earlier code computed the model as today's.
    assert load_model_code(tiny_config(), None, True, "run_clm_flax.py", exports=False).computes_as(before_the_options)


# ----------------------------------------------------------------------------------------------------
# The data layer takes values, not the command line's arguments, and its modules import downwards only
# ----------------------------------------------------------------------------------------------------

DATA_DIR = os.path.join(REPO, "flax_lm", "data")


def data_layer_problems(source: str, module: str, modules_above: list[str]) -> list[str]:
    """What in the source of the data module `module` goes against the data layer's direction: an import of
    flax_lm.command_line or of a data module not listed above it (`modules_above`), and a function or method with a
    parameter named like the scripts' argument groups (data_args, model_args, training_args: *_args)."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            imported = []
        for name in imported:
            if name == "flax_lm.command_line" or name.startswith("flax_lm.command_line."):
                problems.append(f"{module} imports {name}")
            parts = name.split(".")
            if parts[:2] == ["flax_lm", "data"] and len(parts) == 3 and parts[2] not in modules_above:
                problems.append(f"{module} imports flax_lm.data.{parts[2]}, which is not above it")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            parameters += [parameter for parameter in (arguments.vararg, arguments.kwarg) if parameter]
            name = getattr(node, "name", "lambda")
            problems += [
                f"{module}.{name} takes {parameter.arg}" for parameter in parameters if parameter.arg.endswith("_args")
            ]
    return problems


def data_modules_in_order() -> list[str]:
    """The modules of flax_lm/data in the order its docstring lists them, lowest layer first."""
    import flax_lm.data

    listed = [line.split()[0][: -len(".py")] for line in flax_lm.data.__doc__.splitlines() if ".py " in line]
    on_disk = sorted(name[:-3] for name in os.listdir(DATA_DIR) if name.endswith(".py") and name != "__init__.py")
    assert sorted(listed) == on_disk, f"flax_lm/data/__init__.py lists {listed}; the folder holds {on_disk}"
    return listed


def test_the_data_layer_takes_values_and_imports_downwards_only():
    modules = data_modules_in_order()
    problems = []
    for number, module in enumerate(modules):
        with open(os.path.join(DATA_DIR, f"{module}.py")) as file:
            problems += data_layer_problems(file.read(), module, modules[:number])
    assert not problems, "; ".join(problems)


def test_the_data_layer_check_finds_an_upward_import_and_an_arguments_parameter():
    source = (
        "from flax_lm.command_line.arguments import CommonDataArguments\n"
        "from flax_lm.data import loading\n"
        "class Reader:\n"
        "    def read(self, dataset, data_args):\n"
        "        return dataset\n"
    )
    problems = data_layer_problems(source, "texts", ["source"])
    assert problems == [
        "texts imports flax_lm.command_line.arguments",
        "texts imports flax_lm.command_line.arguments.CommonDataArguments",
        "texts imports flax_lm.data.loading, which is not above it",
        "texts.read takes data_args",
    ]


def test_every_script_at_the_top_runs_as_the_docs_write_it():
    """`./run_grpo_flax.py ...`, as the README and docs/ write each command, needs the file's executable bit."""
    scripts = [name for name in os.listdir(REPO) if name.endswith(".py") and not name.startswith("_")]
    with_shebang = []
    for name in scripts:
        with open(os.path.join(REPO, name)) as file:
            with_shebang += [name] if file.readline().startswith("#!") else []
    assert len(with_shebang) >= 8
    assert [name for name in with_shebang if not os.access(os.path.join(REPO, name), os.X_OK)] == []
