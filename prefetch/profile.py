"""Access profiles: the chunks an image's start reads, in the order it reads them.

A node notes which chunks its containers read first (snapshotter/fs/server.py);
`shoal profile save` turns that into a profile and publishes it next to the image. A node
that prepares the image later finds the profile and fetches those chunks, in that order and
in large requests, while containerd is still preparing the layers (snapshotter/remote.py),
so the container's first reads find their chunks in memory.

The profile is an OCI artifact in the image's repository, tagged
`sha256-<manifest hex>.shoal-profile` (one per image manifest; no registry feature beyond
plain manifests and tags is needed):

    manifest: OCI image manifest, config {mediaType CONFIG_MEDIA_TYPE, the JSON "{}"},
              one layer {mediaType PROFILE_MEDIA_TYPE}, annotation MANIFEST_ANNOTATION
    blob:     {"schemaVersion": 1, "manifest": "sha256:...",
               "layers": ["sha256:...", ...],                 the image's layer digests
               "chunks": [[layer index, start, end], ...],    compressed byte ranges
               "commands": [["/bin/sh", "-c", "..."], ...]}   what the recordings ran (optional)

`commands` names the command each recording ran (`shoal profile record`; [] for "the
image's own command", absent in profiles written before it existed). Recordings of one
image merge (`merge`): the union of their chunks in first-use order (the older profile's
order first, then what the newer one adds), and their commands in order.

A profile is only a hint: its ranges are checked against each layer's TOC (a range that
is not a chunk is skipped) and every chunk is verified by its digest as always. A bad or
missing profile makes no difference to what a container reads, only to when.

Anyone who can push to the image's repository can publish its profile, so a profile is
bounded in what it can make a node do: at most MAX_PROFILE_BYTES of JSON and MAX_CHUNKS
entries, each range named once (a repeated range is dropped), only the layers of the
manifest it is bound to (its tag, its manifest annotation and its "manifest" field all
name that digest), and a node fetches at most `[fetch] prefetch_max_bytes` of its ranges
(`Profile.bounded`), the first ones in profile order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from builder.oci.artifact import artifact_blob, push_artifact
from builder.oci.documents import load_document
from builder.oci.refs import DockerRef
from builder.oci.registry import RegistrySource
from shoal.digest import check_digest
from shoal.errors import FormatError, NotFound

PROFILE_MEDIA_TYPE = "application/vnd.shoal.profile.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.shoal.profile.config.v1+json"
MANIFEST_ANNOTATION = "io.github.shoal.profile.manifest"
MAX_PROFILE_BYTES = 64 << 20
MAX_CHUNKS = 1_000_000
MAX_COMMANDS = 64  # recordings named in one profile (the oldest go first)
MAX_COMMAND_ARGS = 256
MAX_ARG = 4096  # characters


def profile_tag(manifest_digest: str) -> str:
    """The tag of the profile of the image whose manifest is `manifest_digest`."""
    algo, _, hexpart = check_digest(manifest_digest).partition(":")
    return f"{algo}-{hexpart}.shoal-profile"


@dataclass
class Profile:
    manifest: str  # the image manifest's digest
    chunks: list[tuple[str, int, int]]  # (layer digest, start, end) in order of first use
    commands: list[list[str]] = field(default_factory=list)  # what each recording ran

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(d for d, _, _ in self.chunks))

    @property
    def compressed_bytes(self) -> int:
        return sum(end - start for _, start, end in self.chunks)

    def to_json(self, layer_order: Sequence[str] | None = None) -> bytes:
        layers = list(layer_order) if layer_order else self.layers
        index = {d: i for i, d in enumerate(layers)}
        doc = {
            "schemaVersion": 1,
            "manifest": self.manifest,
            "layers": layers,
            "chunks": [[index[d], a, b] for d, a, b in self.chunks if d in index],
        }
        if self.commands:
            doc["commands"] = self.commands
        return json.dumps(doc, separators=(",", ":")).encode()

    def merge(self, newer: Profile) -> Profile:
        """This profile's chunks, then those of `newer` it lacks (first-use order, each
        range once, at most MAX_CHUNKS); the commands of both (the last MAX_COMMANDS)."""
        if newer.manifest != self.manifest:
            raise FormatError(f"profiles of {self.manifest} and {newer.manifest} do not merge: not one image")
        chunks = list(dict.fromkeys([*self.chunks, *newer.chunks]))[:MAX_CHUNKS]
        return Profile(self.manifest, chunks, [*self.commands, *newer.commands][-MAX_COMMANDS:])

    @classmethod
    def from_json(cls, data: bytes, manifest: str, layers: Iterable[str] | None = None) -> Profile:
        """Parse and check a profile of the image `manifest` (whose layers, if given,
        must include every layer the profile names). Raises FormatError."""
        what = f"access profile of {manifest}"
        doc = load_document(data, what, MAX_PROFILE_BYTES)
        if doc.get("schemaVersion") != 1:
            raise FormatError(f"{what}: not a version 1 profile")
        if doc.get("manifest") != manifest:
            raise FormatError(f"{what}: it describes {str(doc.get('manifest'))[:80]!r}")
        names, entries = doc.get("layers"), doc.get("chunks")
        if not isinstance(names, list) or not isinstance(entries, list):
            raise FormatError(f"{what}: layers and chunks must be lists")
        if len(entries) > MAX_CHUNKS:
            raise FormatError(f"{what}: {len(entries)} chunks, more than {MAX_CHUNKS}")
        names = [check_digest(n, f"{what}: layer") for n in names]
        allowed = set(layers) if layers is not None else None
        if allowed is not None and not set(names) <= allowed:
            raise FormatError(f"{what}: names layers the image does not have")
        chunks: dict[tuple[str, int, int], None] = {}  # ordered, each range once
        for e in entries:
            if not (isinstance(e, list) and len(e) == 3 and all(type(v) is int for v in e)
                    and 0 <= e[0] < len(names) and 0 <= e[1] < e[2]):
                raise FormatError(f"{what}: bad chunk entry {str(e)[:80]}")
            chunks[(names[e[0]], e[1], e[2])] = None
        return cls(manifest, list(chunks), _commands(doc.get("commands", []), what))

    def bounded(self, max_bytes: int) -> Profile:
        """The longest prefix of the profile whose ranges add up to at most `max_bytes`
        compressed bytes: what a node lets a profile make it fetch."""
        total = 0
        for i, (_, start, end) in enumerate(self.chunks):
            total += end - start
            if total > max_bytes:
                return Profile(self.manifest, self.chunks[:i], self.commands)
        return self


def _commands(value: object, what: str) -> list[list[str]]:
    """A profile's "commands" field, checked (FormatError)."""
    if not isinstance(value, list) or len(value) > MAX_COMMANDS:
        raise FormatError(f"{what}: commands must be a list of at most {MAX_COMMANDS} commands")
    for c in value:
        if not (isinstance(c, list) and len(c) <= MAX_COMMAND_ARGS
                and all(isinstance(a, str) and len(a) <= MAX_ARG for a in c)):
            raise FormatError(f"{what}: bad command {str(c)[:80]} (want a list of at most {MAX_COMMAND_ARGS} strings)")
    return value


