"""Fuzzing the parsers (h11's rule): every input is accepted or refused with the
project's own FormatError — never any other exception, never a hang."""

from __future__ import annotations

import io
import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder import tarsplit
from builder.format.footer import (
    FOOTER_MAGIC,
    MANIFEST_CHECKSUM,
    MANIFEST_POSITION,
    TARSPLIT_POSITION,
    location_from_annotations,
    parse_footer,
)
from builder.format.toc import decompress_toc, parse_toc
from builder.tarstream import TarReader
from shoal.errors import FormatError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
entry_keys = st.sampled_from(
    ["type", "name", "linkName", "mode", "size", "uid", "gid", "modtime", "devMajor", "devMinor", "xattrs",
     "digest", "offset", "endOffset", "chunkSize", "chunkOffset", "chunkDigest", "chunkType"]
)
entry_values = st.one_of(
    json_scalars,
    st.sampled_from(["reg", "dir", "symlink", "hardlink", "chunk", "char", "fifo", "a", "../a", "/a", "a/b",
                     "sha256:" + "a" * 64, "2024-01-01T00:00:00Z", "zeros"]),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)
entries = st.lists(st.dictionaries(entry_keys, entry_values, max_size=10), max_size=12)


def refused_or_accepted(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except FormatError:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_footer(data):
    refused_or_accepted(parse_footer, data)


@FUZZ
@given(st.lists(st.integers(0, 2**64 - 1), min_size=7, max_size=7))
def test_footer_numbers(numbers):
    refused_or_accepted(parse_footer, struct.pack("<7Q", *numbers) + FOOTER_MAGIC)


@FUZZ
@given(st.dictionaries(st.sampled_from([MANIFEST_POSITION, MANIFEST_CHECKSUM, TARSPLIT_POSITION,
                                        "io.containers.zstd-chunked.manifest-position",
                                        "io.containers.zstd-chunked.manifest-checksum"]),
                       st.text(max_size=40) | st.from_regex(r"\d{1,12}:\d{1,12}:\d{1,12}(:\d)?", fullmatch=True)))
def test_annotations(annotations):
    refused_or_accepted(location_from_annotations, annotations)


@FUZZ
@given(json_values)
def test_toc_any_json(value):
    refused_or_accepted(parse_toc, json.dumps(value).encode())


@FUZZ
@given(entries, st.integers(0, 2**40))
def test_toc_entries(items, blob_size):
    refused_or_accepted(parse_toc, json.dumps({"version": 1, "entries": items}).encode(), blob_size)


@FUZZ
@given(st.binary(max_size=300))
def test_toc_raw_bytes(data):
    refused_or_accepted(parse_toc, data)
    refused_or_accepted(decompress_toc, data, None, 1000)


@FUZZ
@given(st.binary(max_size=300))
def test_tarsplit(data):
    refused_or_accepted(lambda d: list(tarsplit.parse(d)), data)


def _read_all(data: bytes) -> None:
    r = TarReader(io.BytesIO(data), block_size=1024)
    while r.next() is not None:
        while r.read_payload(4096):
            pass
    r.trailer()


@FUZZ
@given(st.binary(max_size=3000))
def test_tar_reader_random_bytes(data):
    refused_or_accepted(_read_all, data)


@FUZZ
@given(st.integers(0, 511), st.binary(min_size=1, max_size=16), st.sampled_from([b"0", b"x", b"L", b"5", b"g", b"S"]))
def test_tar_reader_mutated_header(pos, junk, typeflag):
    import tarfile

    info = tarfile.TarInfo("some/file")
    info.size = 5
    block = bytearray(info.tobuf(tarfile.USTAR_FORMAT))
    block[156:157] = typeflag
    block[pos : pos + len(junk)] = junk[: 512 - pos]
    # fix the checksum so the parser gets past it to the fields
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:512])
    refused_or_accepted(_read_all, bytes(block[:512]) + b"hello" + bytes(507) + bytes(1024))


# --- OCI documents (builder/oci/documents.py) --------------------------------------------------

descriptor_values = st.one_of(
    json_values,
    st.fixed_dictionaries({"mediaType": st.sampled_from(["application/vnd.oci.image.layer.v1.tar+gzip", 1]),
                           "digest": st.sampled_from(["sha256:" + "a" * 64, "sha256:x", None]),
                           "size": st.sampled_from([0, -1, 10, True, "1", 2**70])},
                          optional={"annotations": json_values, "platform": json_values}),
)
document_keys = st.sampled_from(["schemaVersion", "mediaType", "config", "layers", "manifests", "rootfs",
                                 "annotations", "os", "architecture"])
documents = st.dictionaries(document_keys, st.one_of(descriptor_values, st.lists(descriptor_values, max_size=4),
                                                     st.fixed_dictionaries({"diff_ids": json_values})), max_size=6)


@FUZZ
@given(documents)
def test_oci_documents(doc):
    from builder.oci.documents import parse_config, parse_index, parse_manifest

    data = json.dumps(doc).encode()
    for parse in (parse_manifest, parse_index, parse_config):
        refused_or_accepted(parse, data, "fuzz")


@FUZZ
@given(st.binary(max_size=300) | st.builds(lambda n, c: c * n, st.integers(0, 200_000), st.sampled_from([b"[", b'{"a":'])))
def test_oci_documents_bytes(data):
    from builder.oci.documents import parse_config, parse_index, parse_manifest

    for parse in (parse_manifest, parse_index, parse_config):
        refused_or_accepted(parse, data, "fuzz")
