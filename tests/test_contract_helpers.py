"""The arrays records hand their kernels: constants keep the caller's values, shapes and dtypes, padded or not."""

from __future__ import annotations

import numpy as np
import pytest

from tensorfold_contract.helpers import PAD_ENV, int_array, kernel_array


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
