"""Command line: `python -m jax_kvxfer [demo|bench] [options]` (also the `jax-kvxfer` script).

With no subcommand, runs the demo. Each subcommand's options: `jax-kvxfer <command> --help`.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "multi-turn chat over an offloading KV cache, checked against a run that never evicts",
    "bench": "transfer bandwidth of the block-copy ops and the transfer manager",
}
_USAGE = "usage: jax-kvxfer [demo|bench] [options]   (jax-kvxfer <command> --help for options)"


def _help() -> str:
    lines = [_USAGE, "", "commands:"]
    lines += [f"  {name:<7}{text}" for name, text in COMMANDS.items()]
    lines += ["", "With no command, runs `demo`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatches to a subcommand's `main(argv)`; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "demo"
    if argv and not argv[0].startswith("-"):
        command = argv.pop(0)
    elif argv and argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    if command == "demo":
        from . import demo

        return demo.main(argv)
    if command == "bench":
        try:
            from . import bench
        except ImportError as e:
            if e.name != f"{__package__}.bench":
                raise
            print("jax-kvxfer: error: the bench command is not available in this build",
                  file=sys.stderr)
            return 2
        return bench.main(argv) or 0
    print(f"jax-kvxfer: error: unknown command {command!r} (choose from "
          f"{', '.join(COMMANDS)})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
