"""Shared pieces of shoal: errors, digests, OCI media types. Small and free of I/O policy."""
