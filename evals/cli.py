"""The evals' command-line entry: tyro parses the Args, and a user error is one line, not a traceback."""

import sys

import tyro


def cli(main, args_type, prog: str) -> None:
    """Run an eval entry point from the command line: a user error (a missing file, folder or package, a bad
    setting) ends the process with one line on stderr and exit status 1, not a traceback."""
    try:
        main(tyro.cli(args_type))
    except (OSError, ValueError, ImportError) as e:  # what missing inputs and bad settings raise; bugs still trace
        sys.exit(f"{prog}: error: {e}")
