"""Uploads give the tensor they were handed, on the device asked for (a GPU path, through
pinned memory, is checked by bench/check_cuda.py's Mirror checks on the H200)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.upload import upload, upload_list


def test_upload_list_keeps_values_and_dtype():
    out = upload_list([3, -1, 2**40], torch.int64, "cpu")
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 2**40]
    assert upload_list([1, 2], torch.int32, torch.device("cpu")).dtype == torch.int32


def test_upload_is_the_same_tensor_on_its_own_device():
    t = torch.arange(5)
    assert upload(t, "cpu") is t  # no copy where none is needed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_upload_to_gpu():
    t = torch.arange(100_000)
    out = upload(t, "cuda")
    assert out.is_cuda and torch.equal(out.cpu(), t)
