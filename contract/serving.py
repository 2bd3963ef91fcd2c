"""A record's implementation called on live arrays by a serving forward: the same code the gates prove, no fill."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .gates import _kernel_name
from .kernel_text import build
from .record import Source

_KERNELS: dict = {}  # (kind, source name, body hash, dynamic shared bytes) -> the built mx.fast kernel


class ServedCall:
    """One call's inputs as a record's implementations read them: `rows`, `dims`, `array(name)`, `case[name]`."""

    def __init__(self, rows: int, dims: Mapping[str, Any], arrays: Mapping[str, Any]):
        self.rows, self._dims, self._arrays = rows, dims, dict(arrays)

    @property
    def dims(self) -> Mapping[str, Any]:
        return self._dims

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self._arrays[name])

    def array(self, name: str, dtype=None):
        """The input as an mx.array, cast to `dtype` when given (a no-op when it already is)."""
        import mlx.core as mx

        value = self._arrays[name]
        value = value if isinstance(value, mx.array) else mx.array(value)
        return value if dtype is None or value.dtype == dtype else value.astype(dtype)


def _kernel(kind: str, source: Source, dynamic_shared: int):
    key = (kind, source.name, hash(source.body), hash(source.header), dynamic_shared)
    if key not in _KERNELS:
        # named by its text, as the gates name theirs: MLX caches compiled kernels by name, on disk too, so a name
        # that outlived an edit of the text would serve the old build
        _KERNELS[key] = build(kind, _kernel_name(kind, source), source.input_names, source.output_names,
                              source.body, source.header, dynamic_shared)
    return _KERNELS[key]


def call(kind: str, implementation, served: ServedCall) -> dict:
    """Run one implementation of a record on a served call (lazily, as any MLX op): its outputs by name."""
    import mlx.core as mx

    if not isinstance(implementation, Source):
        return implementation(served)
    implementation = implementation.at(served)
    launch = implementation.launch(served)
    if 0 in launch.grid:
        outs = [mx.zeros(shape, dtype) for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)]
    else:
        kernel = _kernel(kind, implementation, launch.dynamic_shared)
        outs = kernel(inputs=implementation.inputs(served), template=list(launch.template), grid=launch.grid,
                      threadgroup=launch.threadgroup, output_shapes=list(launch.output_shapes),
                      output_dtypes=list(launch.output_dtypes))
    return implementation.outputs(list(outs), served)


class Prepared:
    """One implementation bound to a serving module: built once, and for each row count its launch and the arrays
    that do not change worked out once, so that a call is one kernel launch (no ServedCall, Launch or dims array).

    `fixed()` gives the module's own arrays (weights) by input name, read at every call, so new weights are served;
    `row_input` names the per-row input, and a call may pass other per-call inputs by name (a residual; those named
    in `per_call` must reach the kernel as passed). An input the implementation makes itself (a dims array) is kept
    per row count; where it casts or reshapes the row input or a `per_call` one, every call goes through its
    `inputs` again."""

    def __init__(self, kind: str, implementation, dims: Mapping[str, Any], fixed: Callable[[], Mapping[str, Any]],
                 row_input: str, per_call: tuple[str, ...] = ()):
        self.kind, self.implementation, self.dims, self.fixed, self.row_input = \
            kind, implementation, dims, fixed, row_input
        self.per_call = per_call
        self._plans: dict[int, tuple] = {}

    def __call__(self, x, **more) -> dict:
        """The implementation's outputs by name for the rows of `x` (lazily, as any MLX op)."""
        arrays = {**self.fixed(), self.row_input: x, **more}
        if not isinstance(self.implementation, Source):
            return self.implementation(ServedCall(x.shape[0], self.dims, arrays))
        plan = self._plans.get(x.shape[0])
        if plan is None:
            plan = self._plans[x.shape[0]] = self._plan(x, arrays)
        kernel, slots, made, launch = plan
        if kernel is None:
            return call(self.kind, self.implementation, ServedCall(x.shape[0], self.dims, arrays))
        inputs = [arrays[name] if name is not None else array for name, array in zip(slots, made)]
        outs = kernel(inputs=inputs, **launch)
        return dict(zip(self.implementation.output_names, outs))

    def _plan(self, x, arrays) -> tuple:
        """(kernel, input names, made inputs, launch arguments); kernel None: call through `call` each time."""
        import mlx.core as mx

        source, served = self.implementation, ServedCall(x.shape[0], self.dims, arrays)
        launch = source.launch(served)
        inputs = source.inputs(served)
        by_id = {id(array): name for name, array in arrays.items()}
        slots = [by_id.get(id(array)) for array in inputs]
        if 0 in launch.grid or source.finish is not None or any(name not in slots
                                                                 for name in (self.row_input, *self.per_call)):
            return None, (), (), {}
        made = [None if name is not None else array for name, array in zip(slots, inputs)]
        mx.eval([array for array in made if array is not None])  # kept for every later call, on any thread (kept_array)
        return (_kernel(self.kind, source, launch.dynamic_shared), slots, made,
                dict(template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                     output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes)))
