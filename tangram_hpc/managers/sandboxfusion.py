"""SandboxFusion-compatible ``run_code`` requests and responses.

A payload with ``language`` and ``code`` (and no ``cmd``) is a SandboxFusion
``/run_code`` request::

    {"language": "python", "code": "print(1)", "stdin": "", "files": {"a.txt": "<base64>"},
     "fetch_files": ["out.txt"], "compile_timeout": 10, "run_timeout": 10,
     "memory_limit_MB": -1, "args": []}

and the action's output is SandboxFusion's response::

    {"status": "Success"|"Failed"|"SandboxError", "message": "",
     "compile_result": None | {...}, "run_result": {"status": "Finished"|"Error"|"TimeLimitExceeded",
     "execution_time": 0.05, "return_code": 0, "stdout": "1\\n", "stderr": ""},
     "executor_pod_name": None, "files": {"out.txt": "<base64>"}}

As in SandboxFusion, ``files`` values and fetched files are base64.  The code
is written to ``.run_code/`` in the environment and run from the
environment directory, so files it writes stay for the next action.
"""
from __future__ import annotations

import base64
import binascii
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["RunCodeRequest", "LANGUAGES", "parse_run_code", "command_result", "response"]

CODE_DIR = ".run_code"


@dataclass(frozen=True)
class _Lang:
    filename: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    needs: str | None = None  # binary that must exist on the worker


#: language -> how to run it; ``{src}`` is the code file, ``{exe}`` the binary.
LANGUAGES: dict[str, _Lang] = {
    "python": _Lang("main.py", ("python", "{src}")),
    "pytest": _Lang("test_main.py", ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{src}")),
    "bash": _Lang("main.sh", ("bash", "{src}"), needs="bash"),
    "cpp": _Lang("main.cpp", ("{exe}",), ("g++", "-O2", "-std=c++17", "-o", "{exe}", "{src}"), "g++"),
    "go": _Lang("main.go", ("{exe}",), ("go", "build", "-o", "{exe}", "{src}"), "go"),
    "rust": _Lang("main.rs", ("{exe}",), ("rustc", "-O", "-o", "{exe}", "{src}"), "rustc"),
    "java": _Lang("Main.java", ("java", "-cp", CODE_DIR, "Main"), ("javac", "-d", CODE_DIR, "{src}"), "javac"),
    "nodejs": _Lang("main.js", ("node", "{src}"), needs="node"),
    "perl": _Lang("main.pl", ("perl", "{src}"), needs="perl"),
    "ruby": _Lang("main.rb", ("ruby", "{src}"), needs="ruby"),
    "lua": _Lang("main.lua", ("lua", "{src}"), needs="lua"),
    "R": _Lang("main.R", ("Rscript", "{src}"), needs="Rscript"),
    "julia": _Lang("main.jl", ("julia", "{src}"), needs="julia"),
    "php": _Lang("main.php", ("php", "{src}"), needs="php"),
}


class RunCodeError(ValueError):
    pass


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


def parse_run_code(p: Mapping[str, Any]) -> RunCodeRequest:
    lang = p.get("language")
    if lang not in LANGUAGES:
        raise RunCodeError(f"unsupported language {lang!r}; supported: {', '.join(LANGUAGES)}")
    needs = LANGUAGES[lang].needs
    if needs and shutil.which(needs) is None:
        raise RunCodeError(f"language {lang!r} needs {needs!r}, which this worker does not have")
    code = p.get("code")
    if not isinstance(code, str):
        raise RunCodeError("run_code: code must be a string")
    files: dict[str, bytes] = {}
    for name, b64 in (p.get("files") or {}).items():
        if b64 is None:
            continue
        try:
            files[str(name)] = base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise RunCodeError(f"run_code: files[{name!r}] is not base64: {exc}") from exc
    stdin = p.get("stdin")
    mem = p.get("memory_limit_MB", -1)
    return RunCodeRequest(
        language=lang, code=code,
        stdin=stdin.encode() if isinstance(stdin, str) else (bytes(stdin) if stdin else None),
        files=files, fetch_files=[str(f) for f in (p.get("fetch_files") or [])],
        compile_timeout=float(p.get("compile_timeout", 10)), run_timeout=float(p.get("run_timeout", 10)),
        memory_mb=int(mem) if mem and mem > 0 else None, args=[str(a) for a in (p.get("args") or [])],
        template=p.get("template"),
    )


def command_result(*, timed_out: bool, returncode: int | None, stdout: str, stderr: str,
                   wall_s: float) -> dict:
    return {
        "status": "TimeLimitExceeded" if timed_out else "Finished",
        "execution_time": round(wall_s, 6),
        "return_code": returncode,
        "stdout": stdout,
        "stderr": stderr,
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
