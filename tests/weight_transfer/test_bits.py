"""Copies by bits equal numpy's own copies, for the serving dtypes, strided or not."""

import ml_dtypes
import numpy as np
import pytest

from jaxrl.weight_transfer.bits import contiguous, copy_into


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float32])
def test_bit_copies_equal_numpy_copies(dtype) -> None:
    rng = np.random.default_rng(0)
    src = rng.standard_normal((6, 8, 10)).astype(dtype)
    strided = src[:, ::2, 3:]
    out = contiguous(strided)
    assert out.flags.c_contiguous and out.dtype == src.dtype and np.array_equal(out, strided)
    dst = np.zeros((6, 8, 20), dtype)
    copy_into(dst[:, :, 5:15], src)
    expected = np.zeros_like(dst)
    expected[:, :, 5:15] = src
    assert np.array_equal(dst.view(np.uint8), expected.view(np.uint8))
    assert contiguous(src) is src or np.shares_memory(contiguous(src), src)  # no copy when there is nothing to do


def test_bits_are_kept_exactly_and_dtypes_must_agree() -> None:
    bits = np.array([0x7FC1, 0xFFFF, 0x8000, 0x0001], np.uint16)  # two NaN payloads, -0, a subnormal
    src = bits.view(ml_dtypes.bfloat16)
    dst = np.zeros(8, ml_dtypes.bfloat16)
    copy_into(dst[::2], src)
    assert np.array_equal(dst[::2].view(np.uint16), bits)
    with pytest.raises(ValueError, match="float32 into bfloat16"):
        copy_into(dst[:4], np.zeros(4, np.float32))
