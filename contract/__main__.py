"""`python -m tensorfold_contract`: the contract without the server's dependencies."""

import sys

from .cli import main

sys.exit(main())
