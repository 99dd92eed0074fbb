"""The CLI's output helpers: tables and progress through rich, plain text off a terminal, and
the refusal of an option given twice, found by the command line parser itself."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from opweave.cli._command import empty_argument
from opweave.cli._console import PLAIN_WIDTH, print_table, table
from opweave.cli._progress import SearchProgress
from tests.fuzzing import invoke, one_line_error


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_plain_table_is_a_header_dashes_and_rows_without_escapes() -> None:
    text = table([["h100-sxm", "3.35", "RunPod"], ["l4", "0.30", "-"]], ["gpu", "TB/s", "basis"])
    lines = text.splitlines()
    assert lines[0].split() == ["gpu", "TB/s", "basis"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["h100-sxm", "3.35", "RunPod"]
    assert lines[3].startswith("l4 ") and lines[3].split()[1] == "0.30"
    assert lines[2].index("3.35") == lines[3].index("0.30")  # numbers right-aligned
    assert "\x1b" not in text and all(line == line.rstrip() for line in lines)


def test_a_wide_table_is_not_wrapped_or_cut_off_a_terminal() -> None:
    long = "x" * (2 * PLAIN_WIDTH)
    lines = table([["a", long]], ["key", "value"], text=(0, 1)).splitlines()
    assert len(lines) == 3 and lines[2].endswith(long)


def test_print_table_writes_plain_text_when_stdout_is_no_terminal(capsys) -> None:
    print_table([["a", "1"]], ["k", "v"])
    assert capsys.readouterr().out == table([["a", "1"]], ["k", "v"]) + "\n"


def test_the_catalog_tables_print_plain_text() -> None:
    code, out, err, _ = invoke(["models"])
    assert code == 0 and err == "" and "\x1b" not in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["deepseek-v3"][5] == "3+1"  # the block column: prefix + period layers


def test_profiler_progress_off_a_terminal_prints_a_line_every_tenth_with_an_eta() -> None:
    from opweave.profiler._private.progress import Progress

    stream = io.StringIO()
    bar = Progress(20, stream=stream)
    bar.note("starting")
    for i in range(20):
        bar.update(f"op{i}")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "profile: starting"
    percents = [int(line.split()[1].rstrip("%")) for line in lines[1:]]
    assert percents == [5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert "s left) op" in lines[1]  # the remaining cells at the pace so far
    assert lines[-1].startswith("profile: 100% (20/20 cells, ") and "done) op19" in lines[-1]


def test_disabled_progress_prints_nothing() -> None:
    stream = _Terminal()
    search = SearchProgress(False, stream=stream)
    search(
        SimpleNamespace(
            phase="x", done=1, total=2, simulator_calls=1, best_usd_per_million_tokens=None
        )
    )
    search.close()
    assert stream.getvalue() == ""


def test_search_progress_shows_each_phase_on_a_terminal_only() -> None:
    report = SimpleNamespace(
        phase="frontiers", done=3, total=10, simulator_calls=7, best_usd_per_million_tokens=0.5
    )
    quiet = io.StringIO()
    search = SearchProgress(True, stream=quiet)
    search(report)
    search.close()
    assert quiet.getvalue() == ""
    terminal = _Terminal()
    search = SearchProgress(True, stream=terminal)
    search(report)
    search(SimpleNamespace(**{**vars(report), "phase": "branch-and-bound", "done": 1}))
    search.close()
    assert "branch-and-bound" in terminal.getvalue() and "$0.500/Mtok" in terminal.getvalue()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["estimate", "m", "--gpu="], "--gpu is empty; give a value"),
        (["estimate", "", "--gpu", "h100"], "an argument is empty (after estimate)"),
        (["estimate", "m", "--gpu", ""], "--gpu is empty; give a value"),
        (["run", "--", "--x="], None),  # after --: not opweave's to check
        (["estimate", "m", "--gpu", "h100"], None),
    ],
)
def test_empty_arguments(args: list[str], problem: str | None) -> None:
    assert empty_argument(args) == problem


def test_an_option_given_twice_is_named_with_all_its_spellings() -> None:
    line = one_line_error(["deploy", "p.json", "-o", "a", "--output", "b", "--image", "i"])
    assert line == "error: -o/--output is given more than once; give it once"
    line = one_line_error(["estimate", "qwen3-32b", "--gpu", "h100", "--batch", "2", "--batch=3"])
    assert line == "error: --batch is given more than once; give it once"


def test_a_value_that_spells_an_option_is_no_second_option(tmp_path) -> None:
    """``--hardware --json``: ``--json`` is the file's name here, not the flag (the parser
    knows which words are values), so this is a missing file, not a repeated option."""
    line = one_line_error(["gpus", "--hardware", "--json", "--json"])
    assert "given more than once" not in line
    assert "--json" in line


def test_flags_and_repeatable_options_may_be_given_again() -> None:
    code, out, err, _ = invoke(["models", "--json", "--json"])
    assert code == 0 and err == "" and out.startswith("{")


def test_the_run_choices_spelled_in_the_cli_are_the_runtimes() -> None:
    """``--kernels``, ``--decode-step`` and ``--wait`` are checked before the runtime (and torch)
    loads, against choices the CLI spells out: they must be the runtime's."""
    from opweave.cli import _options
    from opweave.runtime import DecodeStep, Kernels, Wait

    assert tuple(Kernels) == _options.KERNELS
    assert tuple(DecodeStep) == _options.DECODE_STEPS
    assert tuple(Wait) == _options.WAITS


def test_the_microbatch_limit_spelled_in_the_cli_is_the_plan_files() -> None:
    from opweave.cli import _options
    from opweave.costmodel import MAX_MICROBATCHES

    assert _options.MAX_MICROBATCHES == MAX_MICROBATCHES
