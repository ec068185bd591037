"""docs/where-to-edit.md (and the README's short table of it) sends a reader to a name in a file: each name its
table gives must be defined there.

A row of the table names its files in backticks (`flax_lm/server/app.py`, or a dotted module path such as
`flax_lm.training.setup.set_up_training`); every other name in backticks (`make_sampler`, `BatchMaker.from_tokenizer`,
`is_trained(path, param)`) must be defined in one of the row's files or in a training script (the rows are about
the scripts where they name no file). Flags, paths, results files, code and names of other libraries (`optax.chain`)
are not checked.
"""

import ast
import os
import re

import pytest
from conftest import REPO_DIR

REPO = str(REPO_DIR)
# The pages, and the section of each that holds the table (None: the whole page).
PAGES = {"docs/where-to-edit.md": None, "README.md": "## Where to edit"}
TRAINING_SCRIPTS = [
    "run_clm_flax.py", "run_mlm_flax.py", "run_t5_mlm_flax.py", "run_dpo_flax.py", "run_grpo_flax.py",
]  # fmt: skip
BACKTICKED = re.compile(r"`([^`]+)`")
# A name, dotted or not, optionally called: `make_sampler`, `BatchMaker.from_tokenizer`, `is_trained(path, param)`.
NAME = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")
FILE_ENDINGS = (".py", ".json", ".md", ".txt", ".yaml")


def section(text: str, heading: str | None) -> str:
    """The text under `heading` up to the next heading of its level; the whole text for None."""
    if heading is None:
        return text
    level = heading.split()[0] + " "
    after = text.split("\n" + heading + "\n", 1)[1]
    return re.split(rf"^{level}", after, flags=re.MULTILINE)[0]


def table_rows(text: str) -> list[tuple[str, str]]:
    """(what to change, where to edit) of each row of the page's tables, the header and its rule left out."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and not set(cells[0]) <= set("- ") and cells[0] != "to change":
            rows.append((cells[0], " | ".join(cells[1:])))
    return rows


def module_file(dotted: str) -> tuple[str, list[str]] | None:
    """(the file of the longest flax_lm module that `dotted` starts with, the names after it), or None."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        path = os.path.join(REPO, *parts[:end]) + ".py"
        if parts[0] == "flax_lm" and os.path.isfile(path):
            return os.path.relpath(path, REPO), parts[end:]
    return None


def row_files_and_names(cell: str) -> tuple[list[str], list[list[str]]]:
    """The files a row names (paths, and the modules of dotted flax_lm names) and the names it gives, each as its
    dotted parts."""
    files, names = [], []
    for token in BACKTICKED.findall(cell):
        if token.endswith(".py") and "/" in token:
            files.append(token)
            continue
        match = NAME.match(token)
        if not match or token.endswith(FILE_ENDINGS) or token == "flax_lm":
            continue
        module = module_file(match.group("name"))
        if module:
            files.append(module[0])
            if module[1]:
                names.append([module[0], *module[1]])
        else:
            names.append([None, *match.group("name").split(".")])
    return files, names


def definitions(path: str) -> dict[str, set[str]]:
    """{name: the names defined inside it} of each top-level function, class and assignment of a file; a class's
    methods, class attributes and fields are its inner names."""
    with open(os.path.join(REPO, path)) as file:
        tree = ast.parse(file.read())
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            inner = set()
            for child in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                    inner.add(child.name)
                elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                    inner.add(child.target.id)
                elif isinstance(child, ast.Assign):
                    inner.update(target.id for target in child.targets if isinstance(target, ast.Name))
            defined[node.name] = inner
        elif isinstance(node, ast.Assign):
            defined.update((target.id, set()) for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined[node.target.id] = set()
    return defined


def is_defined(parts: list[str], defined: dict[str, set[str]]) -> bool:
    name, *inner = parts
    return name in defined and (not inner or inner[0] in defined[name])


def undefined_names(text: str) -> list[str]:
    """One message per name of the page's tables that no file of its row defines."""
    problems = []
    for what, cell in table_rows(text):
        files, names = row_files_and_names(cell)
        for module, *parts in names:
            candidates = [module] if module else [*files, *TRAINING_SCRIPTS]
            if module is None and parts[0] not in {name for path in candidates for name in definitions(path)}:
                if len(parts) > 1 and parts[0].islower() and parts[0] not in ("self",):
                    continue  # another library's name: optax.chain, nn.Dense
            if not any(is_defined(parts, definitions(path)) for path in candidates):
                where = ", ".join(candidates)
                problems.append(f"row {what!r}: `{'.'.join(parts)}` is defined in none of {where}")
    return problems


@pytest.mark.parametrize("page", list(PAGES))
def test_every_name_of_the_where_to_edit_table_is_defined_where_its_row_says(page):
    with open(os.path.join(REPO, page)) as file:
        problems = undefined_names(section(file.read(), PAGES[page]))
    assert not problems, f"{page}:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "cell, problem",
    [
        ("`flax_lm/server/app.py`: `Endpoints`, `no_such_function`", "`no_such_function` is defined in none of"),
        ("`train_metrics_from_step` in train_results.json", "`train_metrics_from_step` is defined in none of"),
        (
            "`flax_lm.training.lifecycle.no_such_set_up`",
            "`no_such_set_up` is defined in none of flax_lm/training/lifecycle.py",
        ),
        ("`BatchMaker.no_such_method`", "`BatchMaker.no_such_method` is defined in none of"),
    ],
)
def test_a_name_the_row_s_files_do_not_define_is_found(cell, problem):
    page = f"| to change | edit |\n| --- | --- |\n| something | {cell} |\n"
    [found] = undefined_names(page)
    assert problem in found, found


def test_names_defined_where_the_row_says_flags_and_other_libraries_pass():
    cell = (
        "`flax_lm/server/app.py`: `Endpoints`; `flax_lm.training.setup.set_up_training`, `BatchMaker.from_tokenizer`, "
        "`is_trained(path, param)`, `--optim`, `optax.MaskedNode`, `train/loss`, `eval_results.json`"
    )
    assert undefined_names(f"| to change | edit |\n| --- | --- |\n| something | {cell} |\n") == []
