"""The shape of the code: what the scripts share lives once in flax_lm, and what they copy on purpose stays equal.

The training scripts copy a few definitions from run_clm_flax.py on purpose, so that a researcher reads and edits the
whole loop in the one file they run. Each deliberate copy is marked on the line above the definition (or assignment):

    # Copied from run_clm_flax.<name>
    # Copied from run_clm_flax.<name> with GPT2->Roberta,gpt2->roberta

The second form declares a consistent rename: the copy must equal the original after each `old->new`
replacement, applied in the order written, to the original's text (names included). A copy that no longer matches
its original fails, naming the file, the name and the first line that differs. Code shared without a mark, code a
script repeats from the library, and a second definition of a model are bounded or refused below.
"""

import ast
import glob
import os
import re

import pytest
from conftest import REPO_DIR

REPO = str(REPO_DIR)
MARKER = re.compile(r"^# Copied from run_clm_flax\.(?P<name>\w+)(?: with (?P<renames>\S.*?))?\s*$")
RENAME = re.compile(r"^(\w+)->(\w+)$")
SCRIPTS = [
    "run_clm_flax.py",
    "run_mlm_flax.py",
    "run_t5_mlm_flax.py",
    "run_dpo_flax.py",
    "run_grpo_flax.py",
    "generate_flax.py",
    "create_config.py",
    "train_tokenizer.py",
]
LIBRARY_MODULES = sorted(
    os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "flax_lm", "**", "*.py"), recursive=True)
)


def top_level_definitions(path: str) -> dict[int, tuple[list[str], int, str]]:
    """(names, last line, source text) of each top-level function, class and assignment, by first line."""
    with open(path) as file:
        source = file.read()
    lines = source.splitlines()
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        start = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        definitions[start] = (names, node.end_lineno, "\n".join(lines[start - 1 : node.end_lineno]))
    return definitions


def originals_by_name(path: str) -> dict[str, str]:
    return {name: text for names, _, text in top_level_definitions(path).values() for name in names}


def parse_renames(renames: str | None) -> list[tuple[str, str]] | None:
    """[(old, new), ...] of a marker's `with A->B,C->D`; None when it is malformed."""
    if renames is None:
        return []
    pairs = [RENAME.match(part.strip()) for part in renames.split(",")]
    if not all(pairs):
        return None
    return [(match.group(1), match.group(2)) for match in pairs]


