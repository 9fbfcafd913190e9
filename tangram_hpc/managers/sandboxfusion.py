"""SandboxFusion-compatible ``run_code`` requests and responses.

A payload with ``language`` and ``code`` (and no ``cmd``) is a SandboxFusion
``/run_code`` request::

    {"language": "python", "code": "print(1)", "stdin": "", "files": {"a.txt": "<base64>"},
     "fetch_files": ["out.txt"], "compile_timeout": 10, "run_timeout": 10,
     "memory_limit_MB": -1, "args": [], "template": None}

and the action's output is SandboxFusion's response::

    {"status": "Success"|"Failed"|"SandboxError", "message": "",
     "compile_result": None | {...}, "run_result": {"status": "Finished"|"Error"|"TimeLimitExceeded",
     "execution_time": 0.05, "cpu_time": 0.04 | None, "return_code": 0, "stdout": "1\\n", "stderr": ""},
     "executor_pod_name": None, "files": {"out.txt": "<base64>"}}

As in SandboxFusion, ``files`` values and fetched files are base64.  The code
is written to ``.run_code/`` in the environment and run from the environment
directory, so files it writes stay for the next action.

:func:`parse_run_code` is the one validation of a request: the worker runs it
on every payload and ``tangram-hpc serve`` on every HTTP body, so a bad field
is reported the same way on both paths, as a :class:`RunCodeError` naming it.

A payload with ``cells`` (and no ``cmd`` or ``code``) is a SandboxFusion
``/run_jupyter`` request, run in the environment's stateful Python kernel
(:mod:`tangram_hpc.managers.pykernel`; docs/sandbox.md, "Kernel mode")::

    {"cells": ["a = 1", "a + 1"], "cell_timeout": 0, "total_timeout": 45, "kernel": "python3",
     "files": {...}, "fetch_files": [...]}

and its output is SandboxFusion's RunJupyterResponse, plus what became of the kernel::

    {"status", "message", "driver": {CommandRunResult}, "executor_pod_name", "files",
     "cells": [{"stdout", "stderr", "display": [{"text/plain": "2"}],
                "error": [{"ename", "evalue", "traceback"}],
                "status": "ok"|"error"|"timeout"|"died", "execution_count", "truncated"}],
     "kernel": {"id", "started", "restarted", "note"}}
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import msgpack

from ..errors import TangramError
from . import env_layers
from .fs_inside import EnvError, read_inside, size_inside, _parts as relative_parts  # the rule the worker writes files by

__all__ = ["RunCodeRequest", "RunCodeError", "LANGUAGES", "RUN_CODE_FIELDS", "MAX_TIMEOUT_S",
           "parse_run_code", "is_run_code", "command_result", "response", "utf8",
           "RunJupyterRequest", "RUN_JUPYTER_FIELDS", "is_run_jupyter", "parse_run_jupyter", "fetch_files",
           "FetchTooLarge"]

CODE_DIR = ".run_code"

#: Directories on the sandbox's PATH (bubblewrap shows them read-only), where a
#: language's tool must be: a tool only on the worker's own PATH, such as a
#: rustup install in the home directory, is invisible inside the sandbox.
SANDBOX_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The longest compile or run timeout a request may ask for.
MAX_TIMEOUT_S = 86400.0
_MAX_MEMORY_MB = 1 << 20


@dataclass(frozen=True)
class _Lang:
    filename: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    needs: str | None = None  # binary that must exist on the worker


# The Go build cache must be writable; /tmp is the sandbox's private tmpfs, so a
# throw-away environment leaves nothing behind (HOME is the environment itself).
_GO_ENV = ("env", "GOCACHE=/tmp/go-cache", "GOPATH=/tmp/go")

#: language -> how to run it; ``{src}`` is the code file, ``{exe}`` the binary.
#: The names are SandboxFusion's (its ``Language`` literal); see docs/frameworks.md
#: for the ones it has and tangram-hpc does not.
LANGUAGES: dict[str, _Lang] = {
    "python": _Lang("main.py", ("python", "{src}")),
    "pytest": _Lang("test_main.py", ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{src}")),
    "bash": _Lang("main.sh", ("bash", "{src}"), needs="bash"),
    "cpp": _Lang("main.cpp", ("{exe}",), ("g++", "-O2", "-std=c++17", "-o", "{exe}", "{src}"), "g++"),
    "go": _Lang("main.go", ("{exe}",), (*_GO_ENV, "go", "build", "-o", "{exe}", "{src}"), "go"),
    "rust": _Lang("main.rs", ("{exe}",), ("rustc", "-O", "-o", "{exe}", "{src}"), "rustc"),
    "java": _Lang("Main.java", ("java", "-ea", "-cp", CODE_DIR, "Main"), ("javac", "-d", CODE_DIR, "{src}"),
                  "javac"),
    "nodejs": _Lang("main.js", ("node", "{src}"), needs="node"),
    "perl": _Lang("main.pl", ("perl", "{src}"), needs="perl"),
    "ruby": _Lang("main.rb", ("ruby", "{src}"), needs="ruby"),
    "lua": _Lang("main.lua", ("lua", "{src}"), needs="lua"),
    "R": _Lang("main.R", ("Rscript", "{src}"), needs="Rscript"),
    "julia": _Lang("main.jl", ("julia", "{src}"), needs="julia"),
    "php": _Lang("main.php", ("php", "{src}"), needs="php"),
}

#: Every key a run_code payload may have (SandboxFusion's request, plus
#: ``args`` for pytest and ``template`` for the environment's first action).
RUN_CODE_FIELDS = frozenset({"language", "code", "stdin", "files", "fetch_files", "compile_timeout",
                             "run_timeout", "memory_limit_MB", "args", "template"})


class RunCodeError(TangramError, ValueError):
    """A run_code request field that does not follow the schema; ``field`` names it."""

    def __init__(self, field_name: str, problem: str, value: Any = None, kind: str = "value_error"):
        self.field = field_name
        self.problem = problem
        self.value = value
        self.kind = kind  # "missing", "literal_error" or "value_error", as pydantic names them
        super().__init__(f"{field_name}: {problem}")


@dataclass
class RunCodeRequest:
    language: str
    code: str
    stdin: bytes | None
    files: dict[str, bytes]
    fetch_files: list[str]
    compile_timeout: float
    run_timeout: float
    memory_mb: int | None
    args: list[str]
    template: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def source_path(self) -> str:
        """Where the code is written, relative to the environment."""
        return f"{CODE_DIR}/{LANGUAGES[self.language].filename}"

    def argvs(self) -> tuple[list[str] | None, list[str]]:
        lang = LANGUAGES[self.language]
        src = f"{CODE_DIR}/{lang.filename}"
        exe = f"./{CODE_DIR}/main"
        sub = lambda argv: [a.format(src=src, exe=exe) for a in argv]
        compile_argv = sub(lang.compile) if lang.compile else None
        run = sub(lang.run)
        if self.language == "pytest":
            run += self.args
        return compile_argv, run


def is_run_code(payload: Any) -> bool:
    return isinstance(payload, Mapping) and "code" in payload and "language" in payload and "cmd" not in payload


def parse_run_code(p: Mapping[str, Any], *, check_tools: bool = True) -> RunCodeRequest:
    """Validate a run_code payload; raises :class:`RunCodeError` naming the first bad field.

    ``check_tools``: also refuse a language whose tool this machine lacks (the
    worker's check; ``serve`` runs beside the coordinator and cannot know).
    """
    unknown = set(p) - RUN_CODE_FIELDS
    if unknown:
        name = sorted(map(str, unknown))[0]
        raise RunCodeError(name, f"unknown run_code field; known: {', '.join(sorted(RUN_CODE_FIELDS))}",
                           kind="extra_forbidden")
    if "language" not in p:
        raise RunCodeError("language", "field required", kind="missing")
    lang = p["language"]
    if not isinstance(lang, str) or lang not in LANGUAGES:
        raise RunCodeError("language", f"unsupported language {lang!r}; supported: {', '.join(LANGUAGES)}",
                           lang, kind="literal_error")
    if check_tools:
        needs = LANGUAGES[lang].needs
        if needs and shutil.which(needs, path=SANDBOX_TOOL_PATH) is None:
            raise RunCodeError("language", f"language {lang!r} needs {needs!r}, which is not installed in "
                                           f"the system directories this worker's sandboxes see (as root, "
                                           f"scripts/setup-env.sh --languages installs the toolchains)", lang)
    if "code" not in p:
        raise RunCodeError("code", "field required", kind="missing")
    code = p["code"]
    if not isinstance(code, str):
        raise RunCodeError("code", f"must be a string, got {_type(code)}", code)
    utf8("code", code)
    stdin = p.get("stdin")
    if isinstance(stdin, str):
        stdin = utf8("stdin", stdin)
    elif isinstance(stdin, (bytes, bytearray)):  # msgpack callers may send bytes
        stdin = bytes(stdin)
    elif stdin is not None:
        raise RunCodeError("stdin", f"must be a string or null, got {_type(stdin)}", stdin)
    template = p.get("template")
    if template is not None and (not isinstance(template, str) or not template):
        raise RunCodeError("template", f"must be a template name, got {_type(template)}", template)
    if template is not None:
        utf8("template", template)
    mem = _memory_mb(p.get("memory_limit_MB", -1))
    return RunCodeRequest(
        language=lang, code=code, stdin=stdin or None, files=_files(p.get("files")),
        fetch_files=[_inside("fetch_files", name) for name in _strings(p, "fetch_files")],
        compile_timeout=_timeout(p, "compile_timeout"), run_timeout=_timeout(p, "run_timeout"),
        memory_mb=mem, args=_strings(p, "args"), template=template,
    )


def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _timeout(p: Mapping[str, Any], name: str) -> float:
    v = p.get(name, 10)
    if not _number(v) or not math.isfinite(v) or not 0 < v <= MAX_TIMEOUT_S:
        raise RunCodeError(name, f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {v!r}", v)
    return float(v)


def _memory_mb(v: Any) -> int | None:
    # SandboxFusion: -1 (or any value <= 0) means no limit.
    if not _number(v) or not math.isfinite(v) or v != int(v) or v > _MAX_MEMORY_MB:
        raise RunCodeError("memory_limit_MB", f"must be a whole number of MiB up to {_MAX_MEMORY_MB} "
                                              f"(-1: no limit), got {v!r}", v)
    return int(v) if v > 0 else None


def _strings(p: Mapping[str, Any], name: str) -> list[str]:
    v = p.get(name)
    if v is None:
        return []
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise RunCodeError(name, f"must be a list of strings, got {_type(v)}", v)
    for s in v:
        utf8(name, s)
    return list(v)


def utf8(name: str, text: str) -> bytes:
    """``text`` as UTF-8; JSON can carry lone surrogates (``"\\ud800"``), which have no encoding."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise RunCodeError(name, f"must be valid Unicode text: {exc.reason} at position {exc.start}",
                           text[max(0, exc.start - 20):exc.end + 20]) from None


