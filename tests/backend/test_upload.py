"""Uploads give the tensor they were handed, on the device asked for, and downloads bring
it back (the GPU paths, through pinned memory, also run in bench/check_cuda.py's Mirror
checks on the H200)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.upload import download, upload, upload_list


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


def test_download_on_the_host_is_the_tensor():
    t = torch.arange(5)
    assert download(t).get() is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_download_from_gpu_while_later_work_is_queued():
    t = torch.arange(100_000, device="cuda")
    back = download(t * 2)
    t.mul_(3)  # queued after the copy: not in what comes back
    got = back.get()
    assert not got.is_cuda and got.is_pinned()
    assert torch.equal(got, torch.arange(100_000) * 2)
