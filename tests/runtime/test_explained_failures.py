"""Which of vLLM's log records ``opweave serve`` drops once the ranks' failure has its one line
(``opweave.runtime.vllm._config.quiet_explained_failures``); the server's whole log after a
rank's death is checked in tests/vllm/test_faults.py."""

from __future__ import annotations

import logging

import pytest

from opweave.runtime.errors import RunFailedError
from opweave.runtime.vllm._config import FAILURE_ENV, _ExplainedFailure


class EngineDeadError(Exception):
    """Named as vLLM's front end names its error for a dead engine (the filter reads the name)."""


FATAL = "EngineCore encountered a fatal error."


def _logged(error: Exception | None, message: str = FATAL) -> bool:
    """Whether the filter lets a record through that is logged while ``error`` is raised, as
    ``logger.exception`` logs it (``None``: a record outside any error)."""
    quiet = _ExplainedFailure()
    logger = logging.getLogger("test.explained")
    if error is None:
        return quiet.filter(logger.makeRecord("vllm", logging.ERROR, "f", 1, message, (), None))
    try:
        raise error
    except Exception as exc:
        info = (type(exc), exc, exc.__traceback__)
        with_info = logger.makeRecord("vllm", logging.ERROR, "f", 1, message, (), info)
        # a record without the error attached, logged in its except block (vLLM's input dump)
        beside = logger.makeRecord("vllm", logging.ERROR, "f", 1, "Dumping input", (), None)
        kept = quiet.filter(with_info)
        assert quiet.filter(beside) == kept
        return kept


@pytest.fixture
def failure_file(tmp_path, monkeypatch):
    path = tmp_path / "failure"
    monkeypatch.setenv(FAILURE_ENV, str(path))
    return path


def test_a_ranks_failure_is_dropped_and_its_line_left_for_the_server(failure_file):
    line = "rank 3 (owner 1) was killed by signal 9 (SIGKILL); the run was stopped"
    assert not _logged(RunFailedError(line))
    assert failure_file.read_text() == line + "\n"
    # the ranks' own line, left first, is the one that stays
    assert not _logged(RunFailedError("a later consequence"))
    assert failure_file.read_text() == line + "\n"


def test_the_front_ends_dead_engine_errors_are_dropped_once_a_line_was_left(failure_file):
    assert _logged(EngineDeadError("See stack trace (above) for the root cause."))
    failure_file.write_text("rank 1 exited with status 1; the run was stopped\n")
    assert not _logged(EngineDeadError("See stack trace (above) for the root cause."))


def test_other_failures_and_records_stay(failure_file):
    failure_file.write_text("rank 1 exited with status 1; the run was stopped\n")
    assert _logged(RuntimeError("a fault in vLLM itself"))
    assert _logged(None, "Dumping input data")
    assert _logged(ValueError("bad request"), "Error in completion stream generator.")


def test_without_opweave_serve_to_print_the_line_every_record_stays(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILURE_ENV, raising=False)
    assert _logged(RunFailedError("rank 3 was killed by signal 9 (SIGKILL)"))
    assert _logged(EngineDeadError("engine dead"))
    assert list(tmp_path.iterdir()) == []