def _inside(name: str, rel: str) -> str:
    """``rel`` if it names a path inside the environment."""
    utf8(name, rel)
    try:
        relative_parts(rel)
    except EnvError as exc:
        raise RunCodeError(name, str(exc), rel) from None
    return rel


def _files(v: Any) -> dict[str, bytes]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise RunCodeError("files", f"must be a map from file path to base64 content, got {_type(v)}", v)
    files: dict[str, bytes] = {}
    for name, b64 in v.items():
        if not isinstance(name, str) or not name:
            raise RunCodeError("files", f"file paths must be non-empty strings, got {name!r}")
        _inside("files", name)
        if b64 is None:  # SandboxFusion allows null content: the file is skipped
            continue
        if not isinstance(b64, str):
            raise RunCodeError(f"files.{name}", f"must be base64 text, got {_type(b64)}")
        try:
            files[name] = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RunCodeError(f"files.{name}", f"is not base64: {exc}") from None
    return files


def command_result(res: Any) -> dict:
    """SandboxFusion's CommandRunResult for one finished step (a ``process.ProcResult``).

    ``cpu_time`` is the user+system CPU seconds of the step's process tree when
    the process layer measures it, else None (never a guess).
    """
    cpu = getattr(res, "cpu_time", None)
    return {
        "status": "TimeLimitExceeded" if res.timed_out else "Finished",
        "execution_time": round(res.wall_s, 6),
        "cpu_time": None if cpu is None else round(cpu, 6),
        "return_code": res.returncode,
        "stdout": res.text("stdout"),
        "stderr": res.text("stderr"),
    }


