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


# Command groups whose libraries are optional installs: (CLI module, library it needs).
_OPTIONAL = (
    ("opweave.cli.planning", "opweave.planner"),
    ("opweave.cli.running", "opweave.runtime"),
    ("opweave.cli.profiling", "opweave.profiler"),
)


def _register_optional() -> None:
    """Register a command group only when its library is installed."""
    from importlib import import_module
    from importlib.util import find_spec

    for module, library in _OPTIONAL:
        if find_spec(library) is not None and find_spec(module) is not None:
            import_module(module).register(app)


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
