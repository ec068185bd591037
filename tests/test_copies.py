"""Code shared by the scripts is copied on purpose, so that each script stands alone.

Every copy (in run_mlm_flax.py, generate_flax.py, train_tokenizer.py and create_config.py) is marked
`# Copied from run_clm_flax.<name>` on the line above the definition (or assignment); this test fails when a copy no
longer matches its original.
"""

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^# Copied from run_clm_flax\.(\w+)\s*$")
SCRIPTS_WITH_COPIES = ["run_mlm_flax.py", "generate_flax.py", "train_tokenizer.py", "create_config.py"]


def top_level_definitions(path: str) -> dict[str, tuple[int, str]]:
    """(first line, source text) of each top-level function, class and assignment, by name."""
    with open(path) as file:
        source = file.read()
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        else:
            continue
        start = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        text = "\n".join(source.splitlines()[start - 1 : node.end_lineno])
        for name in names:
            definitions[name] = (start, text)
    return definitions


def marked_copies(path: str) -> list[tuple[int, str, str]]:
    """(line number, name, source of the definition below the marker) for each marker in `path`."""
    with open(path) as file:
        lines = file.read().splitlines()
    definitions = top_level_definitions(path)
    copies = []
    for index, line in enumerate(lines):
        match = MARKER.match(line)
        if match:
            name = match.group(1)
            start, text = definitions.get(name, (None, None))
            copies.append((index + 1, name, text if start == index + 2 else None))
    return copies


@pytest.mark.parametrize("script", SCRIPTS_WITH_COPIES)
def test_every_marked_copy_matches_run_clm_flax(script):
    originals = top_level_definitions(os.path.join(REPO, "run_clm_flax.py"))
    copies = marked_copies(os.path.join(REPO, script))
    assert copies, f"{script} has no '# Copied from run_clm_flax.' markers"
    for line_number, name, copy in copies:
        assert name in originals, f"{script}:{line_number}: run_clm_flax.py has no top-level {name}"
        assert copy is not None, f"{script}:{line_number}: the marker is not followed by a definition of {name}"
        assert copy == originals[name][1], f"{script}:{line_number}: {name} differs from run_clm_flax.{name}"


def test_marker_must_precede_the_definition_it_names(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("# Copied from run_clm_flax.something\ndef other():\n    pass\n\n\ndef something():\n    pass\n")
    assert marked_copies(str(script)) == [(1, "something", None)]
