"""[Note: many small items]: a rank of many small tensors writes its DCP items itself, from ``torch.save``
templates, into one file; the items are the bytes ``torch.save`` writes, read back by torch and DCP alike,
and checked at load as DCP's own items are."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_zero import _compat
from lightning_zero.checkpoint import load, save
from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
from lightning_zero.checkpoint.dcp import items, zip_records
from lightning_zero.checkpoint.formats.tree import FlatShard
from lightning_zero.checkpoint.store.tuning import CheckpointTuning

ID_RECORD = ".data/serialization_id"


@pytest.fixture(params=[True, False], ids=["record-crcs", "no-record-crcs"])
def record_crcs(request: pytest.FixtureRequest) -> Iterator[bool]:
    torch.serialization.set_crc32_options(request.param)
    try:
        yield request.param
    finally:
        torch.serialization.set_crc32_options(True)


def records(blob: bytes) -> dict[str, tuple[bytes, int]]:
    """Each record's stored bytes (read from its local header on, as no CRC is checked) and its CRC32."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        for info in archive.infolist():
            header = blob[info.header_offset: info.header_offset + 30]
            start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(
                header[28:30], "little")
            out[info.filename.split("/", 1)[1]] = (blob[start: start + info.file_size], info.CRC)
    return out


def written(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    items.write_tensor(stream, tensor, _compat.crc32_in_torch_save(), _compat.storage_alignment())
    return stream.getvalue()


@pytest.mark.parametrize("tensor", [
    torch.arange(4096, dtype=torch.float32), torch.randn(3, 5).to(torch.bfloat16), torch.arange(7),
    torch.tensor(2.5), torch.empty(0), torch.tensor([True, False, True]), torch.randn(4, dtype=torch.complex64),
    torch.arange(100_000, dtype=torch.float16),
], ids=["fp32", "bf16-2d", "int64", "scalar", "empty", "bool", "complex", "fp16-large"])
def test_an_item_from_a_template_is_the_zip_torch_save_writes_but_for_its_random_id(
        tensor: torch.Tensor, record_crcs: bool) -> None:
    ours = written(tensor)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    theirs = reference.getvalue()
    assert len(ours) == len(theirs)
    mine, torch_s = records(ours), records(theirs)
    assert mine.keys() == torch_s.keys() and ID_RECORD in mine
    for name in mine.keys() - {ID_RECORD}:
        assert mine[name] == torch_s[name], name  # the same bytes and the same record CRC32
    if record_crcs and tensor.numel():
        with zipfile.ZipFile(io.BytesIO(ours)) as archive:
            assert archive.testzip() is None
    loaded = torch.load(io.BytesIO(ours), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor)
    # The checksumming stream finds the directory of such an item by its end records alone.
    assert zip_records.directory_start(ours) == zipfile.ZipFile(io.BytesIO(ours)).start_dir


def test_a_view_of_part_of_a_storage_is_written_without_the_rest_of_it() -> None:
    base = torch.arange(64.0).reshape(8, 8)
    for tensor in (base.t(), base[2:4, 1], base[3]):  # not contiguous; views of part of a storage
        blob = written(tensor)
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), tensor)
        assert len(records(blob)["data/0"][0]) == tensor.numel() * 4  # not the 64 elements of its storage


@pytest.fixture
def templates_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    made: list[tuple[Any, ...]] = []
    original = items._Template.__init__
    monkeypatch.setattr(items._Template, "__init__", lambda self, dtype, shape, with_crcs: made.append(
        (dtype, shape)) or original(self, dtype, shape, with_crcs))
    items._template.cache_clear()
    yield made
    items._template.cache_clear()


def test_a_template_is_made_once_per_dtype_and_shape(templates_made: list[tuple[Any, ...]]) -> None:
    for value in range(3):
        for tensor in (torch.full((5,), float(value)), torch.full((6,), float(value)), torch.full((5,), value)):
            assert torch.equal(torch.load(io.BytesIO(written(tensor)), weights_only=True), tensor)
    assert templates_made == [(torch.float32, (5,)), (torch.float32, (6,)), (torch.int64, (5,))]


def test_a_large_tensor_is_written_by_torch_save_and_makes_no_template(templates_made: list[tuple[Any, ...]]) -> None:
    # A template of a large tensor would cost its size in zeros to make, and it would be used once.
    tensor = torch.arange(items.TEMPLATE_MAX_BYTES // 4 + 1, dtype=torch.float32)
    assert torch.equal(torch.load(io.BytesIO(written(tensor)), weights_only=True), tensor)
    assert templates_made == []


def plan_of(shapes: list[tuple[int, ...]]) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    return SavePlan([WriteItem(index=MetadataIndex(f"t{i}"), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape)),
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape))) for i, shape in enumerate(shapes)])


