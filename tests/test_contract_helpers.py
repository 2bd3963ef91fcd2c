"""The arrays records hand their kernels: constants keep the caller's values, shapes and dtypes, padded or not."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract.helpers import PAD_ENV, int_array, kept_array, kernel_array


@pytest.mark.parametrize("pad", ["1", "0"])
@pytest.mark.parametrize("values, dtype", [([], "int32"), ([7], "int32"), ([3, 5], "int32"), ([0.125], "float32"),
                                           (list(range(6)), "int32"), ([[1, 2, 3], [4, 5, 6]], "int32"),
                                           ([2 ** 40], "uint64")])
def test_a_kernel_constant_reads_as_the_values_it_was_made_from(monkeypatch, pad, values, dtype):
    monkeypatch.setenv(PAD_ENV, pad)
    made = kernel_array(values, dtype)
    want = np.asarray(values, dtype=dtype)
    assert made.shape == want.shape and np.array(made).dtype == want.dtype
    assert np.array_equal(np.array(made), want)


def test_sizes_are_int32_whatever_the_values_came_as():
    sizes = int_array((np.int64(4), 2048))
    assert np.array(sizes).dtype == np.int32 and np.array(sizes).tolist() == [4, 2048]


def _read_on_another_thread(array) -> object:
    """`array`'s values as a fresh thread reads them (the server's engine thread reads what its loading thread made)."""
    read: dict = {}

    def run():
        try:
            read["values"] = np.array(array + 0).tolist()
        except RuntimeError as error:
            read["values"] = error
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return read["values"]


def test_a_kept_constant_made_on_one_thread_reads_on_another(monkeypatch):
    monkeypatch.setenv(PAD_ENV, "1")
    assert _read_on_another_thread(kept_array([3, 5], "int32")) == [3, 5]
    # why kept_array exists: the padded constant is an unevaluated view, bound to the stream of the thread that made it
    assert isinstance(_read_on_another_thread(kernel_array([3, 5], "int32")), RuntimeError)


def test_the_constants_kernels_cache_across_calls_read_on_any_thread():
    from tensorfold_core.row_kernels.attention import _scale
    from tensorfold_dspark.kernels.block_attention import _small

    assert _read_on_another_thread(_scale(0.375)) == [0.375]
    assert _read_on_another_thread(_small((4, 8, 2), "int32")) == [4, 8, 2]
