"""A lone greedy stream per family with and without lookahead on this machine: ids compared, a hang shows its stack."""

from __future__ import annotations

import faulthandler
import sys
import time

from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model
from tensorfold_core.testing import Run


def main() -> int:
    bad = 0
    for name in sys.argv[1:] or ["tiny-llama", "tiny-lfm2", "tiny-lfm2-moe", "tiny-lfm2-moe-4bit"]:
        model = load_model(name)[0]
        model.reads_on_host = False  # run ahead even where the family says its forward reads on the host
        request = GenerationRequest(prompt_ids=list(range(30, 70)), max_tokens=48, draft=False)
        ids = {}
        for lookahead in (False, True, False, True):
            faulthandler.dump_traceback_later(60, exit=True)  # a hang: every thread's stack, then exit
            run = Run(model, 1, chunk=256, lookahead=lookahead)
            run.submit(0, request)
            start = time.perf_counter()
            run.finish()
            took = time.perf_counter() - start
            faulthandler.cancel_dump_traceback_later()
            ids.setdefault(lookahead, run.tokens(0))
            print(f"{name:20} {'ahead' if lookahead else 'step ':5} {48 / took:7.1f} tok/s  used "
                  f"{run.engine.ahead.used:3}  same ids {run.tokens(0) == ids[False]}", flush=True)
        bad += ids[True] != ids[False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