def test_only_a_plan_of_many_small_items_of_few_shapes_is_written_here() -> None:
    assert items.writes_items_itself(plan_of([(64, 64), (64,)] * 100))
    assert not items.writes_items_itself(plan_of([(64,)] * 10))  # few items: DCP's threads
    assert not items.writes_items_itself(plan_of([(1024, 1024)] * 100))  # large ones: DCP's threads
    assert not items.writes_items_itself(plan_of([(i + 1,) for i in range(200)]))  # a template per item


def many_small(value: float, count: int = 80) -> dict[str, Any]:
    """A deep model's shape: more than staging.FLAT_MIN_TENSORS small tensors (flat shards and plain ones)."""
    tree: dict[str, Any] = {f"w{i}": FlatShard(torch.full((48,), value + i), (6, 8), 0, 1) for i in range(count)}
    tree["buffer"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: torch.save writes it
    tree["step"] = torch.tensor(float(value))
    return tree


def zeros_like_tree(tree: dict[str, Any]) -> dict[str, Any]:
    return {key: FlatShard(torch.zeros_like(leaf.local), leaf.shape, 0, 1) if isinstance(leaf, FlatShard)
            else torch.zeros_like(leaf) for key, leaf in tree.items()}


def version_dir(path: Path) -> Path:
    (version,) = (path.parent / "_zero_data" / path.name).iterdir()
    return version


def assert_loads_back(path: Path, tree: dict[str, Any]) -> None:
    target = zeros_like_tree(tree)
    load(target, str(path))
    for key, leaf in tree.items():
        expected = leaf.local if isinstance(leaf, FlatShard) else leaf
        got = target[key].local if isinstance(leaf, FlatShard) else target[key]
        assert torch.equal(got, expected), key


@pytest.mark.parametrize("fsync", [True, False])
def test_a_sharded_save_of_many_small_tensors_is_one_file_that_plain_dcp_reads(
        one_rank: None, tmp_path: Path, fsync: bool) -> None:
    tree = many_small(1.0)
    path = tmp_path / "c.ckpt"
    save(tree, str(path), mode="sharded", tuning=CheckpointTuning(fsync=fsync))
    assert sorted(p.name for p in version_dir(path).glob("*.distcp")) == ["__0_0.distcp"]
    assert_loads_back(path, tree)
    # torch's own reader, no lightning_zero code: the items are ordinary DCP items.
    full = {key: torch.zeros(leaf.numel) if isinstance(leaf, FlatShard) else torch.zeros_like(leaf)
            for key, leaf in tree.items()}
    dcp.load(full, checkpoint_id=str(version_dir(path)), no_dist=True)
    assert all(torch.equal(full[key], leaf.local if isinstance(leaf, FlatShard) else leaf)
               for key, leaf in tree.items())
    checksums = [info.crc32 for info in dcp.FileSystemReader(str(version_dir(path))).read_metadata().storage_data.values()]
    assert checksums and all(crc[0] == zip_records.ZIP_RECORDS for crc in checksums)  # each item's zip digest


def test_items_small_and_larger_than_a_write_run_are_checksummed_with_and_without_record_crcs(
        tmp_path: Path, record_crcs: bool) -> None:
    # Items of more than 64 KiB reach the file in writes of their own ([Note: coalesced item writes]), smaller ones
    # are gathered with the checksum their template computes (``_ChecksummingStream.write_item``); either way
    # the checksum in .metadata is the one computed here from the file's bytes. torch's record CRCs are a
    # setting of the thread that saves, so DCP's writer runs on this one here.
    import zlib

    state = {f"w{i}": torch.full((20_000,), float(i)) for i in range(70)}
    state.update({f"b{i}": torch.full((3, 5), float(i), dtype=torch.bfloat16) for i in range(8)})
    writer = dcp_integrity.checksumming_writer(dcp.FileSystemWriter, "save-1", lambda stream: None)(
        str(tmp_path), sync_files=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp"]  # written by items.write_items
    data = (tmp_path / "__0_0.distcp").read_bytes()
    for info in dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data.values():
        item = data[info.offset: info.offset + info.length]
        expected = zip_records.directory_digest(item) if record_crcs else zlib.crc32(item)
        assert info.crc32 == expected
        assert zip_records.item_intact(item, info.crc32)
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_a_second_save_of_many_small_tensors_replaces_the_first(one_rank: None, tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save(many_small(1.0), str(path), mode="sharded")
    save(many_small(5.0), str(path), mode="sharded")
    assert_loads_back(path, many_small(5.0))
