"""Shared pydantic bases for every schema: frozen, no unknown fields."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ConfigError, not_a_file


def schema_version_problem(value: Any, expected: int, *, toml: bool = False) -> str | None:
    """What is wrong with a file's ``schema_version`` ``value``, to follow "schema_version"
    in a message (None: it is ``expected``).

    It says what the value is and how to write the right one in the file's syntax (``toml``:
    ``schema_version = 1``; JSON: ``"schema_version": 1``): a quoted ``"1"`` or a ``1.0``
    prints as the version it spells, so "has schema_version 1; reads version 1" would not tell
    the user what to change."""
    if type(value) is int and value == expected:
        return None
    fix = f"schema_version = {expected}" if toml else f'"schema_version": {expected}'
    if isinstance(value, bool):
        found = "true" if value else "false"
        return f"must be the integer {expected}, not {found}; write {fix}"
    if isinstance(value, int):
        if value > expected:
            return (
                f"{value} is newer than this OpWeave reads ({expected}): upgrade OpWeave, or "
                f"rewrite the file for version {expected}"
            )
        return f"{value} is not a version OpWeave writes; write {fix}"
    if isinstance(value, str):
        shown = json.dumps(value if len(value) <= 40 else value[:40] + "...")
        return f"must be the integer {expected}, not the string {shown}; write {fix}"
    if isinstance(value, float):
        return f"must be the integer {expected}, not the number {value!r}; write {fix}"
    kind = {list: "a list", dict: "a table" if toml else "an object"}.get(type(value), "null")
    return f"must be the integer {expected}, not {kind}; write {fix}"


def schema_version_field(expected: int) -> Any:
    """A ``mode="before"`` validator of a JSON file's ``schema_version`` whose error is
    :func:`schema_version_problem`'s (pydantic's own says only "Input should be 1")."""
    from pydantic import field_validator
    from pydantic_core import PydanticCustomError

    def check(cls: type, value: Any) -> Any:
        del cls
        problem = schema_version_problem(value, expected)
        if problem is not None:
            raise PydanticCustomError("schema_version", "{problem}", {"problem": problem})
        return value

    return field_validator("schema_version", mode="before")(check)


class Frozen(BaseModel):
    """Immutable schema object; unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class FileSchema(Frozen):
    """A schema of a file a user hands in (hardware, profile, plan): every number in it is
    finite. JSON and TOML both spell infinity and NaN (``1e999``, ``inf``, ``nan``), and either
    would pass ``gt=0`` or go through every later comparison unnoticed."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Self:
        """``model_validate_json(raw, strict=True)`` that also refuses an object naming a key
        twice, which the JSON parser would resolve silently to the last (a validation error
        at that key)."""
        try:
            loads_json(raw)
        except DuplicateKeyError as exc:
            error = ValueError("given twice; keep one")
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    {
                        "type": "value_error",
                        "loc": (exc.key,),
                        "input": exc.key,
                        "ctx": {"error": error},
                    }
                ],
            ) from None
        except (ValueError, RecursionError):
            pass  # not JSON: model_validate_json says where
        return cls.model_validate_json(raw, strict=True)


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (json.loads would keep the last silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` that refuses an object naming a key twice (:class:`DuplicateKeyError`),
    as TOML does.

    >>> try:
    ...     loads_json('{"a": 1, "b": {"a": 2, "a": 3}}')
    ... except DuplicateKeyError as exc:
    ...     print(exc.key)
    a
    """
    return json.loads(text, object_pairs_hook=_unique_keys)


def read_data_file(path: Path, what: str) -> Any:
    """The data of a user's TOML (``.toml``) or JSON file; every way it can fail to be read is
    a one-line :class:`ConfigError` naming ``what`` the file is and ``path``."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} {not_a_file(path)}")
    try:
        text = path.read_text()
        return tomllib.loads(text) if path.suffix == ".toml" else loads_json(text)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what} {path} gives {exc.key!r} twice; keep one") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} is malformed: {exc}") from None
    except ValueError:  # an integer of more than 4300 digits
        raise ConfigError(f"{what} {path} holds a number too long to be one") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} nests too deeply to be a {what}") from None
