"""The OCI documents shoal reads, parsed and checked in one place.

Image indexes (and Docker manifest lists), image manifests (OCI and Docker schema 2),
image configs and the descriptors inside them come from registries, layouts and
archives that an image's author controls. Every reader of them (convert, inspect, pull,
the node, profiles) goes through these functions, which are pure functions over bytes
(no I/O) and raise only FormatError, with a message naming the document and the field:
`IMAGE: manifest: layers[2].digest: ...`. They are fuzzed under h11's rule (accepted, or
FormatError).

What is checked:
- the document: at most MAX_DOCUMENT_BYTES, UTF-8 JSON, an object, nested at most
  MAX_DEPTH deep, at most MAX_DESCRIPTORS descriptors;
- a descriptor: an object with a string `mediaType`, a `sha256:<64 hex>` `digest`, an
  integer `size` >= 0 (booleans are not integers), `annotations` (if present) an object
  of strings, `platform` (if present) an object with string `os` and `architecture`;
- a manifest: `config` a descriptor, `layers` a list of descriptors;
- an index: `manifests` a list of descriptors;
- a config: `rootfs` an object with `diff_ids` a list of digests, as many as the
  manifest's layers when that count is given.

The parsed types keep the document's JSON object (`raw`) so a converter can rewrite it
with unknown fields kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from shoal import mediatypes as mt
from shoal.digest import check_digest
from shoal.errors import FormatError, ShoalError

MAX_DOCUMENT_BYTES = 8 << 20  # a manifest, index or config; distribution itself takes 4 MiB manifests
MAX_DEPTH = 64  # nesting of objects and arrays; real documents stay under 8
MAX_DESCRIPTORS = 10_000  # layers of a manifest, or manifests of an index


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    platform: Platform | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ImageManifest:
    media_type: str  # the declared mediaType, or OCI_MANIFEST when it declares none
    config: Descriptor
    layers: list[Descriptor]
    annotations: dict[str, str]
    raw: dict = field(compare=False, repr=False)


@dataclass(frozen=True)
class ImageIndex:
    media_type: str
    manifests: list[Descriptor]
    raw: dict = field(compare=False, repr=False)


@dataclass(frozen=True)
class ImageConfig:
    diff_ids: list[str]
    os: str
    architecture: str
    raw: dict = field(compare=False, repr=False)


def _depth(obj: object) -> int:
    """How deep objects and arrays nest in a decoded document (iteratively)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        children: Iterable[object]
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


def load_document(data: bytes, what: str, limit: int = MAX_DOCUMENT_BYTES) -> dict:
    """The JSON object of a document of at most `limit` bytes (see the module doc)."""
    if not isinstance(data, (bytes, bytearray)):
        raise FormatError(f"{what}: not a document")
    if len(data) > limit:
        raise FormatError(f"{what}: {len(data)} bytes, more than {limit}")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise FormatError(f"{what}: nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{what}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: not a JSON object (a JSON {type(doc).__name__})")
    if _depth(doc) > MAX_DEPTH:
        raise FormatError(f"{what}: nested more than {MAX_DEPTH} levels deep")
    return doc


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(obj: dict, key: str, what: str, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise FormatError(f"{what}.{key}: " + ("missing" if value is None else f"not a string: {_short(value)}"))
    return value


def _string_map(obj: dict, key: str, what: str) -> dict[str, str]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise FormatError(f"{what}.{key}: not an object of strings")
    return value


def _list(obj: dict, key: str, what: str) -> list:
    value = obj.get(key)
    if not isinstance(value, list):
        raise FormatError(f"{what}.{key}: " + ("missing" if value is None else f"not a list: {_short(value)}"))
    if len(value) > MAX_DESCRIPTORS:
        raise FormatError(f"{what}.{key}: {len(value)} entries, more than {MAX_DESCRIPTORS}")
    return value


def parse_descriptor(obj: object, what: str) -> Descriptor:
    """One descriptor (a JSON object already decoded)."""
    if not isinstance(obj, dict):
        raise FormatError(f"{what}: not an object: {_short(obj)}")
    media_type = _string(obj, "mediaType", what)
    if "digest" not in obj:
        raise FormatError(f"{what}.digest: missing")
    try:
        digest = check_digest(obj["digest"], f"{what}.digest")
    except ShoalError as e:
        raise FormatError(str(e)) from None
    size = obj.get("size")
    if type(size) is not int or size < 0:
        raise FormatError(f"{what}.size: " + ("missing" if size is None else f"not a size: {_short(size)}"))
    platform = None
    if obj.get("platform") is not None:
        p = obj["platform"]
        if not isinstance(p, dict):
            raise FormatError(f"{what}.platform: not an object")
        platform = Platform(_string(p, "os", f"{what}.platform"), _string(p, "architecture", f"{what}.platform"),
                            _string(p, "variant", f"{what}.platform", required=False))
    return Descriptor(media_type, digest, size, _string_map(obj, "annotations", what), platform, obj)


def document_media_type(doc: dict) -> str:
    """A decoded manifest or index's media type: its own `mediaType`, else its shape."""
    declared = doc.get("mediaType")
    if isinstance(declared, str) and declared:
        return declared
    return mt.OCI_INDEX if "manifests" in doc else mt.OCI_MANIFEST


def _typed_document(data: bytes, what: str, types: tuple[str, ...], kind: str) -> tuple[dict, str]:
    doc = load_document(data, what)
    media_type = document_media_type(doc)
    if media_type not in types:
        raise FormatError(f"{what}: media type {_short(media_type)} is not {kind}")
    return doc, media_type


def parse_manifest(data: bytes, what: str) -> ImageManifest:
    """An image manifest (OCI, or Docker schema 2)."""
    what = f"{what}: manifest"
    doc, media_type = _typed_document(data, what, mt.MANIFEST_TYPES, "an image manifest")
    if "config" not in doc:
        raise FormatError(f"{what}.config: missing")
    config = parse_descriptor(doc["config"], f"{what}.config")
    layers = [parse_descriptor(d, f"{what}.layers[{i}]") for i, d in enumerate(_list(doc, "layers", what))]
    return ImageManifest(media_type, config, layers, _string_map(doc, "annotations", what), doc)


def parse_index(data: bytes, what: str) -> ImageIndex:
    """An image index (OCI, or a Docker manifest list)."""
    what = f"{what}: index"
    doc, media_type = _typed_document(data, what, mt.INDEX_TYPES, "an image index")
    entries = [parse_descriptor(d, f"{what}.manifests[{i}]") for i, d in enumerate(_list(doc, "manifests", what))]
    return ImageIndex(media_type, entries, doc)


def parse_config(data: bytes, what: str, layers: int | None = None) -> ImageConfig:
    """An image config; `layers`, if given, is how many diff_ids it must list."""
    what = f"{what}: config"
    doc = load_document(data, what)
    rootfs = doc.get("rootfs")
    if not isinstance(rootfs, dict):
        raise FormatError(f"{what}.rootfs: " + ("missing" if rootfs is None else f"not an object: {_short(rootfs)}"))
    diff_ids = []
    for i, d in enumerate(_list(rootfs, "diff_ids", f"{what}.rootfs")):
        try:
            diff_ids.append(check_digest(d, f"{what}.rootfs.diff_ids[{i}]"))
        except ShoalError as e:
            raise FormatError(str(e)) from None
    if layers is not None and len(diff_ids) != layers:
        raise FormatError(f"{what}: lists {len(diff_ids)} diff_ids for {layers} layers")
    return ImageConfig(diff_ids, str(doc.get("os") or ""), str(doc.get("architecture") or ""), doc)
