"""Typed, range-checked config keys: the vocabulary every family's config schema is written in.

A family's schema (``family_schemas.py``) is a pydantic model whose fields are the keys it reads,
each declared with one of the types here and the transformers default of that key (Hugging Face
saves only the keys that differ from the defaults). A failing key is reported as
``<key>: <what is wrong>`` (:func:`parse_config`): the one-line form the CLI prints.

How a ``null`` value reads, per type: a required number is ``missing``; an optional number is
absent; a flag is false; a string or object takes its default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ConfigError, validation_message

# Bounds far beyond any released model; past them a config is a typo or an attack, and a
# 10^12-expert model would only exhaust memory further down.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, intermediate, head dims, latent ranks
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 16
MAX_CONTEXT = 1 << 31


def show(value: Any) -> str:
    """``repr`` of a config value, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("config", "{message}", {"message": message})


class _NullTakesDefault:
    """Marks a field whose ``null`` means "use the default" (strings, objects)."""


_NULL_DEFAULT = _NullTakesDefault()


def _as_int(value: Any, low: int, high: int) -> int:
    if value is None:
        raise _fail("missing; add it to config.json")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(f"expected an integer, got {show(value)}")
    if not low <= value <= high:
        raise _fail(f"{value} is out of range ({low}..{high})")
    return value


class _Size:
    """Marks a size (a width, count or length): the shape of what is costed. A config that leaves
    one out takes transformers' default, as transformers and vLLM load it, and says so."""


_SIZE = _Size()


class _Placement:
    """Marks a layer count that only places attention types, and only where another key asks
    for it (``sliding_window_pattern`` without ``layer_types``): not a size, so no note."""


PLACEMENT = _Placement()


def _int(low: int, high: int) -> BeforeValidator:
    return BeforeValidator(lambda v: _as_int(v, low, high))


def _opt_int(low: int, high: int) -> BeforeValidator:
    return BeforeValidator(lambda v: None if v is None else _as_int(v, low, high))


Width = Annotated[int, _int(1, MAX_WIDTH), _SIZE]
"""A width (hidden, intermediate, head dim, latent rank) in ``1..2^20``."""
Width0 = Annotated[int, _int(0, MAX_WIDTH), _SIZE]
"""A width that may be 0 (none)."""
OptWidth = Annotated[int | None, _opt_int(1, MAX_WIDTH), _SIZE]
Layers = Annotated[int, _int(1, MAX_LAYERS), _SIZE]
"""A count of layers (or a layer interval) in ``1..10000``."""
Layers0 = Annotated[int, _int(0, MAX_LAYERS), _SIZE]
OptLayers = Annotated[int | None, _opt_int(1, MAX_LAYERS), _SIZE]
Heads = Annotated[int, _int(1, MAX_HEADS), _SIZE]
OptHeads = Annotated[int | None, _opt_int(1, MAX_HEADS), _SIZE]
Vocab = Annotated[int, _int(1, MAX_VOCAB), _SIZE]
Experts = Annotated[int, _int(1, MAX_EXPERTS), _SIZE]
Experts0 = Annotated[int, _int(0, MAX_EXPERTS), _SIZE]
Tokens = Annotated[int, _int(1, MAX_CONTEXT), _SIZE]
OptTokens = Annotated[int | None, _opt_int(1, MAX_CONTEXT), _SIZE]
ConvKernel = Annotated[int, _int(1, 1024)]


