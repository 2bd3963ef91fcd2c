"""tensorfold core: lane engine, hookspecs, server, CLI, memory ledger and prompt cache."""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tensorfold")
