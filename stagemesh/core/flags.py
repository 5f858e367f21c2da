"""Command-line flags declared once, on the fields of a service's options dataclass.

A field made with :meth:`Flag.field` carries its flag (names, type, help, choices, metavar) in its metadata
and its default as the field's. From that one declaration this module adds the flags to an argparse parser
(:func:`add_flags`), builds the options from the parsed namespace (:func:`from_args`) and turns options back
into a child's argv (:func:`to_argv`), so that `stagemesh serve` starts its router, schedulers and stages with
the very flags those services declare. A field made with :func:`group` nests another options class (the
flags every service shares: logs and TLS, the model, LoRA); its flags are flat on the command line and in the
namespace, as if declared in place.

A Flag constant used by several services' options (stagemesh.core.common_flags) is one flag: the same name,
default and help wherever it appears. A variant (``FLAG.field(default=...)``) keeps the flag and changes its
default or help, where a command means more by it (serve's, stagemesh.entry.serve_options.SERVE_VARIANTS); the
test of the declarations (tests/test_flags.py) allows no other difference.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

FLAG, GROUP, SKIP = "stagemesh.flag", "stagemesh.group", "stagemesh.skip"
T = TypeVar("T")
# the ways a flag takes its value: value (FLAG X), switch (store_true), bool (--x / --no-x, None when neither),
# append (repeated FLAG X), extend (FLAG X Y ...), positional (an optional positional argument)
KINDS = ("value", "switch", "bool", "append", "extend", "positional")


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the long name first, then aliases ("--tensor-parallel-size", "-tp")
    default: Any = None  # a tuple for the flags that take several values (the options are frozen)
    help: str | None = None
    kind: str = "value"
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False
    passed_on: bool = True  # False: never written into a child's argv (secrets travel in the environment)
    title: str | None = None  # the --help section it is listed under (None: the parser's own options)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.names[0]}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "switch" and self.default is None:  # (off unless given)
            object.__setattr__(self, "default", False)

    @property
    def name(self) -> str:
        return self.names[0]

    def field(self, **changes: Any) -> Any:
        """A dataclass field declaring this flag; `changes` (default, help) make a service's variant of it."""
        flag = dataclasses.replace(self, **changes) if changes else self
        return dataclasses.field(default=flag.default, metadata={FLAG: flag})

    def add_to(self, parser: Any, dest: str) -> None:
        kw: dict[str, Any] = {"help": self.help, "default": self.default}
        if self.kind == "positional":
            parser.add_argument(dest, nargs="?", metavar=self.metavar, **kw)
            return
        kw["dest"] = dest
        if self.kind == "switch":
            parser.add_argument(*self.names, action="store_true", **kw)
            return
        if self.kind == "bool":
            parser.add_argument(*self.names, action=argparse.BooleanOptionalAction, **kw)
            return
        if self.kind == "append":  # (a list default: argparse extends it in place, so each parser gets a copy)
            kw.update(action="append", default=None if self.default is None else list(self.default))
        elif self.kind == "extend":
            kw.update(action="extend", nargs="+", default=list(self.default))
        parser.add_argument(*self.names, type=self.type, choices=self.choices, metavar=self.metavar,
                            required=self.required, **kw)

    def argv(self, value: Any) -> list[str]:
        """The flag with `value` for a child's command line; [] where the child's default gives the same."""
        if not self.passed_on or value is None or value == self.default:
            return []
        if self.kind == "positional":
            return [str(value)]
        if self.kind == "switch":
            return [self.name] if value else []
        if self.kind == "bool":
            return [self.name if value else "--no-" + self.name[2:]]
        if self.kind == "append":
            return [a for v in value for a in (self.name, str(v))]
        if self.kind == "extend":
            return [self.name, *map(str, value)]
        return [self.name, str(value)]


def group(cls: type[T], skip: tuple[str, ...] = ()) -> Any:
    """A field holding a shared options class whose flags this service takes (less those in `skip`)."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: cls, SKIP: skip})


def flags(cls: type, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, Flag]]:
    """(field name, flag) of every flag of an options class, nested groups' in place, in declaration order."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if GROUP in f.metadata:
            yield from flags(f.metadata[GROUP], f.metadata[SKIP])
        elif FLAG in f.metadata:
            yield f.name, f.metadata[FLAG]


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Every flag of `cls` on `parser`, each titled one in its argument group (made once per title)."""
    groups: dict[str, Any] = {}
    for name, flag in flags(cls, skip):
        target: Any = parser
        if flag.title is not None:
            target = groups.get(flag.title) or groups.setdefault(flag.title, parser.add_argument_group(flag.title))
        flag.add_to(target, name)


def from_args(cls: type[T], args: argparse.Namespace | None = None, skip: tuple[str, ...] = (), **values: Any) -> T:
    """The options `args` gives (attributes it lacks keep their defaults), with `values` over them; a nested
    group takes the flat attributes of its own flags (a flag it skips keeps its default). Lists become tuples
    (the options are frozen)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        if GROUP in f.metadata:
            inner = {k: values.pop(k) for k in [n for n, _ in flags(f.metadata[GROUP])] if k in values}
            kw[f.name] = values.pop(f.name, None) or from_args(f.metadata[GROUP], args, f.metadata[SKIP], **inner)
        elif FLAG in f.metadata:
            if f.name in values:
                kw[f.name] = values.pop(f.name)
            elif args is not None and hasattr(args, f.name):
                kw[f.name] = getattr(args, f.name)
    if values:
        raise TypeError(f"{cls.__name__} has no flags {sorted(values)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


def to_argv(options: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The command line that gives a service these options: the positional first, then every flag whose value
    is not the service's default, nested groups' in place (less the flags they skip)."""
    head: list[str] = []
    rest: list[str] = []
    for f in dataclasses.fields(options):
        if f.name in skip:
            continue
        value = getattr(options, f.name)
        if GROUP in f.metadata:
            sub = to_argv(value, f.metadata[SKIP])
            cut = 1 if any(fl.kind == "positional" and getattr(value, n) is not None
                           for n, fl in flags(f.metadata[GROUP], f.metadata[SKIP])) else 0
            head += sub[:cut]
            rest += sub[cut:]
        elif FLAG in f.metadata:
            flag: Flag = f.metadata[FLAG]
            (head if flag.kind == "positional" else rest).extend(flag.argv(value))
    return head + rest


def parse(cls: type[T], argv: list[str]) -> T:
    """The options a command line gives (as the service itself would parse it)."""
    parser = argparse.ArgumentParser(prog=cls.__name__)
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(argv))


def flag_of(cls: type, name: str, **changes: Any) -> Any:
    """A field declaring the same flag as `cls`'s field `name` (serve's options take the services' flags so);
    `changes` (a default, a help) where serve's meaning differs."""
    return dict(flags(cls))[name].field(**changes)
