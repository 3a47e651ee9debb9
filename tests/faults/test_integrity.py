"""Every file of a checkpoint belongs to it, and a changed byte of tensor data is found at load.

The damage is real: a byte inside a tensor's data record on disk is flipped (where ``torch.load``
itself still reads the file without complaint), files are swapped between ranks or replaced by the
same file of another save, metadata is copied from another checkpoint.
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed
from checkpoint_cases import save_and_gather

from lightning_zero.checkpoint import CheckpointCorruptError, FlatShard, load, save
from lightning_zero.checkpoint.reader import read_zero_tree

pytestmark = pytest.mark.usefixtures("one_rank")  # one in-process gloo rank (tests/conftest.py)

MODES = ("local", "sharded", "full")


def big_tree(value: float, shape: tuple[int, ...] = (64, 64)) -> dict[str, Any]:
    """A tree whose tensor data dwarfs the zip and pickle records around it."""
    numel = shape[0] * shape[1]
    return {"w": FlatShard(torch.full((numel,), value), shape, 0, 1), "b": torch.full((7,), value),
            "meta": {"n": 1}}


def version_dir(path: Path) -> Path:
    (version,) = (path.parent / "_zero_data" / path.name).iterdir()
    return version


def largest_data_record(blob: bytes) -> tuple[int, int]:
    """(offset, size) of the biggest tensor data record of a ``torch.save`` zip (stored, not compressed)."""
    archive = zipfile.ZipFile(io.BytesIO(blob))
    info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    header = blob[info.header_offset: info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return start, info.file_size


def flip_byte(file: Path, start: int = 0, end: int | None = None) -> None:
    """Flip one byte in the middle of the biggest tensor record of the torch.save zip in ``file[start:end]``."""
    data = bytearray(file.read_bytes())
    offset, size = largest_data_record(bytes(data[start:end]))
    data[start + offset + size // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def damaged_file(path: Path, mode: str) -> Path:
    """Flip a byte of ``w``'s data in the file of ``mode`` that holds it; return that file."""
    if mode == "full":
        flip_byte(path)
        return path
    if mode == "local":
        target = version_dir(path) / "rank00000-of-00001.pt"
        flip_byte(target)
        return target
    reader = dcp.FileSystemReader(str(version_dir(path)))
    metadata = reader.read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == "w"]
    target = version_dir(path) / info.relative_path
    flip_byte(target, info.offset, info.offset + info.length)
    return target


