"""OCI and Docker media types shoal reads and writes."""

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_NONDIST_TAR = "application/vnd.oci.image.layer.nondistributable.v1.tar"
OCI_LAYER_NONDIST_GZIP = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
OCI_LAYER_NONDIST_ZSTD = "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"

DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_FOREIGN_GZIP = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"

INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)

# What a manifest's Accept header asks a registry for.
ACCEPT_MANIFESTS = ", ".join(INDEX_TYPES + MANIFEST_TYPES)

LAYER_COMPRESSION = {
    OCI_LAYER_TAR: "none",
    OCI_LAYER_NONDIST_TAR: "none",
    OCI_LAYER_GZIP: "gzip",
    OCI_LAYER_NONDIST_GZIP: "gzip",
    DOCKER_LAYER_GZIP: "gzip",
    DOCKER_LAYER_FOREIGN_GZIP: "gzip",
    OCI_LAYER_ZSTD: "zstd",
    OCI_LAYER_NONDIST_ZSTD: "zstd",
}
