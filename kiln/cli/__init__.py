"""The `kiln` command line. Each command lives in its own module, whose add_parser(subparsers) adds
its parser with `main` set to the function that runs it: the product's commands in this package,
the tools (bench, compare, profile, quantize, synth: kiln/tools) on top of it, loaded by name.

Generated text goes to stdout as it is produced; statistics and progress go to stderr; user
mistakes end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib
import os
import sys

from .. import __version__
from ..errors import KilnError
from . import generate, models, serve, tune
from .flags import Parser

COMMANDS = (generate, models, serve, tune)
TOOLS = ("kiln.tools.bench", "kiln.tools.bench_serve", "kiln.tools.compare", "kiln.tools.pack", "kiln.tools.profile",
         "kiln.tools.quantize", "kiln.tools.synth")


def build_parser() -> Parser:
    parser = Parser(prog="kiln", description="kiln: LLM inference that compiles its kernels for your model")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (*COMMANDS, *map(importlib.import_module, TOOLS)):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.main(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not a user mistake: one line unless KILN_DEBUG asks for the trace
        if os.environ.get("KILN_DEBUG"):
            raise
        print(f"kiln: internal error: {type(e).__name__}: {e} (set KILN_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
