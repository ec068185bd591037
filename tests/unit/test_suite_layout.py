"""The test suite's own layout (docs/tests.md): the unit tier starts no script, the files conftest.py starts first
exist, and the scripts that are no tests stay out of the test folders."""

import re

import pytest
from conftest import LONGEST_FILES_FIRST, TESTS_DIR, TIERS

# What starts a script of the repository in a process of its own: conftest.py's run_tool and server_process, and the
# helpers of the end-to-end files that wrap subprocess.
SCRIPT_RUNNERS = re.compile(r"\b(run_tool|run_script|server_process|start_script|run_copy|run_generate|run_mlm)\b")


def script_runs(source: str) -> list[str]:
    """The lines of `source` that start a script (or take run_tool), leaving out the definitions of the helpers."""
    return [
        line.strip() for line in source.splitlines() if SCRIPT_RUNNERS.search(line) and "def run_script(" not in line
    ]


# This file names the runners to find them, and starts none.
UNIT_FILES = sorted(path for path in (TESTS_DIR / "unit").glob("test_*.py") if path.name != "test_suite_layout.py")


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda path: path.name)
def test_a_unit_test_starts_no_script(path):
    assert script_runs(path.read_text()) == [], f"{path.name}: move these tests to tests/end_to_end/"


def test_the_check_finds_a_script_run_and_the_run_tool_fixture():
    source = 'def test_x(run_tool):\n    run_tool("run_clm_flax.py")\n    result = run_script(arguments)\n'
    assert len(script_runs(source)) == 3
    assert script_runs("def run_script(arguments, env=None, check=True):\n    return 1\n") == []


def test_the_files_started_first_exist_in_a_tier():
    for name in LONGEST_FILES_FIRST:
        assert name.split("/")[0] in TIERS and (TESTS_DIR / name).is_file(), name


def test_pytest_xdist_hands_out_the_files_in_the_order_of_the_collection(request):
    """Else it sorts them by their number of tests and the files of LONGEST_FILES_FIRST start wherever they fall."""
    assert request.config.option.loadscopereorder is False


def test_the_test_folders_hold_only_tests_and_their_shared_fixtures():
    others = [
        path.relative_to(TESTS_DIR).as_posix()
        for tier in TIERS
        for path in (TESTS_DIR / tier).glob("*.py")
        if not path.name.startswith("test_")
    ]
    assert others == [], "scripts that are no tests go to checks/"
    assert sorted(path.name for path in TESTS_DIR.glob("*.py")) == ["conftest.py"]
