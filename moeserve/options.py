"""User-facing options as documented dataclass fields: one place for each name, default and help.

A config dataclass documents each field with a string literal under it (`field_docs`). Every field
of a root config (and of the configs nested in it) is an option: `moeserve launch` and `generate`
generate a flag for it and `LLM(...)` takes it as a keyword, both under the option's name. An
option is named like its field unless `option(...)` metadata says otherwise, e.g. where users type
milliseconds but the engine keeps seconds, or where a flag name predates the field.

Imports no torch: the command's parser is built from these fields.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass: field docs that double as CLI help."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            if isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


@dataclass(frozen=True)
class OptionMeta:
    """How a field is offered to users when its name or units differ from the field's."""

    name: str | None = None
    """The keyword and flag name (flag: dashes for underscores); None: the field's name."""
    aliases: tuple[str, ...] = ()
    """Older names that keep working, as keywords and as flags."""
    scale: float = 1.0
    """Field value = option value * scale (0.001: the user gives milliseconds, the field keeps seconds)."""
    parse: Callable[[str], object] | None = None
    """Flag text -> value, for values typed in their own syntax (byte sizes such as 512MiB)."""
    env: tuple[str, ...] = ()
    """Environment variables that give the flag's default (the first one set), as launchers export them."""
    launch_default: object = None
    """A different default for `moeserve launch`, where a server's needs differ from offline use;
    None: the field's own."""
    hidden: bool = False
    """Test-only: accepted, but not listed in --help."""
    repeatable: bool = False
    """The flag may be given several times; the field (a tuple) holds every value, in order."""


def option(default: object = dataclasses.MISSING, **meta: object) -> typing.Any:
    """A dataclass field with `OptionMeta`: `ttft_s: float = option(5.0, name="slo_ttft_ms", scale=0.001)`."""
    return dataclasses.field(default=default, metadata={"option": OptionMeta(**meta)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Option:
    """One user-facing option, resolved from a (possibly nested) config field."""

    name: str
    path: tuple[str, ...]
    """Field names from the root config down to the field, e.g. ("parallel", "backend")."""
    type: type
    """int, float or str: what a flag's text converts to (before `meta.parse`)."""
    optional: bool
    """None is a valid value (the field's type allows it)."""
    choices: tuple[str, ...] | None
    default: object
    """In the option's units; MISSING for a required field."""
    help: str
    meta: OptionMeta

    @property
    def flags(self) -> list[str]:
        return ["--" + n.replace("_", "-") for n in (self.name, *self.meta.aliases)]

    def to_field(self, value: object) -> object:
        """The option's value in the field's units."""
        if self.meta.scale != 1.0 and value is not None:
            return value * self.meta.scale  # type: ignore[operator]
        return value


def _scalar(hint: object) -> tuple[type, bool, tuple[str, ...] | None]:
    """(type, optional, choices) of a field annotation such as `int | None` or a Literal."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return str, False, tuple(args)
    if args:  # a union: X | None
        inner = [a for a in args if a is not type(None)]
        kind, _, choices = _scalar(inner[0])
        return kind, type(None) in args, choices
    return (hint if hint in (int, float, str, bool) else str), False, None  # type: ignore[return-value]


def options(cls: type, path: tuple[str, ...] = ()) -> list[Option]:
    """Every option of config class `cls`, nested dataclass fields expanded in place."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found += options(hint, (*path, f.name))  # type: ignore[arg-type]
            continue
        meta = f.metadata.get("option", OptionMeta())
        kind, optional, choices = _scalar(hint)
        default = f.default
        if default is not dataclasses.MISSING and default is not None and meta.scale != 1.0:
            default = round(default / meta.scale, 9)  # type: ignore[operator]
        name = meta.name or f.name
        found.append(Option(name, (*path, f.name), kind, optional, choices, default, docs.get(f.name, ""), meta))
    names = [n for o in found for n in (o.name, *o.meta.aliases)]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        raise TypeError(f"{cls.__name__}: option names used twice: {sorted(duplicated)}")
    return found


def build(cls: type[typing.Any], values: dict[str, object]) -> typing.Any:
    """An instance of `cls` from option values by name (or alias); the rest keep their defaults.

    An unknown name is a TypeError that lists the valid ones, as a misspelt keyword would be.
    """
    by_name = {n: o for o in options(cls) for n in (o.name, *o.meta.aliases)}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        valid = ", ".join(o.name for o in options(cls))
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; valid options: {valid}")
    tree: dict[str, typing.Any] = {}
    for name, value in values.items():
        opt = by_name[name]
        node = tree
        for part in opt.path[:-1]:
            node = node.setdefault(part, {})
        node[opt.path[-1]] = opt.to_field(value)
    return _instantiate(cls, tree)


def _instantiate(cls: type, tree: dict[str, typing.Any]) -> typing.Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in tree.items():
        nested = isinstance(value, dict) and dataclasses.is_dataclass(hints[name])  # else a dict-valued option
        kwargs[name] = _instantiate(hints[name], value) if nested else value
    return cls(**kwargs)
