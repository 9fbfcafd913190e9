"""run_code programs of the languages SandboxFusion's verl recipes use; each prints twice its stdin."""
from __future__ import annotations

import shutil

from tangram_hpc.managers import sandboxfusion as sf

LANGUAGE_PROGRAMS = {
    "python": "print(int(input()) * 2)",
    "bash": "read x; echo $((x * 2))",
    "nodejs": "const x = require('fs').readFileSync(0, 'utf8'); console.log(parseInt(x) * 2);",
    "cpp": "#include <iostream>\nint main(){long x; std::cin >> x; std::cout << x * 2 << std::endl;}",
    "java": ("import java.util.Scanner;\npublic class Main { public static void main(String[] a) {"
             " System.out.println(new Scanner(System.in).nextLong() * 2); } }"),
    "go": 'package main\nimport "fmt"\nfunc main() { var x int; fmt.Scan(&x); fmt.Println(x * 2) }',
    "rust": ("use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)"
             ".unwrap(); let x: i64 = s.trim().parse().unwrap(); println!(\"{}\", x * 2); }"),
}


def missing_tool(language: str) -> str | None:
    """The tool a language needs that the sandbox cannot see (scripts/setup-env.sh installs them as root)."""
    needs = sf.LANGUAGES[language].needs
    return needs if needs and shutil.which(needs, path=sf.SANDBOX_TOOL_PATH) is None else None
