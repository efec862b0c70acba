"""Settings as dataclasses: each setting is one field, with its default, its
help and its unit; the command-line flag and the environment variable are
derived from the field.

    @dataclass(frozen=True)
    class ServerSettings:
        port: int = setting(8000, "HTTP port")
        poll_interval_s: float = setting(1.0, "seconds between polls")
        routing: RoutingSettings = group(RoutingSettings, "routing", "how pods are chosen")

    add_arguments(parser, ServerSettings, env_prefix="TANDEM_ROUTER_")
    settings = from_arguments(ServerSettings, parser.parse_args(argv))

* Flag: ``--`` and the field name with dashes (``--poll-interval-s``), unless
  ``flag=`` names it. A setting with a unit says it in its name, so in its
  flag: ``_s``, ``_ms``, ``_us`` (``--queue-timeout-s``, ``--lease-ttl-ms``).
* Environment variable: the prefix and the flag in capitals with underscores
  (``TANDEM_ROUTER_POLL_INTERVAL_S``). It replaces the default; a flag given
  on the command line wins over both (list settings add up).
* A field without ``setting(...)`` is not a flag (it keeps its default); a
  ``group(...)`` field holds a nested settings dataclass, whose flags join
  that argument group.

Validation names the flag at fault: ``raise SettingError(flag_of(cls,
"field"), "must be positive")``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_META = "tandem.setting"
_GROUP = "tandem.settings-group"
_UNITS = {"_s": "SECONDS", "_ms": "MS", "_us": "US"}


class SettingError(ValueError):
    """A setting's value cannot work; the message starts with its flag."""

    def __init__(self, flag: str, message: str, env: str | None = None) -> None:
        where = f"{flag} (env {env})" if env else flag
        super().__init__(f"{where}: {message}")
        self.flag = flag


