"""Templates: how a new environment's directory is filled (empty, a copy of a project tree, a
Python venv), and the template of a config map."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from .fs_inside import EnvError

__all__ = ["Template", "EmptyTemplate", "TreeTemplate", "PythonEnvTemplate", "template_from_config", "UnknownTemplate"]


class UnknownTemplate(EnvError):
    """A payload names a template this worker does not have: the request's error, not the environment's."""


class Template(Protocol):
    """How a new environment directory is filled."""

    def populate(self, path: Path) -> None: ...


@dataclass(frozen=True)
class EmptyTemplate:
    """An empty directory."""

    def populate(self, path: Path) -> None:
        pass


@dataclass(frozen=True)
class TreeTemplate:
    """A copy of a project tree (symlinks kept as symlinks)."""

    source: Path
    ignore: tuple[str, ...] = ()

    def populate(self, path: Path) -> None:
        src = Path(self.source)
        if not src.is_dir():
            raise EnvError(f"template source {src} is not a directory")
        shutil.copytree(src, path, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*self.ignore) if self.ignore else None)


@dataclass(frozen=True)
class PythonEnvTemplate:
    """A Python venv at ``.venv`` of the environment, over an optional base template.

    The venv is made from the worker's interpreter (visible read-only in the
    sandbox) with ``--system-site-packages`` by default, and ``packages`` are
    installed into it with pip on the worker at creation time (the sandbox
    itself has no network).  Console scripts are rewritten to
    ``#!/usr/bin/env python`` so they run at the sandbox path too; the
    sandbox puts ``.venv/bin`` first on ``PATH``.
    """

    packages: tuple[str, ...] = ()
    system_site_packages: bool = True
    pip_args: tuple[str, ...] = ()
    base: Any = None

    def populate(self, path: Path) -> None:
        if self.base is not None:
            self.base.populate(path)
        venv = path / ".venv"
        cmd = [sys.executable, "-m", "venv", "--without-pip", str(venv)]
        if self.system_site_packages:
            cmd.insert(4, "--system-site-packages")
        _check(cmd)
        if self.packages:
            _check([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--no-input", *self.pip_args, *self.packages])
            _rewrite_shebangs(venv / "bin")


def _check(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise EnvError(f"{' '.join(cmd[:4])} ... failed: {r.stderr.strip()[-2000:]}")


def _rewrite_shebangs(bindir: Path) -> None:
    for f in bindir.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        with open(f, "rb") as fh:
            head = fh.read(2)
            if head != b"#!":
                continue
            first = fh.readline()
            rest = fh.read()
        if b"python" in first:
            f.write_bytes(b"#!/usr/bin/env python\n" + rest)


def template_from_config(cfg: Any) -> Template:
    """A template from a config map: ``{"kind": "empty"|"tree"|"python", ...}``."""
    if not isinstance(cfg, Mapping):
        if hasattr(cfg, "populate"):
            return cfg
        raise EnvError(f"template config must be a map, got {cfg!r}")
    kind = cfg.get("kind", "empty")
    if kind == "empty":
        return EmptyTemplate()
    if kind == "tree":
        return TreeTemplate(Path(cfg["source"]), tuple(cfg.get("ignore", ())))
    if kind == "python":
        base = template_from_config(cfg["base"]) if cfg.get("base") else None
        return PythonEnvTemplate(tuple(cfg.get("packages", ())),
                                 bool(cfg.get("system_site_packages", True)),
                                 tuple(cfg.get("pip_args", ())), base)
    raise EnvError(f"unknown template kind {kind!r}: empty, tree or python")
