"""Image references: parse the strings `shoal convert SRC DST` takes and open them.

Accepted forms:
- `docker://HOST[:PORT]/REPO[:TAG]`, `docker://HOST[:PORT]/REPO[:TAG]@sha256:<hex>`
  (the first path component is always the registry host; the tag defaults to `latest`
  unless a digest is given, and a digest wins over a tag when both are given)
- `oci:DIR[:TAG]` (DIR contains no colon; TAG is the `org.opencontainers.image.ref.name`)
- `docker-archive:FILE[:REPO:TAG]` or `docker-archive:FILE[:@INDEX]` (source only; FILE
  contains no colon; the default image is the archive's first)

Registry references without a transport (`HOST[:PORT]/REPO[:TAG][@DIGEST]`, as `shoal
pull` and containerd's image labels give them) go through parse_registry_ref, which can
also read containerd's short names (`busybox`, `org/app`: on docker.io).

Every malformed reference raises shoal.errors.UsageError with a one-line message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from builder.oci.base import ImageDestination, ImageSource
from shoal.digest import is_digest
from shoal.errors import UsageError

# distribution/reference grammar (repository path components and tags)
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO_RE = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_HOST_RE = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$"
)
# OCI image layout ref.name grammar (image-spec annotations.md)
_REF_COMPONENT = r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*"
_REF_NAME_RE = re.compile(rf"^{_REF_COMPONENT}(?:/{_REF_COMPONENT})*$")

DEFAULT_TAG = "latest"
DOCKER_HUB = "docker.io"  # the registry of a short name (parse_registry_ref)


@dataclass(frozen=True)
class DockerRef:
    """A repository in a registry, by tag or by digest (digest wins when both are set)."""

    host: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What the registry API calls the reference: the digest, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def __str__(self) -> str:
        text = f"docker://{self.host}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


@dataclass(frozen=True)
class LayoutRef:
    """An OCI image layout directory and an optional ref name."""

    path: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"oci:{self.path}" + (f":{self.tag}" if self.tag else "")


@dataclass(frozen=True)
class ArchiveRef:
    """A `docker save` tar file and an optional image selector (`REPO:TAG` or `@N`)."""

    path: str
    image: str | None = None

    def __str__(self) -> str:
        return f"docker-archive:{self.path}" + (f":{self.image}" if self.image else "")


Reference = DockerRef | LayoutRef | ArchiveRef


def parse_reference(text: str) -> Reference:
    """Parse a reference string; raise UsageError naming the problem if malformed."""
    if not isinstance(text, str) or not text:
        raise UsageError("empty image reference")
    _check_characters(text)
    if text.startswith("docker://"):
        return _parse_docker(text)
    if text.startswith("oci:"):
        return _parse_layout(text)
    if text.startswith("docker-archive:"):
        return _parse_archive(text)
    raise UsageError(
        f"{text}: unknown transport (want docker://HOST/REPO[:TAG], oci:DIR[:TAG] "
        "or docker-archive:FILE)"
    )


def parse_registry_ref(text: str, short_names: bool = False) -> DockerRef:
    """Parse `[docker://]HOST[:PORT]/REPO[:TAG][@DIGEST]`; raise UsageError if malformed.

    Without `short_names` the first path component is always the registry host, as in
    docker:// references. With it, names read as containerd and CRI write them: a first
    component that is no host (no "." or ":", not "localhost"), or no "/" at all, means
    the repository is on docker.io, and a one-component name is under `library/`
    (`busybox` -> docker.io/library/busybox, `org/app` -> docker.io/org/app).
    """
    name = text.removeprefix("docker://")
    if short_names:
        host, slash, _ = name.split("@", 1)[0].partition("/")
        if not slash:
            name = f"{DOCKER_HUB}/library/{name}"
        elif "." not in host and ":" not in host and host != "localhost":
            name = f"{DOCKER_HUB}/{name}"
    text = f"docker://{name}"
    _check_characters(text)
    return _parse_docker(text)


def _check_characters(text: str) -> None:
    if any(ch in text for ch in "\n\r\0"):
        raise UsageError(f"{text!r}: image reference contains a control character")


def _parse_docker(text: str) -> DockerRef:
    rest = text[len("docker://"):]
    name, at, digest = rest.partition("@")
    if at and not is_digest(digest):
        raise UsageError(f"{text}: malformed digest (want @sha256:<64 lowercase hex>)")
    host, slash, path = name.partition("/")
    if not slash or not host or not path:
        raise UsageError(f"{text}: want docker://HOST[:PORT]/REPO[:TAG]")
    if not _HOST_RE.match(host):
        raise UsageError(f"{text}: malformed registry host {host!r}")
    repository, tag = path, None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        repository, _, tag = path.rpartition(":")
        if not _TAG_RE.match(tag):
            raise UsageError(f"{text}: malformed tag {tag!r}")
    if not _REPO_RE.match(repository) or len(repository) > 255:
        raise UsageError(
            f"{text}: malformed repository {repository!r} "
            "(lowercase letters, digits and separators . _ - /)"
        )
    if tag is None and not at:
        tag = DEFAULT_TAG
    return DockerRef(host=host, repository=repository, tag=tag, digest=digest or None)


def _parse_layout(text: str) -> LayoutRef:
    path, colon, tag = text[len("oci:"):].partition(":")
    if not path:
        raise UsageError(f"{text}: want oci:DIR[:TAG]")
    if colon and not _REF_NAME_RE.match(tag):
        raise UsageError(f"{text}: malformed tag {tag!r} (the directory may contain no colon)")
    return LayoutRef(path=path, tag=tag or None)


def _parse_archive(text: str) -> ArchiveRef:
    path, colon, image = text[len("docker-archive:"):].partition(":")
    if not path:
        raise UsageError(f"{text}: want docker-archive:FILE[:REPO:TAG]")
    if colon:
        if image.startswith("@"):
            if not image[1:].isdigit():
                raise UsageError(f"{text}: malformed image index {image!r} (want @N)")
        elif not _archive_name_ok(image):
            raise UsageError(f"{text}: malformed image name {image!r} (want REPO:TAG)")
    return ArchiveRef(path=path, image=image or None)


def _archive_name_ok(name: str) -> bool:
    # docker save's RepoTags entries: [HOST[:PORT]/]NAME[:TAG], matched literally later
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:-]*", name)) and len(name) <= 512


def open_source(ref: str, plain_http: bool = False) -> ImageSource:
    """Open a reference for reading. Raises UsageError for a malformed reference."""
    parsed = parse_reference(ref)
    if isinstance(parsed, DockerRef):
        from builder.oci.registry import RegistrySource

        return RegistrySource(parsed, plain_http=plain_http)
    if isinstance(parsed, LayoutRef):
        from builder.oci.layout import LayoutSource

        return LayoutSource(parsed.path, parsed.tag)
    from builder.oci.archive import ArchiveSource

    return ArchiveSource(parsed.path, parsed.image)


def check_destination(ref: str) -> DockerRef | LayoutRef:
    """Parse a reference that will be written to; docker-archive: is refused (source only)."""
    parsed = parse_reference(ref)
    if isinstance(parsed, ArchiveRef):
        raise UsageError(f"{ref}: docker-archive: can only be a source")
    return parsed


def open_destination(ref: str, plain_http: bool = False) -> ImageDestination:
    """Open a reference for writing. docker-archive: is refused (source only)."""
    parsed = check_destination(ref)
    if isinstance(parsed, DockerRef):
        from builder.oci.registry import RegistryDestination

        return RegistryDestination(parsed, plain_http=plain_http)
    from builder.oci.layout import LayoutDestination

    return LayoutDestination(parsed.path, parsed.tag)
