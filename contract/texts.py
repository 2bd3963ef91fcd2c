"""Every kernel text a record's cuda or metal implementation and its planted controls build, for host-side checks."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .gates import _kernel_name, make_case


def builds(record, kind: str, generated: Callable, quick: bool) -> Iterator[tuple[str, str, object]]:
    """(label, text, launch) for each distinct text `generated` writes for the record's `kind` source and its planted
    `kind` controls (gate 5's act on the launch, not the text) over its shapes that are not heavy: at one to the
    widest window's rows, or (`quick`) at the widest alone, on the first shape."""
    if kind not in record.implementations:
        return
    sources = [(kind, record.implementations[kind])]
    sources += [(f"control {c.name!r}", c.plant(record.implementations[kind])) for c in record.controls
                if c.kind == kind and c.gate != 5]
    seen = set()
    for label, source in sources:
        rows_list = [record.max_rows] if quick else sorted({1, 2, 3, 5, 9, record.max_rows})
        for shape in (s for s in (*record.shapes, *record.edges) if not s.heavy and s.rows > 0):
            for rows in rows_list:
                case = make_case(record, shape, min(rows, shape.rows) if quick else rows, np.random.default_rng(0))
                served = source.at(case)
                launch = served.launch(case)
                text = generated(served, _kernel_name(kind, served), served.inputs(case), launch)
                if text not in seen:
                    seen.add(text)
                    yield f"{record.name} [{label}] {dict(launch.template)}", text, launch
            if quick:
                break
