"""When the Triton kernels launch with programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

from vllmpy.ops import pdl


@pytest.fixture(autouse=True)
def fresh_cache():
    pdl._supported.cache_clear()
    yield
    pdl._supported.cache_clear()


def test_off_on_the_cpu():
    # the interpreter has no grid dependency control: the kernels get PDL=False, and no
    # launch_pdl argument at all
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}


def test_the_environment_turns_it_off_before_asking_the_device(monkeypatch):
    monkeypatch.setenv("VT_TRITON_PDL", "0")
    # no CUDA query happens (none would succeed on a machine without a GPU)
    assert pdl.pdl_args(torch.device("cuda")) == {"PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_for_hopper_and_newer():
    dev = torch.device("cuda")
    new_enough = (torch.version.hip is None
                  and torch.cuda.get_device_capability(dev) >= (9, 0))
    expected = {"PDL": True, "launch_pdl": True} if new_enough else {"PDL": False}
    assert pdl.pdl_args(dev) == expected
