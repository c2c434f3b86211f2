"""The CPU backend's two ways of running decodes, for its tests to choose from."""

from __future__ import annotations

import pytest

from vllmpy.ops import cpu_kernels


def use_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends made from here on run their decodes through PyTorch's ops (as without a C
    compiler), not the C kernels."""
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    monkeypatch.setattr(cpu_kernels, "status", lambda: "off for this test: PyTorch ops")


def require_kernels() -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip(f"CPU kernels: {cpu_kernels.status()}")


@pytest.fixture
def torch_ops(monkeypatch):
    use_torch_ops(monkeypatch)


@pytest.fixture(params=["C kernels", "torch ops"])
def cpu_path(request, monkeypatch):
    """Decodes through the C kernels, then through PyTorch's ops."""
    if request.param == "torch ops":
        use_torch_ops(monkeypatch)
    else:
        require_kernels()
    return request.param