def renamed(text: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        text = text.replace(old, new)
    return text


def marked_copies(path: str) -> list[tuple[int, str, str | None, tuple[list[str], int, str] | None]]:
    """(marker line number, name, renames as written, definition right below the marker) for each marker."""
    with open(path) as file:
        lines = file.read().splitlines()
    definitions = top_level_definitions(path)
    copies = []
    for index, line in enumerate(lines):
        match = MARKER.match(line)
        if match:
            copies.append((index + 1, match.group("name"), match.group("renames"), definitions.get(index + 2)))
    return copies


def first_difference(expected: str, actual: str) -> str:
    expected_lines, actual_lines = expected.splitlines(), actual.splitlines()
    for offset, (want, have) in enumerate(zip(expected_lines, actual_lines)):
        if want != have:
            return f"line {offset + 1} of the definition: expected {want!r}, found {have!r}"
    if len(expected_lines) > len(actual_lines):
        return f"the copy ends at line {len(actual_lines)}; expected next: {expected_lines[len(actual_lines)]!r}"
    return f"the copy goes on past line {len(expected_lines)}: {actual_lines[len(expected_lines)]!r}"


def copy_problems(script_path: str, originals: dict[str, str]) -> list[str]:
    """One message per marker in `script_path` whose copy does not match its original (renames applied)."""
    script = os.path.basename(script_path)
    problems = []
    for line_number, name, written_renames, definition in marked_copies(script_path):
        where = f"{script}:{line_number}: copy of run_clm_flax.{name}"
        renames = parse_renames(written_renames)
        if renames is None:
            problems.append(f"{where}: the renames {written_renames!r} are not of the form Old->New,old->new")
        elif name not in originals:
            problems.append(f"{where}: run_clm_flax.py has no top-level {name}")
        elif definition is None:
            problems.append(f"{where}: the marker is not followed by a top-level definition on the next line")
        elif renamed(name, renames) not in definition[0]:
            problems.append(
                f"{where}: the definition below the marker is {definition[0]}, not {renamed(name, renames)}"
            )
        else:
            expected = renamed(originals[name], renames)
            if definition[2] != expected:
                problems.append(f"{where} differs; {first_difference(expected, definition[2])}")
    return problems


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_every_marked_copy_matches_run_clm_flax(script):
    script_path = os.path.join(REPO, script)
    problems = copy_problems(script_path, originals_by_name(os.path.join(REPO, "run_clm_flax.py")))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", ["run_mlm_flax.py", "run_t5_mlm_flax.py"])
def test_the_mlm_script_keeps_its_loop_as_checked_copies(script):
    """The loop, the optimizer and the save are what a researcher edits in every training script; the MLM and T5
    scripts carry them as marked copies, so that the check above has something to check."""
    copied = {name for _, name, _, _ in marked_copies(os.path.join(REPO, script))}
    assert {"train", "create_optimizer", "steps_of_calls", "SCRIPT_TRAINING"} <= copied, sorted(copied)


def test_marker_must_precede_the_definition_it_names(tmp_path):
    original = tmp_path / "run_clm_flax.py"
    original.write_text("def something():\n    pass\n")
    script = tmp_path / "script.py"
    script.write_text("# Copied from run_clm_flax.something\ndef other():\n    pass\n\n\ndef something():\n    pass\n")
    problems = copy_problems(str(script), originals_by_name(str(original)))
    assert problems == [
        "script.py:1: copy of run_clm_flax.something: the definition below the marker is ['other'], not something"
    ]


def test_a_renamed_copy_matches_only_with_its_renames(tmp_path):
    original = tmp_path / "run_clm_flax.py"
    original.write_text('class GPT2Block:\n    """A gpt2 block."""\n    size = 2\n')
    originals = originals_by_name(str(original))
    copy = 'class RobertaBlock:\n    """A roberta block."""\n    size = 2\n'
    script = tmp_path / "script.py"

    script.write_text("# Copied from run_clm_flax.GPT2Block with GPT2->Roberta,gpt2->roberta\n" + copy)
    assert copy_problems(str(script), originals) == []

    script.write_text("# Copied from run_clm_flax.GPT2Block with GPT2->Roberta\n" + copy)
    assert copy_problems(str(script), originals) == [
        "script.py:1: copy of run_clm_flax.GPT2Block differs; line 2 of the definition: "
        'expected \'    """A gpt2 block."""\', found \'    """A roberta block."""\''
    ]

    script.write_text("# Copied from run_clm_flax.GPT2Block with GPT2=Roberta\n" + copy)
    assert "are not of the form" in copy_problems(str(script), originals)[0]


def test_a_stale_copy_names_its_first_differing_line(tmp_path):
    original = tmp_path / "run_clm_flax.py"
    original.write_text("def step(x):\n    y = x + 1\n    return y\n")
    script = tmp_path / "script.py"
    script.write_text("# Copied from run_clm_flax.step\ndef step(x):\n    y = x + 2\n    return y\n")
    assert copy_problems(str(script), originals_by_name(str(original))) == [
        "script.py:1: copy of run_clm_flax.step differs; line 2 of the definition: "
        "expected '    y = x + 1', found '    y = x + 2'"
    ]


# Lines too plain to say anything about shared code: closing brackets, lone keywords, docstring quotes.
TRIVIAL_LINE = re.compile(r'^(?:[)\]}]+[,:]?|\) -> .*:|return|else:|try:|finally:|pass|continue|break|"""|\.\.\.)$')
# Shared lines counted only as runs of this many consecutive meaningful lines, so that a line both scripts
# happen to write (`dtype=self.dtype,` in two different models) does not count as shared code.
SHARED_RUN_LINES = 3


def meaningful_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text without indentation) of each line that counts in the measure of shared code."""
    with open(path) as file:
        source = file.read()
    in_definitions = set()
    for start, (_, end, _) in top_level_definitions(path).items():
        in_definitions.update(range(start, end + 1))
    meaningful = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        if number in in_definitions and text and not text.startswith("#") and not TRIVIAL_LINE.match(text):
            meaningful.append((number, text))
    return meaningful


def shared_line_numbers(path: str, other_path: str) -> set[int]:
    """Lines of `path` inside a run of SHARED_RUN_LINES meaningful lines that `other_path` has too, in order,
    as written there or with one of the renames that the markers of `path` declare."""
    lines = meaningful_lines(path)
    other = [text for _, text in meaningful_lines(other_path)]
    rename_lists = {(): []}
    for _, _, written_renames, _ in marked_copies(path):
        renames = parse_renames(written_renames)
        if renames:
            rename_lists[tuple(renames)] = renames
    other_runs = set()
    for renames in rename_lists.values():
        texts = [renamed(text, renames) for text in other]
        other_runs.update(tuple(texts[start : start + SHARED_RUN_LINES]) for start in range(len(texts)))
    shared = set()
    for start in range(len(lines) - SHARED_RUN_LINES + 1):
        run = lines[start : start + SHARED_RUN_LINES]
        if tuple(text for _, text in run) in other_runs:
            shared.update(number for number, _ in run)
    return shared


def checked_copy_line_numbers(path: str) -> set[int]:
    numbers = set()
    for marker_line, _, _, definition in marked_copies(path):
        if definition is not None:
            numbers.update(range(marker_line + 1, definition[1] + 1))
    return numbers


def largest_unchecked(path: str, line_numbers: set[int], count: int = 5) -> str:
    """The definitions of `path` holding most of `line_numbers`, as 'name:first line (lines)'."""
    holders = []
    for start, (names, end, _) in top_level_definitions(path).items():
        held = len(line_numbers & set(range(start, end + 1)))
        if held:
            holders.append((held, f"{names[0]}:{start} ({held})"))
    return ", ".join(text for _, text in sorted(holders, reverse=True)[:count])


# Lines that run_mlm_flax.py shares with run_clm_flax.py outside marked copies: the first lines of the two main()
# tables of contents (whose phases around the loop are flax_lm.command_line.phases'), flag declarations written alike,
# and functions that differ in a few lines (the batches: MLM masks them). More means a new copy that nothing checks:
# move it into flax_lm or mark it.
UNCHECKED_SHARED_LINES_CEILING = 20
# Lines that a script shares with any one flax_lm module: flag declarations written alike (a `field(` with the same
# default) and the like; a function repeated from the library goes past this.
SCRIPT_SHARES_WITH_LIBRARY_CEILING = 10
# One concern per module: a module past this has grown a second one.
LIBRARY_MODULE_LINES_CEILING = 700
# main() reads as the table of contents of its script: each step one call.
MAIN_LINES_CEILING = 60
# A script is read in one sitting: what grows past this belongs in flax_lm (generate_flax.py's decoding and serving
# in flax_lm/server and flax_lm/generation).
SCRIPT_LINES_CEILINGS = {
    "run_clm_flax.py": 920,  # its objective holds the routers' losses of a mixture of experts and LoRA's adapters
    "run_mlm_flax.py": 999,
    "run_t5_mlm_flax.py": 750,
    "run_dpo_flax.py": 750,
    "generate_flax.py": 450,
    "run_grpo_flax.py": 650,  # the set-up of run_dpo_flax.py (its copies of the optimizer table) and sampling
}


@pytest.mark.parametrize("script", ["run_mlm_flax.py", "run_t5_mlm_flax.py"])
def test_shared_lines_of_the_training_scripts_outside_checked_copies_are_bounded(script):
    """Of the code run_mlm_flax.py (or run_t5_mlm_flax.py) shares with run_clm_flax.py, the lines that no copy check
    keeps identical.

    A line of run_mlm_flax.py counts as shared when it belongs to a run of SHARED_RUN_LINES consecutive meaningful
    lines that run_clm_flax.py also has, in the same order, indentation ignored, either as written or after one of
    the renames declared by the markers of run_mlm_flax.py. Meaningful: inside a top-level function, class or
    assignment (imports, the module docstring and the `if __name__ == "__main__":` guard are left out), not blank,
    not a comment, not trivial (TRIVIAL_LINE: closing brackets, `return`, `else:` and such). Runs rather than single
    lines, so that a line both scripts happen to write (`dtype=self.dtype,` in two different models) is not taken for
    shared code. A shared line is checked when it lies inside a definition marked `# Copied from run_clm_flax.NAME`.
    """
    path, clm = os.path.join(REPO, script), os.path.join(REPO, "run_clm_flax.py")
    shared = shared_line_numbers(path, clm)
    unchecked = shared - checked_copy_line_numbers(path)
    assert len(unchecked) <= UNCHECKED_SHARED_LINES_CEILING, (
        f"{script} shares {len(unchecked)} lines with run_clm_flax.py outside checked copies (ceiling "
        f"{UNCHECKED_SHARED_LINES_CEILING}); move shared code into flax_lm or mark a deliberate copy. Most: "
        f"{largest_unchecked(path, unchecked)}"
    )
    print(f"shared lines: {len(shared)}, outside checked copies: {len(unchecked)}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_repeats_code_of_the_library(script):
    script_path = os.path.join(REPO, script)
    repeats = []
    for module in LIBRARY_MODULES:
        shared = shared_line_numbers(script_path, os.path.join(REPO, module))
        if len(shared) > SCRIPT_SHARES_WITH_LIBRARY_CEILING:
            repeats.append(f"{len(shared)} lines of {module} in {largest_unchecked(script_path, shared)}")
    assert not repeats, f"{script} repeats code of the library (import it instead): " + "; ".join(repeats)


def classes_defined(path: str) -> list[str]:
    with open(path) as file:
        return [node.name for node in ast.parse(file.read()).body if isinstance(node, ast.ClassDef)]


def test_each_model_class_is_defined_once():
    """A model has one definition (in flax_lm/models), which every script and the generation server import."""
    model_classes = [
        name
        for module in LIBRARY_MODULES
        if module.startswith("flax_lm/models/")
        for name in classes_defined(os.path.join(REPO, module))
    ]
    assert len(model_classes) == len(set(model_classes)), sorted(model_classes)
    assert {"FlaxGPT2LMHeadModel", "FlaxRobertaForMaskedLM"} <= set(model_classes), sorted(model_classes)
    for path in SCRIPTS + [module for module in LIBRARY_MODULES if not module.startswith("flax_lm/models/")]:
        redefined = set(classes_defined(os.path.join(REPO, path))) & set(model_classes)
        assert not redefined, f"{path} defines {sorted(redefined)} again; import it from flax_lm.models"


def test_a_library_function_pasted_into_a_script_is_counted(tmp_path):
    library_module = os.path.join(REPO, "flax_lm", "run", "checkpoints.py")
    definitions = top_level_definitions(library_module).values()
    _, _, text = max(definitions, key=lambda definition: len(definition[2]))
    script = tmp_path / "script.py"
    script.write_text("import os\n\n\n" + text + "\n")
    assert len(shared_line_numbers(str(script), library_module)) > SCRIPT_SHARES_WITH_LIBRARY_CEILING


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_is_a_table_of_contents(script):
    [main] = [
        node
        for node in ast.parse(open(os.path.join(REPO, script)).read()).body
        if isinstance(node, ast.FunctionDef) and node.name == "main"
    ]
    length = main.end_lineno - main.lineno + 1
    assert length <= MAIN_LINES_CEILING, f"{script}: main() has {length} lines; move the detail into functions"


@pytest.mark.parametrize("script", list(SCRIPT_LINES_CEILINGS))
def test_a_script_stays_short_enough_to_read_in_one_sitting(script):
    with open(os.path.join(REPO, script)) as file:
        length = len(file.read().splitlines())
    ceiling = SCRIPT_LINES_CEILINGS[script]
    assert length <= ceiling, (
        f"{script} has {length} lines (ceiling {ceiling}); move what experiments share into flax_lm"
    )


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_library_modules_keep_to_one_concern(module):
    with open(os.path.join(REPO, module)) as file:
        length = len(file.read().splitlines())
    assert length <= LIBRARY_MODULE_LINES_CEILING, (
        f"{module} has {length} lines (ceiling {LIBRARY_MODULE_LINES_CEILING}); split off what is a second concern"
    )


def test_the_measure_counts_runs_of_shared_lines_and_the_renames_of_the_markers(tmp_path):
    original = tmp_path / "run_clm_flax.py"
    original.write_text(
        "def gpt2_step(x):\n    a = x + 1\n    b = a * 2\n    c = b - 3\n    return c\n\n\n"
        "def other(y):\n    size = y\n    return size\n"
    )
    script = tmp_path / "script.py"
    script.write_text(
        "# Copied from run_clm_flax.gpt2_step with gpt2->roberta\n"
        "def roberta_step(x):\n    a = x + 1\n    b = a * 2\n    c = b - 3\n    return c\n\n\n"
        "def unmarked(x):\n    a = x + 1\n    b = a * 2\n    c = b - 3\n    return c\n\n\n"
        "def lonely(y):\n    size = y\n    return size * 2\n"
    )
    shared = shared_line_numbers(str(script), str(original))
    # The renamed copy whole (its first line only through the rename) and the unmarked run; not `size = y`,
    # which the scripts share alone.
    assert shared == {2, 3, 4, 5, 6, 10, 11, 12, 13}
    assert shared & checked_copy_line_numbers(str(script)) == {2, 3, 4, 5, 6}
