"""The configuration on the command line: flags derived from the schema, and ``tangram-hpc config show``.

:func:`add_arguments` gives a command ``--config`` and one flag per key of
its sections (:data:`~tangram_hpc.config.COMMAND_SECTIONS`); a flag left out
leaves the file and the environment in charge, so :func:`settings_from_args`
gets the effective configuration with the command line on top.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .config import (COMMAND_SECTIONS, CONFIG_ENV, SCHEMA, SECTIONS, ConfigError, DeclaredKey, Settings, convert,
                     load)

__all__ = ["add_arguments", "settings_from_args", "worker_flags", "flag_of", "add_config_arguments", "config_main"]


# -- the command line ----------------------------------------------------------------

def flag_of(f: DeclaredKey, command: str) -> str:
    if f.key.flag:
        return f.key.flag
    name = f.name.replace("_", "-")
    flag = f"--{name}" if f.section == command else f"--{f.section}-{name}"
    return flag if not (f.type is bool and f.default) else "--no-" + flag[2:]


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``--config`` and one flag per key of the command's sections; unset flags leave the file and env in charge."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=f"TOML configuration file (default ${CONFIG_ENV}); precedence: default < file < "
                             "environment < command line; 'tangram-hpc config show' prints the result")
    for section in COMMAND_SECTIONS[command]:
        doc = (SECTIONS[section].__doc__ or section).strip()
        g = parser.add_argument_group(doc)
        for f in SCHEMA[section].values():
            g.add_argument(flag_of(f, command), dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                           help=_help(f), **_argparse_kwargs(f))


def _help(f: DeclaredKey) -> str:
    # a flag that turns a default-on key off says so: its help text describes the key being on
    parts = [("turn off: " if f.type is bool and f.default else "") + f.key.help]
    if f.default not in (None, [], "") and f.type is not bool:
        parts.append(f"default {','.join(f.default) if f.type is list else f.default}")
    if f.key.env:
        parts.append(f"env ${f.key.env}")
    parts.append(f"file {f.label}")
    return f"{parts[0]} ({'; '.join(parts[1:])})".replace("%", "%%")


def _argparse_kwargs(f: DeclaredKey) -> dict[str, Any]:
    if f.type is bool:
        return {"action": "store_false" if f.default else "store_true"}
    kw: dict[str, Any] = {"metavar": f.key.metavar or _metavar(f)}
    if f.key.choices:
        kw["choices"] = f.key.choices
        kw.pop("metavar")
    if f.type is list:
        if f.key.split:
            kw["type"] = lambda text: [v for v in text.split(f.key.split) if v]
        else:
            kw["action"] = "append"
        return kw

    def parse(text: str) -> Any:
        try:
            return convert(f, text, "the command line", text=True)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).replace(f"{f.label} from the command line: ", "")) from None
    kw["type"] = parse
    return kw


def _metavar(f: DeclaredKey) -> str:
    if f.type is int:
        return "N"
    if f.type is float:
        return "S" if f.name.endswith("_s") else "X"
    return "PATH" if f.type is Path else f.name.upper()


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The effective configuration of a command whose parser :func:`add_arguments` built."""
    cli = {}
    for dest, value in vars(args).items():
        section, dot, name = dest.partition(".")
        if dot and section in SCHEMA and name in SCHEMA[section]:
            cli[section, name] = value
    return load(getattr(args, "config", None), cli=cli)


def worker_flags(settings: Settings, section: str) -> list[str]:
    """Flags that pass a section's explicitly set values on to a worker's command line."""
    out: list[str] = []
    for name, value in settings.explicit(section).items():
        f = SCHEMA[section][name]
        flag = flag_of(f, "worker")
        if f.type is bool:
            if value != f.default:
                out.append(flag)
        elif f.type is list:
            if f.key.split:
                out += [flag, f.key.split.join(value)]
            else:
                for v in value:
                    out += [flag, v]
        elif value is not None:
            out += [flag, str(value)]
    return out


# -- tangram-hpc config show ----------------------------------------------------------

def add_config_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the effective configuration and where each value came from",
                          description="Print the effective configuration (default < file < environment) as "
                                      "TOML, each value with its source; the output is a valid config file.")
    show.add_argument("--config", metavar="FILE", help=f"configuration file (default ${CONFIG_ENV})")
    show.add_argument("--json", action="store_true", help="print JSON: value, source, variable and help per key")
    show.add_argument("--section", choices=list(SCHEMA), action="append", help="only this section (repeatable)")


def config_main(args: argparse.Namespace) -> int:
    settings = load(args.config)
    sections = args.section or list(SCHEMA)
    if args.json:
        print(json.dumps(_as_json(settings, sections), indent=2))
    else:
        print(_as_toml(settings, sections))
    return 0


def _as_json(settings: Settings, sections: list[str]) -> dict:
    out: dict[str, Any] = {"file": str(settings.file) if settings.file else None, "sections": {}}
    for section in sections:
        values = getattr(settings, section)
        out["sections"][section] = {
            name: {"value": _plain(getattr(values, name)), "source": settings.source(section, name),
                   "env": f.key.env, "flag": {c: flag_of(f, c) for c, secs in COMMAND_SECTIONS.items()
                                             if section in secs},
                   "help": f.key.help}
            for name, f in SCHEMA[section].items()}
    return out


def _plain(v: Any) -> Any:
    return str(v) if isinstance(v, Path) else v


def _as_toml(settings: Settings, sections: list[str]) -> str:
    lines = [f"# tangram-hpc configuration (default < file < environment < command line); "
             f"file: {settings.file or 'none'}"]
    for section in sections:
        values = getattr(settings, section)
        lines += ["", f"[{section}]"]
        for name, f in SCHEMA[section].items():
            v = getattr(values, name)
            src = settings.source(section, name)
            text = f"# {name} is unset" if v is None else f"{name} = {json.dumps(_plain(v))}"
            lines.append(f"{text:<40} # ({src}) {f.key.help}")
    return "\n".join(lines)
