"""Start-up kernels compiled in worker processes (vllmpy.ops.precompile)."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from vllmpy.ops.precompile import (
    DEFAULT_MAX_WORKERS,
    KernelCompiler,
    KernelVariant,
    default_num_workers,
)


def test_worker_count_from_the_environment(monkeypatch):
    monkeypatch.setenv("VT_COMPILE_WORKERS", "3")
    assert default_num_workers() == 3
    monkeypatch.setenv("VT_COMPILE_WORKERS", "0")
    assert default_num_workers() == 0
    monkeypatch.setenv("VT_COMPILE_WORKERS", "-1")
    with pytest.raises(ValueError, match="VT_COMPILE_WORKERS must be 0 or more"):
        default_num_workers()
    monkeypatch.setenv("VT_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="VT_COMPILE_WORKERS='many' is not an integer"):
        default_num_workers()
    monkeypatch.delenv("VT_COMPILE_WORKERS")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert default_num_workers() == DEFAULT_MAX_WORKERS
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_num_workers() == 0  # no spare core: no workers


def test_at_least_one_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        KernelCompiler(0)


def test_a_variant_that_cannot_compile_is_reported_by_name():
    bad = KernelVariant("vllmpy.ops.no_such_module", "no_such_kernel", "{}")
    # the calling process takes it before any worker is ready
    report = KernelCompiler(1).compile([bad])
    assert (report.variants, report.here, report.in_workers) == (1, 0, 0)
    assert len(report.failed) == 1
    assert report.failed[0].startswith("no_such_kernel: ModuleNotFoundError")


def test_what_the_workers_cannot_do_is_reported():
    bad = KernelVariant("vllmpy.ops.no_such_module", "no_such_kernel", "{}")
    report = KernelCompiler(1).compile([bad], in_process=False)
    assert (report.variants, report.here, report.in_workers) == (1, 0, 0)
    if torch.cuda.is_available():  # the worker gets to the import and names what failed
        assert report.failed == [report.failed[0]]
        assert report.failed[0].startswith("no_such_kernel: ModuleNotFoundError")
    else:  # the worker cannot query a device: it says so, and the variant is left over
        assert report.failed[0].startswith("worker: ")
        assert report.failed[1:] == ["no_such_kernel: no worker left"]


def test_no_variants_ends_the_workers_at_once():
    compiler = KernelCompiler(2)
    report = compiler.compile([])
    assert (report.variants, report.here, report.in_workers, report.failed) == (0, 0, 0, [])
    assert all(p.poll() is not None for p in compiler._procs)


PROBE = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)
''')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorded_variants_compile_in_workers_and_load_from_the_cache(tmp_path, monkeypatch):
    from triton import knobs

    from vllmpy.ops.precompile import record_variants

    (tmp_path / "vt_precompile_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers take this process's path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    import vt_precompile_probe as probe

    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    y = torch.zeros_like(x)
    with record_variants() as variants:
        probe.add_one[(8,)](x, y, x.numel(), BLOCK=128)
        probe.add_one[(8,)](x, y, x.numel(), BLOCK=128)  # the same variant again
        probe.add_one[(4,)](x, y, x.numel(), BLOCK=256)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.zeros_like(x))  # recorded, not launched
    assert [v.name for v in variants] == ["add_one", "add_one"]

    report = KernelCompiler(2).compile(variants, in_process=False)
    assert report.failed == []
    assert (report.variants, report.here, report.in_workers) == (2, 0, 2)

    hits = []
    monkeypatch.setattr(knobs.compilation, "listener",
                        lambda *, cache_hit, **_: hits.append(cache_hit))
    probe.add_one[(8,)](x, y, x.numel(), BLOCK=128)
    probe.add_one[(4,)](x, y, x.numel(), BLOCK=256)
    torch.cuda.synchronize()
    assert hits == [True, True]  # both loaded from what the workers wrote
    assert torch.equal(y, x + 1)


def test_workers_started_early_are_handed_over_once(monkeypatch):
    from vllmpy.ops import precompile

    monkeypatch.setenv("VT_COMPILE_WORKERS", "0")
    precompile.start_early()
    assert precompile.take_started() is None  # none asked for, none started
    monkeypatch.setenv("VT_COMPILE_WORKERS", "many")
    precompile.start_early()  # left for the model load to refuse, by name
    assert precompile.take_started() is None
    monkeypatch.setenv("VT_COMPILE_WORKERS", "1")
    precompile.start_early()
    compiler = precompile.take_started()
    try:
        assert isinstance(compiler, KernelCompiler) and compiler.num_workers == 1
        assert precompile.take_started() is None
    finally:
        compiler.close()
    assert all(p.poll() is not None for p in compiler._procs)


def test_a_worker_that_dies_leaves_its_variants_reported_not_hanging():
    compiler = KernelCompiler(1)
    compiler._procs[0].kill()
    bad = KernelVariant("vllmpy.ops.fused", "_rms_norm_kernel", "{}")
    report = compiler.compile([bad], in_process=False)
    assert (report.here, report.in_workers) == (0, 0)
    assert report.failed[-1] == "_rms_norm_kernel: no worker left"


def test_workers_that_cannot_start_are_refused_with_none_left_behind(monkeypatch):
    import subprocess

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        if started:
            raise OSError("Resource temporarily unavailable")
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        KernelCompiler(3)
    assert len(started) == 1 and started[0].poll() is not None  # the first one was ended
