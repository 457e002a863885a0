"""The fast GGUF reader: the same metadata and tensor bytes as `gguf.GGUFReader`, tensors as views of the file's
memory map, and a clear ValueError for a damaged file."""
from pathlib import Path

import gguf
import numpy as np
import pytest

from inferno.kernels import gguf_repack
from inferno.loader.gguf import open_gguf
from inferno.loader.gguf_file import GGUFFile
from inferno.loader.tokenizer import Tokenizer
from native_kernels import require_kernels
from tiny_gguf import T, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    types = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q5_0}
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", types, tied=False)


def test_metadata_matches_gguf_reader(tiny_path):
    ours, reference = GGUFFile(str(tiny_path)), gguf.GGUFReader(str(tiny_path))
    assert set(ours.fields) == set(reference.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.fields.items():
        expected = reference.fields[key].contents()
        if isinstance(value, np.ndarray):
            assert value.tolist() == expected, key
        else:
            assert value == expected, key


def test_tensors_are_the_file_bytes_without_a_copy(tiny_path):
    ours, reference = GGUFFile(str(tiny_path)), gguf.GGUFReader(str(tiny_path))
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1)), mine.name
        assert np.shares_memory(mine.data, ours.buffer)  # a view of the memory map


def test_tokenizer_from_fast_reader_matches_one_from_path(tiny_path):
    from_file = Tokenizer.from_gguf(GGUFFile(str(tiny_path)))
    from_path = Tokenizer.from_gguf(str(tiny_path))
    text = "Hello <|im_end|> wörld"
    assert from_file.encode(text) == from_path.encode(text)
    assert from_file.decode(from_file.encode(text), skip_special_tokens=False) == text
    assert from_file.eos_token_ids == {257, 256}  # <|im_end|> (the file's eos) and <|endoftext|> (end of turn)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
    (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], "version 99"),
    (lambda b: b[:300], "cannot read GGUF file"),  # cut inside the metadata
    (lambda b: b[:-1000], "runs past the end of the file"),  # cut inside the tensor data
    (lambda b: b"", "cannot read GGUF file"),
])
def test_damaged_file_is_a_clear_value_error(tiny_path, tmp_path, damage, message):
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(damage(tiny_path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        GGUFFile(str(damaged))


STRINGS = ["", "plain", "wörld", "日本語", "🙂 emoji", "line\nbreak", "", "tab\tand\x00nul", "A-X-B", "last"]


def write_strings(path: Path, strings: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_array("test.strings", strings)
    writer.add_array("test.many", [f"t{i}" for i in range(5000)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("native", [True, False])  # the native walk + bulk decode, or one string at a time
def test_string_arrays_decode_as_the_reference_reader(tmp_path, native):
    """Empty strings, multi-byte characters and control bytes (the bulk decode splits the whole array at once)."""
    if native:
        require_kernels()
    path = write_strings(tmp_path / "strings.gguf", STRINGS)
    ours = GGUFFile(str(path), gguf_repack().gguf_string_offsets if native else None)
    reference = gguf.GGUFReader(str(path))
    assert ours.fields["test.strings"] == reference.fields["test.strings"].contents() == STRINGS
    assert ours.fields["test.many"] == [f"t{i}" for i in range(5000)]


# the loader's way (the native walk where it is built), and one string at a time
OPENERS = [open_gguf, lambda path: GGUFFile(path)]


@pytest.mark.parametrize("open_file", OPENERS)
@pytest.mark.parametrize("bad_byte", [0xFF, 0x80, 0xC3])  # the bulk decode's separator, a lone continuation, a cut lead
def test_invalid_utf8_in_a_string_array_is_a_clear_value_error(tmp_path, bad_byte, open_file):
    data = bytearray(write_strings(tmp_path / "strings.gguf", STRINGS).read_bytes())
    data[data.index(b"A-X-B") + 2] = bad_byte
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="cannot read GGUF file.*UnicodeDecodeError"):
        open_file(str(damaged))


@pytest.mark.parametrize("open_file", OPENERS)
def test_a_string_array_cut_short_is_a_clear_value_error(tmp_path, open_file):
    data = write_strings(tmp_path / "strings.gguf", STRINGS).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"t4000")])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        open_file(str(cut))