# (digest, size, what, limit) -> the blob's bytes, checked against its digest; ShoalError
ReadBlob = Callable[[str, int | None, str, int], bytes]


def fetch_profile(host: str, repository: str, manifest_digest: str, plain_http: bool = False,
                  layers: Iterable[str] | None = None, read_blob: ReadBlob | None = None) -> Profile | None:
    """The published profile of an image, or None if it has none. Raises ShoalError for
    a registry that fails or a profile that is malformed. The profile's manifest (a tag)
    comes from the registry; its blob through `read_blob` when given (a node's fetch
    chain: the region serves it to a fleet at one origin copy)."""
    src = RegistrySource(DockerRef(host, repository, tag=profile_tag(manifest_digest)), plain_http)
    try:
        try:
            art = src.get_root()
        except NotFound:
            return None
        what = str(src.reference)
        blob = artifact_blob(art.data, f"{what}: profile", PROFILE_MEDIA_TYPE, MANIFEST_ANNOTATION, manifest_digest)
        if read_blob is not None:
            data = read_blob(blob.digest, blob.size, f"{what}: profile", MAX_PROFILE_BYTES)
        else:
            data = src.read_small_blob(blob.digest, blob.size, f"{what}: profile", MAX_PROFILE_BYTES)
        return Profile.from_json(data, manifest_digest, layers)
    finally:
        src.close()


def push_profile(host: str, repository: str, profile: Profile, layer_order: Sequence[str],
                 plain_http: bool = False) -> str:
    """Publish `profile` next to its image, whose manifest lists `layer_order`; returns
    the reference it was pushed as."""
    missing = set(profile.layers) - set(layer_order)
    if missing:
        raise FormatError(f"profile of {profile.manifest}: layer {min(missing)} is not in the image")
    return _push_blob(host, repository, profile.manifest, profile.to_json(layer_order), plain_http)


def _push_blob(host: str, repository: str, manifest_digest: str, blob: bytes, plain_http: bool = False) -> str:
    """Push `blob` as the profile of the image `manifest_digest` (not checked: push_profile
    makes the blob; the lab pushes bad ones, tests/lab/provide.py)."""
    ref = DockerRef(host, repository, tag=profile_tag(manifest_digest))
    return push_artifact(ref, CONFIG_MEDIA_TYPE, PROFILE_MEDIA_TYPE, blob, {MANIFEST_ANNOTATION: manifest_digest},
                         plain_http)
