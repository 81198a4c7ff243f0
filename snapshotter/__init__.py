"""containerd's snapshotter side of shoal (see docs/snapshotter.md)."""

DEFAULT_CONTAINERD_ADDRESS = "/run/containerd/containerd.sock"  # `shoal pull --address`
