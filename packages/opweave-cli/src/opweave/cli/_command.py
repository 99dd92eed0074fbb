"""What the command line parser would take silently, refused with a one-line error.

Two kinds: an empty word (an empty path is the current folder to the parser), checked on the
words before any parsing by :func:`empty_argument`; and an option that takes one value given
twice (the parser keeps the last), which :class:`SingleValueCommand` finds from the parser's
own record of the options it read, so that a word that is an option's value (``--prompt --tp``)
never counts as the option it spells.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand, TyperOption


def empty_argument(args: list[str]) -> str | None:
    """The problem with an empty word, or ``--flag=`` without a value; None if none is."""
    words = args[: args.index("--")] if "--" in args else args
    for i, word in enumerate(words):
        if word.startswith("--") and word.endswith("="):
            return f"{word[:-1]} is empty; give a value"
        if word == "":
            before = words[i - 1] if i else ""
            if before.startswith("-"):
                return f"{before} is empty; give a value"
            return "an argument is empty" + (f" (after {before})" if before else "")
    return None


class SingleValueCommand(TyperCommand):
    """A command that refuses an option taking one value (not a flag, not a repeatable
    option) given more than once: ``--x is given more than once; give it once``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:
            # the parser's third result lists the options it read, once per occurrence
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))
            seen: set[int] = set()
            for param in order:
                if not _takes_one_value(param):
                    continue
                if id(param) in seen:
                    names = "/".join([*param.opts, *param.secondary_opts])
                    raise typer.TyperException(f"{names} is given more than once; give it once")
                seen.add(id(param))
        return super().parse_args(ctx, args)


def _takes_one_value(param: Any) -> bool:
    return (
        isinstance(param, TyperOption)
        and not param.multiple
        and not param.is_flag
        and not param.count
    )


class App(typer.Typer):
    """The ``opweave`` app: every command it registers is a :class:`SingleValueCommand`
    unless a command class is given."""

    def command(self, name: str | None = None, *, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(name, cls=cls or SingleValueCommand, **kwargs)