def _as_positive(value: Any) -> float:
    if value is None:
        raise _fail("missing; add it to config.json")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _fail(f"expected a number, got {show(value)}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise _fail(f"expected a finite positive number, got {value!r}")
    return value


def _as_finite(value: Any) -> float:
    if value is None:
        raise _fail("missing; add it to config.json")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _fail(f"expected a number, got {show(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(f"expected a finite number, got {value!r}")
    return value


Positive = Annotated[float, BeforeValidator(_as_positive)]
"""A finite number above zero."""
OptPositive = Annotated[
    float | None, BeforeValidator(lambda v: None if v is None else _as_positive(v))
]
"""A finite number above zero, or ``null``."""
Finite = Annotated[float, BeforeValidator(_as_finite)]
"""A finite number."""


def _as_bool(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(f"expected true or false, got {show(value)}")
    return value


Flag = Annotated[bool, BeforeValidator(_as_bool)]
"""``true`` or ``false`` (``null`` reads as false)."""


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(f"expected a string, got {show(value)}")
    return value


Str = Annotated[str, BeforeValidator(_as_str), _NULL_DEFAULT]
"""A string (``null`` takes the default)."""
OptStr = Annotated[str | None, BeforeValidator(lambda v: None if v is None else _as_str(v))]
"""A string, or ``null``."""


def _as_obj(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(f"expected an object, got {show(value)}")
    return dict(value)


Obj = Annotated[dict[str, Any], BeforeValidator(_as_obj), _NULL_DEFAULT]
"""A JSON object (``null`` reads as empty)."""


def _as_layer_list(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LAYERS for v in value
    ):
        raise _fail(f"expected a list of integers in 0..{MAX_LAYERS}, got {show(value)}")
    return list(value)


LayerList = Annotated[list[int], BeforeValidator(_as_layer_list)]
"""A list of layer indices (``null`` reads as empty)."""


def _as_str_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _fail(f"expected a list of strings, got {show(value)}")
    return list(value)


OptStrList = Annotated[list[str] | None, BeforeValidator(_as_str_list)]
"""A list of strings, or ``null``."""


class ConfigSchema(BaseModel):
    """The keys one family reads from ``config.json``, with transformers' defaults.

    Keys a family does not read are ignored (configs carry training and tokenizer keys).
    """

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, raw: Any) -> Any:
        """``null`` strings and objects take their defaults; a key spelled two ways (an
        alias) is read under the spelling that holds a value."""
        if not isinstance(raw, Mapping):
            return raw
        out = dict(raw)
        for name, field in cls.model_fields.items():
            names = field_names(name, field.validation_alias)
            given = [n for n in names if n in out]
            if any(out[n] is not None for n in given):
                for n in given:
                    if out[n] is None:
                        del out[n]
            elif given and _NULL_DEFAULT in field.metadata:
                for n in given:
                    del out[n]
        return out


def field_names(name: str, alias: Any) -> list[str]:
    """The config keys a schema field is read from, its canonical one first."""
    if alias is None:
        return [name]
    if isinstance(alias, str):
        return [alias]
    return [c for c in alias.choices if isinstance(c, str)]


def defaulted_sizes(cfg: ConfigSchema) -> tuple[str, ...]:
    """The sizes ``cfg`` holds at transformers' defaults because its config left them out, as
    ``key=value`` (a default of none, null or 0, and transformers' private keys, are not
    sizes the config assumed).

    >>> class Tiny(ConfigSchema):
    ...     hidden_size: Width = 64
    ...     num_hidden_layers: Layers = 2
    ...     first_k_dense_replace: Layers0 = 0
    >>> defaulted_sizes(parse_config(Tiny, {"hidden_size": 32}))
    ('num_hidden_layers=2',)
    """
    out = []
    for name, field in type(cfg).model_fields.items():
        keys = field_names(name, field.validation_alias)  # every spelling the key is read under
        value = getattr(cfg, name)
        if _SIZE not in field.metadata or PLACEMENT in field.metadata or keys[0].startswith("_"):
            continue
        if name in cfg.model_fields_set:
            continue
        if value:  # None and 0 mean "none"
            out.append(f"{'/'.join(keys)}={value}")
    return tuple(out)


S = TypeVar("S", bound=ConfigSchema)


def parse_config(schema: type[S], raw: Mapping[str, Any]) -> S:
    """Validate ``raw`` against ``schema``; the first bad key becomes ``<key>: <problem>``.

    >>> class Tiny(ConfigSchema):
    ...     hidden_size: Width = 64
    >>> parse_config(Tiny, {}).hidden_size
    64
    >>> try:
    ...     parse_config(Tiny, {"hidden_size": "big"})
    ... except ConfigError as exc:
    ...     print(exc)
    hidden_size: expected an integer, got 'big'
    """
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        missing = first["type"] == "missing"
        message = "missing; add it to config.json" if missing else validation_message(first)
        raise ConfigError(f"{key}: {message}") from None