@pytest.mark.parametrize("mode", MODES)
def test_a_flipped_byte_in_tensor_data_names_the_checkpoint_the_file_and_the_tensor(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.ckpt"
    save(big_tree(1.0), str(path), mode=mode)
    target = damaged_file(path, mode)
    if mode != "sharded":
        torch.load(target, weights_only=True)  # torch itself does not notice: the zip CRCs are not checked
    into = big_tree(0.0)
    with pytest.raises(CheckpointCorruptError, match=r"Checksum mismatch in .*its data changed") as error:
        load(into, str(path))
    # (A tree of many small tensors is packed in a local rank file and named by chunk: tests/checkpoint/formats/
    # test_packed.py. These two tensors are not.)
    for part in ("tensor 'w'", target.name, repr(str(path))):
        assert part in str(error.value), f"the error does not name {part}: {error.value}"
    assert into["w"].local.eq(0.0).all() and into["b"].eq(0.0).all(), "a refused load changed the state"


def sharded_item(path: Path, fqn: str) -> tuple[Path, Any]:
    """The data file holding ``fqn`` in a one-rank ``sharded`` checkpoint, and its storage record."""
    reader = dcp.FileSystemReader(str(version_dir(path)))
    (info,) = [info for index, info in reader.read_metadata().storage_data.items() if index.fqn == fqn]
    return version_dir(path) / info.relative_path, info


def directory_entry(item: bytes, name: str) -> int:
    """Offset in ``item`` (a torch.save zip) of the central directory entry of record ``name``."""
    start = zipfile.ZipFile(io.BytesIO(item)).start_dir
    entry = item.index(b"PK\x01\x02", start)
    while item[entry + 46: entry + 46 + len(name)] != name.encode():
        entry = item.index(b"PK\x01\x02", entry + 4)
    return entry


@pytest.mark.parametrize(("field", "bit"), [(16, 0xFF), (38, 0x10)], ids=["record-crc", "directory-attribute"])
def test_a_changed_zip_directory_of_a_sharded_item_is_refused(tmp_path: Path, field: int, bit: int) -> None:
    """[Note: why our own checksums]: the directory of each item's zip must be byte for byte the one
    written. Changing the data record's CRC fails ``testzip``; the "directory" attribute bit passes
    ``testzip`` but makes torch.load return the tensor without its data, so only the directory's own
    checksum refuses it."""
    path = tmp_path / "sharded.ckpt"
    save(big_tree(1.0), str(path), mode="sharded")
    target, info = sharded_item(path, "w")
    assert info.crc32[0] == "zip-records"
    data = bytearray(target.read_bytes())
    item = bytes(data[info.offset: info.offset + info.length])
    archive = zipfile.ZipFile(io.BytesIO(item))
    record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data[info.offset + directory_entry(item, record.filename) + field] ^= bit
    target.write_bytes(bytes(data))
    into = big_tree(0.0)
    with pytest.raises(CheckpointCorruptError, match=r"Checksum mismatch in .*tensor 'w'"):
        load(into, str(path))
    assert into["w"].local.eq(0.0).all()


def test_a_flipped_byte_in_an_item_of_many_small_tensors_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    # [Note: many small items]: such a rank writes its items itself, into one file; they are checked as DCP's are.
    tree = {f"w{i}": FlatShard(torch.full((48,), float(i)), (6, 8), 0, 1) for i in range(80)}
    path = tmp_path / "sharded.ckpt"
    save(tree, str(path), mode="sharded")
    assert len(list(version_dir(path).glob("*.distcp"))) == 1  # written by dcp/items.py, not DCP's two threads
    target, info = sharded_item(path, "w7")
    flip_byte(target, info.offset, info.offset + info.length)
    into = {key: FlatShard(torch.zeros(48), (6, 8), 0, 1) for key in tree}
    with pytest.raises(CheckpointCorruptError, match=r"Checksum mismatch in .*tensor 'w7'"):
        load(into, str(path))
    assert all(shard.local.eq(0.0).all() for shard in into.values())


def test_without_torch_record_crcs_the_writer_checksums_every_byte_itself(tmp_path: Path) -> None:
    """torch's record CRCs can be switched off (per thread; DCP writes on the calling thread here):
    the writer then stores the CRC32 of each item's bytes, which readers check instead."""
    import zlib

    from lightning_zero.checkpoint.dcp import integrity as dcp_integrity

    torch.serialization.set_crc32_options(False)
    try:
        writer = dcp_integrity.checksumming_writer(dcp.FileSystemWriter, "save-1", lambda stream: None)(str(tmp_path), sync_files=False)
        dcp.save({"w": torch.full((4096,), 1.0)}, storage_writer=writer, no_dist=True)
    finally:
        torch.serialization.set_crc32_options(True)
    (info,) = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data.values()
    item = (tmp_path / info.relative_path).read_bytes()[info.offset: info.offset + info.length]
    assert {record.CRC for record in zipfile.ZipFile(io.BytesIO(item)).infolist()} == {0}  # torch wrote none
    assert info.crc32 == zlib.crc32(item)


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_tensors_of_other_shapes_with_the_same_element_count_are_refused(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.ckpt"
    save(big_tree(1.0, (64, 64)), str(path), mode=mode)
    into = big_tree(0.0, (32, 128))
    with pytest.raises(ValueError, match=r"holds 'w' with shape \(64, 64\), this model has \(32, 128\).*another model"):
        load(into, str(path))
    assert into["w"].local.eq(0.0).all()


# ---- files of another rank or another checkpoint ---------------------------------------------


@pytest.fixture
def two_rank_local(tmp_path: Path) -> tuple[Path, Path]:
    """Two ``local`` checkpoints of 2 ranks (3 and 4 training steps): ``a/local.ckpt``, ``b/local.ckpt``."""
    for name, steps in (("a", 3), ("b", 4)):
        (tmp_path / name).mkdir()
        run_distributed(save_and_gather, 2, str(tmp_path / name), ("local",), steps, start_method="forkserver")
    return tmp_path / "a" / "local.ckpt", tmp_path / "b" / "local.ckpt"


def test_swapped_local_rank_files_are_refused_naming_the_file(two_rank_local: tuple[Path, Path]) -> None:
    path, _ = two_rank_local
    files = version_dir(path)
    rank0, rank1 = files / "rank00000-of-00002.pt", files / "rank00001-of-00002.pt"
    data0 = rank0.read_bytes()
    rank0.write_bytes(rank1.read_bytes())
    rank1.write_bytes(data0)
    with pytest.raises(CheckpointCorruptError, match=r"rank00000-of-00002\.pt.*was written by rank 1, expected 0.*swapped"):
        read_zero_tree(str(path))


def test_a_rank_file_of_another_checkpoint_is_refused_naming_the_file(two_rank_local: tuple[Path, Path]) -> None:
    path, older = two_rank_local
    shutil.copy(version_dir(older) / "rank00001-of-00002.pt", version_dir(path) / "rank00001-of-00002.pt")
    with pytest.raises(CheckpointCorruptError,
                       match=r"rank00001-of-00002\.pt' belongs to another checkpoint than .*a/local\.ckpt"):
        read_zero_tree(str(path))


def test_dcp_metadata_of_another_checkpoint_is_refused(tmp_path: Path) -> None:
    path, other = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    save(big_tree(1.0), str(path), mode="sharded")
    save(big_tree(2.0), str(other), mode="sharded")
    shutil.copy(version_dir(other) / ".metadata", version_dir(path) / ".metadata")
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata' belongs to another save than checkpoint .*a\.ckpt"):
        load(big_tree(0.0), str(path))


def test_data_files_of_another_checkpoint_fail_their_checksums(tmp_path: Path) -> None:
    path, other = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    save(big_tree(1.0), str(path), mode="sharded")
    save(big_tree(2.0), str(other), mode="sharded")
    for data in version_dir(other).glob("*.distcp"):
        shutil.copy(data, version_dir(path) / data.name)
    with pytest.raises(CheckpointCorruptError, match=r"Checksum mismatch in '__0_0\.distcp' \(tensor '(w|b)'\)"):
        load(big_tree(0.0), str(path))


# ---- missing or cut parts ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_a_marker_pointing_at_a_missing_version_names_it(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.ckpt"
    save(big_tree(1.0), str(path), mode=mode)
    version = version_dir(path)
    shutil.rmtree(version)
    with pytest.raises(CheckpointCorruptError, match=rf"the data version it points at, '.*{version.name}', is missing"):
        load(big_tree(0.0), str(path))


def test_a_truncated_dcp_data_file_names_the_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "sharded.ckpt"
    save(big_tree(1.0), str(path), mode="sharded")
    data = version_dir(path) / "__0_0.distcp"  # the first writer thread's file: the largest tensor
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match=r"'__0_0\.distcp' \(tensor '\w+'\) of checkpoint .*is truncated"):
        load(big_tree(0.0), str(path))


def test_a_deleted_local_rank_file_is_named(two_rank_local: tuple[Path, Path]) -> None:
    path, _ = two_rank_local
    (version_dir(path) / "rank00001-of-00002.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"is committed but '.*rank00001-of-00002\.pt' is missing"):
        read_zero_tree(str(path))


def test_crafted_dcp_metadata_does_not_run_code(tmp_path: Path) -> None:
    path = tmp_path / "sharded.ckpt"
    save(big_tree(1.0), str(path), mode="sharded")
    witness = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (witness,))

    import pickle

    (version_dir(path) / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointCorruptError, match=r"'\.metadata' of checkpoint .* is not valid DCP metadata.*crafted"):
        load(big_tree(0.0), str(path))
    assert not witness.exists(), "unpickling the metadata ran code"
