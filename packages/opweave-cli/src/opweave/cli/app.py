"""The ``opweave`` command: parse arguments, call a library, print the result.

Errors a user can cause print one line (``error: ...``) and exit with status 2; a traceback only
appears with ``OPWEAVE_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

import typer

from . import catalog, costs, deploying

app = typer.Typer(
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


def _missing(command: str, dist: str) -> None:
    """A command whose library is not installed: say which package it needs."""

    def needs(ctx: typer.Context) -> None:
        from opweave.costmodel.errors import OpWeaveError

        del ctx
        raise OpWeaveError(
            f"opweave {command} needs {dist}, which is not installed: pip install {dist} "
            "(in this repository: uv run --all-packages opweave ...)"
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, mapping errors to one-line messages and exit codes."""
    from opweave.costmodel.errors import OpWeaveError

    debug = os.environ.get("OPWEAVE_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    try:
        app(args=args, standalone_mode=False)
    except OpWeaveError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("error: interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # usage errors: bad or missing options
        if debug:
            raise
        print(f"error: {exc.format_message()}", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except (OSError, MemoryError) as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _console_main()
