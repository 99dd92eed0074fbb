"""The ``opweave`` command: parse arguments, call a library, print the result.

Errors a user can cause print one line (``error: ...``) and exit with status 2; a traceback only
appears with ``OPWEAVE_DEBUG=1``. SIGINT, SIGTERM and SIGHUP unwind the command (a run stops
its ranks and removes its folder) and exit with 130, 143 and 129.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import typer

from . import catalog, costs, deploying
from ._command import App, empty_argument
from ._common import HungUp, Interrupted, Terminated

app = App(
    name="opweave",
    help="Plan and run operator-level disaggregated LLM decode on mixed GPU fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
catalog.register(app)
costs.register(app)
deploying.register(app)


# Command groups whose libraries are optional installs: (CLI module, library it needs, the
# distribution that provides it, the commands it registers).
_OPTIONAL = (
    ("opweave.cli.planning", "opweave.planner", "opweave-planner", ("plan", "simulate")),
    ("opweave.cli.running", "opweave.runtime", "opweave-runtime", ("run", "serve")),
    ("opweave.cli.profiling", "opweave.profiler", "opweave-profiler", ("profile",)),
)


# what a checkout installs for each optional library: it and the local packages it depends on
_LOCAL_INSTALL = {
    "opweave-planner": "./packages/opweave-planner",
    "opweave-runtime": "./packages/opweave-runtime",
    "opweave-profiler": "./packages/opweave-runtime ./packages/opweave-profiler",
}


def _missing(command: str, dist: str) -> None:
    """A command whose library is not installed: say which package it needs."""

    def needs(ctx: typer.Context) -> None:
        from opweave.costmodel.errors import OpWeaveError

        del ctx
        raise OpWeaveError(
            f"opweave {command} needs {dist}, which is not installed: in a checkout of this "
            f"repository, pip install {_LOCAL_INSTALL[dist]} (or uv run --all-packages opweave ...)"
        )

    app.command(
        command,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        help=f"(needs {dist}, not installed)",
        add_help_option=False,
    )(needs)


def _register_optional() -> None:
    """Register a command group when its library is installed, else a stub naming it."""
    from importlib import import_module
    from importlib.util import find_spec

    for module, library, dist, commands in _OPTIONAL:
        if find_spec(library) is not None and find_spec(module) is not None:
            import_module(module).register(app)
        else:
            for command in commands:
                _missing(command, dist)


_register_optional()


# the signals that stop a command: Ctrl-C, a supervisor, a closed terminal or session
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum: int, _frame: object) -> None:
    # One interruption unwinds; more of them while the run cleans up (seconds at most) would
    # only cut the clean-up short and leave ranks or files behind.
    for sig in STOPPING:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGHUP:
        raise HungUp
    if signum == signal.SIGTERM:
        raise Terminated
    raise Interrupted


def _error(exc: BaseException | str) -> str:
    """One line for an error: its message, or the file and reason of an OS error."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {exc.strerror}" if where else exc.strerror
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, mapping errors to one-line messages and exit codes.

    Exit status: 0 on success, 2 for any error the input causes (bad option, bad file,
    unreadable or unwritable path, infeasible request), 130 after SIGINT, 143 after SIGTERM,
    129 after SIGHUP.
    """
    from opweave.costmodel.errors import OpWeaveError

    debug = os.environ.get("OPWEAVE_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOPPING:
            # a signal ignored at start stays ignored (a shell's background job ignores SIGINT,
            # nohup SIGHUP)
            if signal.getsignal(sig) is not signal.SIG_IGN:
                handlers[sig] = signal.signal(sig, _on_signal)
    if sys.stdout is None:  # started with stdout closed (`opweave models >&-`)
        if sys.stderr is not None:
            print("error: standard output is closed; run with it open", file=sys.stderr)
        return 2
    try:
        problem = empty_argument(args)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        # typer returns the code of an exit instead of raising it, and turns Ctrl-C into 130
        status = app(args=args, standalone_mode=False)
        if status == 130:
            raise KeyboardInterrupt
        if isinstance(status, int) and not isinstance(status, bool) and status:
            return status
    except OpWeaveError as exc:
        if debug:
            raise
        print(f"error: {_error(exc)}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt, Interrupted):
        print("error: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except HungUp as exc:
        detail = f": {exc}" if str(exc) else ""
        print(f"error: hung up (SIGHUP){detail}", file=sys.stderr)
        return 129
    except Terminated as exc:
        detail = f": {exc}" if str(exc) else ""
        print(f"error: terminated (SIGTERM){detail}", file=sys.stderr)
        return 143
    except typer.TyperException as exc:  # usage errors: bad or missing options
        if debug:
            raise
        # click words a check inside a command "Invalid value: ..."; the message says what
        print(f"error: {_error(exc.format_message().removeprefix('Invalid value: '))}",
              file=sys.stderr)  # fmt: skip
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except (OSError, MemoryError) as exc:
        if debug:
            raise
        print(f"error: {_error(exc)}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # None: a handler set outside Python, not restorable
                signal.signal(sig, handler)
    return 0


def _console_main() -> None:
    code = main()
    if "vllm" in sys.modules:
        # vLLM's native extensions (nanobind's) print dozens of "leaked" lines while the
        # interpreter finalises, after the one error line; the server has stopped by now
        # (engine, ranks, folders), so nothing is left for the finalisation to do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _console_main()
