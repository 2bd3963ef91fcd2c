"""`python -m tensorfold_core` runs the CLI."""

from .cli import main

main()
