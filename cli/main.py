"""The command's entry point: the subcommand named first (``generate`` when none is)."""

from __future__ import annotations

import os
import sys

SUBCOMMANDS = ("generate", "serve", "compile", "convert", "plan")
USAGE = """grok-runner: serve and run Grok-1 and Grok-2 style mixture-of-experts models with JAX.

    grok-runner [generate] [--prompt TEXT] ...   stream continuations (the default subcommand)
    grok-runner serve [--checkpoint DIR] ...     the OpenAI-compatible HTTP server
    grok-runner compile [serve's flags]          serve's steps compiled into its store, from the headers alone
    grok-runner convert SRC DST                  a checkpoint (ckpt-0/ with --config, Hugging Face) to the native format
    grok-runner plan --preset grok-1 --mesh 1,8  the per-device memory plan

Without --checkpoint, the model shipped with the package (austen-moe) is used."""


def main(argv=None) -> int:
    """Run a subcommand (``generate`` when none is named); the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "grok-runner"
    if prog.endswith("__main__.py"):
        prog = "grok-runner"
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    if command is not None:
        argv = argv[1:]
    elif argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        print("\ngenerate's flags follow (grok-runner SUBCOMMAND --help for the others):\n")
    if "--plan" in argv and command is None:  # ``run.py --plan ...``, as before the subcommand
        argv = [a for a in argv if a != "--plan"]
        command = "plan"
    if command == "serve":
        from cli.serve import serve
        return serve(argv, f"{prog} serve")
    if command == "compile":
        from cli.compile import compile_ahead
        return compile_ahead(argv, f"{prog} compile")
    if command == "convert":
        from cli.convert import convert
        return convert(argv, f"{prog} convert")
    if command == "plan":
        from cli.plan import plan
        return plan(argv, f"{prog} plan")
    from cli.generate import generate
    return generate(argv, prog if command is None else f"{prog} generate")
