"""Typed payloads: a handler says what its payload looks like, and both ends are checked.

A handler whose first parameter is annotated with a dataclass, a ``TypedDict``
or a pydantic model (or that is registered with ``payload_type=``) gets its
payload as that type::

    @dataclass
    class Welcome:
        user_id: int
        language: str = "en"

    @queue.handler("send_welcome")
    def send_welcome(payload: Welcome) -> None:
        ...  # payload.user_id is an int

The check happens twice, with the same rules. At enqueue (``session.add`` at
flush, ``enqueue_many`` before anything is written) a payload that does not
fit raises ``InvalidJob`` naming the kind, the type and each bad field, so the
job is never stored. At run time the stored JSON object is turned into the
type; should it not fit (a job written by raw SQL, or before the type
changed) the attempt fails like any handler error, with the same message.

The payload itself is stored as JSON, as always: enqueue a dict, or an
instance of the type (a dataclass is stored as ``dataclasses.asdict`` gives
it, a pydantic model as ``model_dump(mode="json")``).

When pydantic 2 is installed (``pip install "sqla-jobs[typed]"``) it checks
all three kinds of type, values included (``{"user_id": "7"}`` becomes ``7``;
``{"user_id": "seven"}`` is refused), and unknown keys are refused for
dataclasses and TypedDicts (a pydantic model follows its own ``extra``
setting). Without it, dataclasses and TypedDicts are checked for missing and
unknown keys, and fields annotated ``str``, ``int``, ``float``, ``bool``,
``list`` or ``dict`` for their value's type; other annotations are not
checked. (Before Python 3.12 pydantic accepts only ``typing_extensions``'
``TypedDict``; one from ``typing`` gets the check without pydantic.)
Handlers annotated ``dict`` (or not at all) get the plain dict, as before.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError, InvalidJob

__all__ = ["PayloadSchema", "as_payload", "declared_payload_type"]

_SIMPLE = (str, int, float, bool, list, dict)


def _is_pydantic_model(tp: Any) -> bool:
    return isinstance(tp, type) and callable(getattr(tp, "model_validate", None)) and hasattr(tp, "model_fields")


def is_payload_type(tp: Any) -> bool:
    """Whether ``tp`` is a type a payload can be checked against (dataclass, TypedDict, pydantic model)."""
    return (isinstance(tp, type) and dataclasses.is_dataclass(tp)) or typing.is_typeddict(tp) or _is_pydantic_model(tp)


def declared_payload_type(fn: Callable[..., Any]) -> Any:
    """The type the first parameter of ``fn`` is annotated with, if it is a payload type; else None."""
    try:
        first = next(iter(inspect.signature(fn).parameters.values()), None)
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError, ValueError):  # an unresolvable forward reference: no declared type
        return None
    if first is None:
        return None
    tp = hints.get(first.name)
    return tp if is_payload_type(tp) else None


def as_payload(value: Any) -> Any:
    """An instance of a payload type as the JSON object to store; any other value unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if _is_pydantic_model(type(value)):
        return value.model_dump(mode="json")
    return value


class PayloadSchema:
    """One handler's payload type: ``load`` turns a stored payload into it or raises ``InvalidJob``."""

    def __init__(self, kind: str, tp: Any) -> None:
        if not is_payload_type(tp):
            raise ConfigError(
                f"handler {kind!r}: payload_type must be a dataclass, a TypedDict or a pydantic model, got {tp!r}"
            )
        self.kind = kind
        self.type = tp
        self._adapter = _pydantic_adapter(tp)

    def __repr__(self) -> str:
        return f"<PayloadSchema {self.kind!r}: {self.type.__qualname__}>"

    def load(self, payload: Any) -> Any:
        """``payload`` (a JSON object) as an instance of the type; ``InvalidJob`` naming each bad field."""
        if not isinstance(payload, Mapping):
            self._refuse([f"expected a JSON object, got {type(payload).__name__}"])
        if self._adapter is not None:
            return self._load_with_pydantic(payload)
        problems = _shape_problems(self.type, payload)
        if problems:
            self._refuse(problems)
        return self.type(**payload) if dataclasses.is_dataclass(self.type) else dict(payload)

    def _load_with_pydantic(self, payload: Mapping[str, Any]) -> Any:
        from pydantic import ValidationError

        # pydantic ignores unknown keys of stdlib types (their config cannot be set from outside),
        # so those are found here: a misspelt optional field must not vanish silently.
        problems = [] if _is_pydantic_model(self.type) else _unknown_keys(self.type, payload)
        try:
            loaded = self._adapter.validate_python(payload)  # type: ignore[union-attr]
        except ValidationError as exc:
            problems = [f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors()] + problems
        if problems:
            self._refuse(problems)
        return loaded

    def _refuse(self, problems: list[str]) -> typing.NoReturn:
        raise InvalidJob(
            f"the payload of a {self.kind!r} job does not fit {self.type.__qualname__}: " + "; ".join(problems)
        )


def _where(loc: tuple[Any, ...]) -> str:
    return "payload" + "".join(f"[{part!r}]" for part in loc)


def _pydantic_adapter(tp: Any) -> Any:
    """pydantic's validator for ``tp``, or None when pydantic is not installed."""
    try:
        from pydantic import PydanticUserError, TypeAdapter
    except ImportError:
        return None
    try:
        return TypeAdapter(tp)  # a pydantic model keeps its own config (its ``extra`` setting included)
    except PydanticUserError:
        # pydantic refuses ``typing.TypedDict`` before Python 3.12 (it wants typing_extensions'):
        # such a type gets the check without pydantic rather than an error at registration.
        return None


def _keys(tp: Any) -> tuple[set[str], set[str]]:
    """The keys a dataclass or TypedDict knows, and those it requires."""
    if dataclasses.is_dataclass(tp):
        fields = [f for f in dataclasses.fields(tp) if f.init]
        missing = dataclasses.MISSING
        return {f.name for f in fields}, {f.name for f in fields if f.default is f.default_factory is missing}
    return set(typing.get_type_hints(tp)), set(tp.__required_keys__)


def _unknown_keys(tp: Any, payload: Mapping[str, Any]) -> list[str]:
    known, _ = _keys(tp)
    return [f"payload[{name!r}]: not a field of {tp.__qualname__}" for name in sorted(set(payload) - known)]


def _shape_problems(tp: Any, payload: Mapping[str, Any]) -> list[str]:
    """Missing and unknown keys, and values of the simple annotated types (the check without pydantic)."""
    hints = typing.get_type_hints(tp)
    known, required = _keys(tp)
    problems = [f"payload[{name!r}]: missing" for name in sorted(required - set(payload))]
    problems += _unknown_keys(tp, payload)
    for name in sorted(known & set(payload)):
        expected, value = hints.get(name), payload[name]
        if expected in _SIMPLE and not _fits(value, expected):
            problems.append(f"payload[{name!r}]: expected {expected.__name__}, got {type(value).__name__}")
    return problems


def _fits(value: Any, expected: type) -> bool:
    if isinstance(value, bool) and expected is not bool:  # True is an int to Python, not to a schema
        return False
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)