@dataclasses.dataclass(frozen=True)
class _Setting:
    help: str
    flag: str | None
    aliases: tuple[str, ...]
    choices: tuple[Any, ...] | None
    parse: Callable[[str], Any] | None
    metavar: str | None
    env: bool
    switch: bool


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    env: bool = True,
    factory: Callable[[], Any] | None = None,
    switch: bool = False,
) -> Any:
    """A field that is also a flag (and an environment variable unless ``env=False``).

    ``parse`` turns one flag value into the field's type (or one item of a
    tuple field); by default the type's own constructor does; ``str()`` of a
    value gives it back as the flag takes it. ``factory`` computes the default
    when it depends on the machine (``default`` is then ignored). ``switch``:
    a boolean flag of another program's parser that takes no value
    (``--flag``, ``--no-flag``), as :func:`to_argv` renders it.
    """
    meta = {
        _META: _Setting(
            help,
            flag,
            tuple(aliases),
            tuple(choices) if choices is not None else None,
            parse,
            metavar,
            env,
            switch,
        )
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, (list, dict, set)):
        copy = type(default)(default)
        return dataclasses.field(default_factory=lambda: type(copy)(copy), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def group(cls: type[Any], title: str | None = None, description: str | None = None) -> Any:
    """A field holding a nested settings dataclass; its flags form one
    argument group (or join the enclosing one without a title)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: (title, description)})


def flag_of(cls: type[Any], name: str) -> str:
    """The flag of field ``name`` of settings class ``cls`` (the field's name
    when it is no flag)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta: _Setting | None = f.metadata.get(_META)
    if meta is None:
        return name
    return meta.flag or "--" + name.replace("_", "-")


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def comma_list(value: str) -> list[str]:
    """``"a, b,c"`` → ``["a", "b", "c"]``."""
    return [item.strip() for item in value.split(",") if item.strip()]


class _Extend(argparse.Action):
    """Repeatable flag: each use adds its items to what the default (or the
    environment) gave."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.extend(values if isinstance(values, list) else [values])
        setattr(namespace, self.dest, items)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _kind(hint: Any) -> tuple[Any, bool]:
    """(item type, repeatable) of a field's type hint; ``X | None`` is ``X``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(args[0])
    if origin in (list, tuple):
        return typing.get_args(hint)[0], True
    return hint, False


def _converter(item: Any, meta: _Setting) -> Callable[[str], Any]:
    if meta.parse is not None:
        return meta.parse
    if item is bool:
        return parse_bool
    if isinstance(item, type):
        return item
    return str


Arguments = argparse.ArgumentParser | argparse._ArgumentGroup


def add_arguments(
    parser: Arguments,
    cls: type[Any],
    env_prefix: str,
    defaults: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    show_defaults: bool = True,
) -> dict[str, Arguments]:
    """Add a flag for every ``setting`` of ``cls`` (and of its groups); returns
    the argument groups made, by title, for flags added by hand.

    ``defaults`` replaces field defaults by field name (a per-entry-point
    default); the environment (``environ``, default ``os.environ``) replaces
    both. Each flag's help ends with its default (unless ``show_defaults`` is
    False: the parser's formatter shows them) and its environment variable.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    groups: dict[str, Arguments] = {}
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            title, description = f.metadata[_GROUP]
            target = parser
            if title is not None and isinstance(parser, argparse.ArgumentParser):
                target = groups[title] = parser.add_argument_group(title, description)
            groups.update(
                add_arguments(
                    target, hints[f.name], env_prefix, environ=environ, show_defaults=show_defaults
                )
            )
            continue
        meta: _Setting | None = f.metadata.get(_META)
        if meta is None:
            continue
        flag = flag_of(cls, f.name)
        item, repeat = _kind(hints[f.name])
        convert = _converter(item, meta)
        if defaults is not None and f.name in defaults:
            default = defaults[f.name]
        elif callable(f.default_factory):
            default = f.default_factory()
        else:
            default = f.default
        env = env_name(env_prefix, flag) if meta.env else None
        if env is not None and env in environ:
            raw = environ[env]
            try:
                if repeat:
                    default = [convert(v) for v in comma_list(raw)]
                else:
                    default = None if not raw and _optional(hints[f.name]) else convert(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise SettingError(
                    flag, f"bad value {raw!r} from the environment: {exc}", env
                ) from None
        choices = meta.choices
        if choices is None and isinstance(item, type) and issubclass(item, enum.Enum):
            choices = tuple(item)
        shown = ", ".join(str(v) for v in default) if repeat else default
        notes = [f"default: {shown}"] if show_defaults and shown not in (None, "", ()) else []
        if env is not None:
            notes.append(f"env {env}")
        kwargs: dict[str, Any] = {
            "dest": _dest(flag),
            "default": list(default) if repeat else default,
            "help": meta.help.replace("%", "%%") + (f" ({'; '.join(notes)})" if notes else ""),
            "metavar": meta.metavar or _metavar(f.name, item, choices),
        }
        if choices is not None:
            kwargs["choices"] = choices
        if repeat:
            kwargs["action"] = _Extend
            kwargs["type"] = (
                (lambda v, c=convert: [c(x) for x in comma_list(v)])
                if meta.parse is None
                else convert
            )
        else:
            kwargs["type"] = convert
        parser.add_argument(flag, *meta.aliases, **kwargs)
    return groups


def _metavar(name: str, item: Any, choices: tuple[Any, ...] | None) -> str | None:
    if choices is not None:
        return "{" + ",".join(str(c) for c in choices) + "}"
    for suffix, unit in _UNITS.items():
        if name.endswith(suffix) and not name.endswith("_per" + suffix):  # not a rate
            return unit
    return None


def from_arguments(cls: type[Any], args: argparse.Namespace, **fixed: Any) -> Any:
    """An instance of ``cls`` from parsed arguments; ``fixed`` sets fields that
    are no flags (or overrides)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
        elif _GROUP in f.metadata:
            values[f.name] = from_arguments(hints[f.name], args)
        elif _META in f.metadata:
            value = getattr(args, _dest(flag_of(cls, f.name)))
            if typing.get_origin(_strip_none(hints[f.name])) is tuple:
                value = tuple(value)
            values[f.name] = value
    return cls(**values)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(hint)


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def to_argv(settings: Any, always: Sequence[str] = (), joined: bool = False) -> list[str]:
    """Flags that give ``settings`` (and its groups), in field order: every
    setting that differs from its default, and those named in ``always``.
    ``joined``: ``--flag=value`` as one item instead of two."""
    cls = type(settings)
    default = cls()
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            argv += to_argv(getattr(settings, f.name), always, joined)
            continue
        meta: _Setting | None = f.metadata.get(_META)
        if meta is None:
            continue
        value = getattr(settings, f.name)
        if value == getattr(default, f.name) and f.name not in always:
            continue
        flag = flag_of(cls, f.name)
        if meta.switch:
            argv.append(flag if value else "--no-" + flag[2:])
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            text = str(v).lower() if isinstance(v, bool) else str(v)
            argv += [f"{flag}={text}"] if joined else [flag, text]
    return argv