def response(compile_result: dict | None, run_result: dict | None, files: dict[str, bytes],
             error: str | None = None) -> dict:
    """SandboxFusion's RunCodeResponse for the given command results."""
    status, message = "Success", ""
    results = [r for r in (compile_result, run_result) if r is not None]
    if error is not None:
        status, message = "SandboxError", error
    elif any(r["status"] != "Finished" or r["return_code"] != 0 for r in results):
        status = "Failed"
    return {
        "status": status,
        "message": message,
        "compile_result": compile_result,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": {k: base64.b64encode(v).decode() for k, v in files.items()},
    }


# -- run_jupyter: cells in the environment's kernel ------------------------------------------------

#: Every key a run_jupyter payload may have (SandboxFusion's request, plus ``template``).
RUN_JUPYTER_FIELDS = frozenset({"cells", "cell_timeout", "total_timeout", "kernel", "files", "fetch_files",
                                "template"})
KERNELS = ("python3",)
#: Seconds the kernel driver may run beyond ``total_timeout``: starting the kernel, and killing a cell
#: that ignores its interrupt (pykernel.KILL_GRACE_S).
DRIVER_GRACE_S = 15.0
_KERNEL_SOURCE = Path(__file__).with_name("pykernel.py")


def is_run_jupyter(payload: Any) -> bool:
    return isinstance(payload, Mapping) and "cells" in payload and "cmd" not in payload and "code" not in payload


@dataclass
class RunJupyterRequest:
    cells: list[str]
    cell_timeout: float
    total_timeout: float
    files: dict[str, bytes]
    fetch_files: list[str]
    template: str | None = None

    def driver(self, output_bytes: int, output_kill_bytes: int) -> RunCodeRequest:
        """The run_code step that runs the cells: the kernel's driver (``pykernel.py``, written into
        the environment) with the request on its stdin; its stdout must fit ``output_bytes``."""
        stdin = json.dumps({"cells": self.cells, "cell_timeout": self.cell_timeout,
                            "total_timeout": self.total_timeout, "output_bytes": output_bytes,
                            "output_kill_bytes": output_kill_bytes}).encode()
        return _KernelDriver(language="python", code=_KERNEL_SOURCE.read_text(), stdin=stdin, files=self.files,
                             fetch_files=self.fetch_files, compile_timeout=MAX_TIMEOUT_S,
                             run_timeout=self.total_timeout + DRIVER_GRACE_S, memory_mb=None, args=[],
                             template=self.template)

    @staticmethod
    def response(run_code_response: dict | None, error: str | None = None) -> dict:
        """SandboxFusion's RunJupyterResponse from the driver's RunCodeResponse: its stdout holds the
        cells' results; status Success when the driver finished within the total timeout."""
        resp = run_code_response or response(None, None, {}, error or "the kernel driver did not run")
        run = resp.get("run_result")
        out = {"status": resp["status"], "message": resp["message"], "driver": None, "cells": [],
               "executor_pod_name": resp.get("executor_pod_name"), "files": resp.get("files", {}), "kernel": None}
        if run is None:
            return out
        driver = dict(run, stdout="")
        try:
            doc = json.loads(run["stdout"]) if run["status"] == "Finished" and run["return_code"] == 0 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if run["status"] == "Finished":   # past its time limit it is Failed, as in SandboxFusion
                out["status"], out["message"] = "SandboxError", "the kernel driver gave no result: " + \
                    (run.get("stderr") or "").strip()[-2000:]
        else:
            out["cells"], out["kernel"] = doc.get("cells", []), doc.get("kernel")
            if doc.get("timed_out"):
                driver["status"] = "TimeLimitExceeded"
                out["status"] = "Failed"
        out["driver"] = driver
        return out


@dataclass
class _KernelDriver(RunCodeRequest):
    def source_path(self) -> str:
        return f"{CODE_DIR}/kernel.py"

    def argvs(self) -> tuple[list[str] | None, list[str]]:
        # -I -S: the driver needs the standard library only, and starts faster without site-packages;
        # the kernel it starts runs with them, so cells import the environment's packages.
        return None, ["python", "-I", "-S", self.source_path()]


def parse_run_jupyter(p: Mapping[str, Any]) -> RunJupyterRequest:
    """Validate a run_jupyter payload; raises :class:`RunCodeError` naming the first bad field."""
    unknown = set(p) - RUN_JUPYTER_FIELDS
    if unknown:
        name = sorted(map(str, unknown))[0]
        raise RunCodeError(name, f"unknown run_jupyter field; known: {', '.join(sorted(RUN_JUPYTER_FIELDS))}",
                           kind="extra_forbidden")
    cells = p.get("cells")
    if not isinstance(cells, (list, tuple)) or not all(isinstance(c, str) for c in cells):
        raise RunCodeError("cells", f"must be a list of strings, got {_type(cells)}", cells)
    for c in cells:
        utf8("cells", c)
    kernel = p.get("kernel", "python3")
    if kernel not in KERNELS:
        raise RunCodeError("kernel", f"unsupported kernel {kernel!r}; supported: {', '.join(KERNELS)}", kernel,
                           kind="literal_error")
    cell_timeout = p.get("cell_timeout", 0)
    if not _number(cell_timeout) or not math.isfinite(cell_timeout) or not 0 <= cell_timeout <= MAX_TIMEOUT_S:
        raise RunCodeError("cell_timeout", f"must be a number of seconds in [0, {MAX_TIMEOUT_S:g}] "
                                           f"(0: only the total timeout), got {cell_timeout!r}", cell_timeout)
    total = p.get("total_timeout", 45)
    if not _number(total) or not math.isfinite(total) or not 0 < total <= MAX_TIMEOUT_S:
        raise RunCodeError("total_timeout", f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {total!r}",
                           total)
    template = p.get("template")
    if template is not None and (not isinstance(template, str) or not template):
        raise RunCodeError("template", f"must be a template name, got {_type(template)}", template)
    return RunJupyterRequest(cells=list(cells), cell_timeout=float(cell_timeout), total_timeout=float(total),
                             files=_files(p.get("files")),
                             fetch_files=[_inside("fetch_files", name) for name in _strings(p, "fetch_files")],
                             template=template)


# -- fetch_files ------------------------------------------------------------------------------------

#: What a result holds besides outputs and fetched files (field names, numbers, the error text).
_RESULT_OVERHEAD = 16 << 10


class FetchTooLarge(TangramError):
    """Files asked for that no result could carry."""


def fetch_files(env_path: Path, attempt: Path | None, names: list[str], without: dict,
                result_bytes: int) -> dict[str, bytes]:
    """The files ``names`` of the environment at ``env_path`` as its attempt left them (those that
    are regular files), when the result ``without`` them plus their sizes fits ``result_bytes``;
    else :class:`FetchTooLarge`, before any is read.

    Sizes, not blocks: a sparse file of 1 GiB holds nothing on disk but reads as 1 GiB.  Files
    go into the response base64-encoded (4 bytes for 3)."""
    room = (result_bytes - len(msgpack.packb(without, use_bin_type=True)) - _RESULT_OVERHEAD) * 3 // 4
    sizes: dict[str, int] = {}
    roots: dict[str, Path] = {}
    for name in dict.fromkeys(names):
        root = env_path if attempt is None else env_layers.layered_root(attempt / "upper", env_path, name)
        size = size_inside(root, name) if root is not None else None
        if size is None:
            continue
        if size > room:
            raise FetchTooLarge(f"fetch_files: {name!r} holds {size} bytes, more than the {max(room, 0)} "
                                f"bytes a result can carry (the worker's result limit is "
                                f"{result_bytes} bytes, files go base64-encoded); nothing was fetched")
        sizes[name] = size
        roots[name] = root
    total = sum(sizes.values())
    if total > room:
        raise FetchTooLarge(f"fetch_files: the {len(sizes)} files hold {total} bytes together, more than the "
                            f"{max(room, 0)} bytes a result can carry (the worker's result limit is "
                            f"{result_bytes} bytes, files go base64-encoded); nothing was fetched")
    fetched: dict[str, bytes] = {}
    for name, size in sizes.items():
        data = read_inside(roots[name], name, size)   # never more than was counted
        if data is not None:
            fetched[name] = data
    return fetched
