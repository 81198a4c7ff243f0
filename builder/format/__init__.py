"""The zstd:chunked layer format: footer, TOC, writer and reader side by side.

A zstd:chunked layer (containers/storage `pkg/chunked`) is a valid `tar+zstd` OCI layer
whose zstd frames are laid out so that any file can be fetched and decompressed alone:

    [frame: tar headers][frame: file A chunk 0][frame: file A chunk 1][frame: padding+headers]...
    [frame: end-of-archive blocks]
    [skippable frame: zstd(TOC JSON)]
    [skippable frame: zstd(tar-split JSON lines)]
    [skippable frame: 64-byte footer]

- Each regular file's content starts a new zstd frame, and each content-defined chunk
  of a large file is its own frame. Everything that is not file content (headers,
  padding, end-of-archive blocks) goes in the frames between them. `zstd -d` of the
  whole blob therefore yields the source tar byte for byte (skippable frames are
  ignored by decoders).

- `footer`: skippable frames, the footer (documented byte by byte above FOOTER_SIZE),
  the layer annotations and the TOC's location (pure: FormatError only).
- `toc`: the TOC model (Toc, Entry, Chunk), parse_toc and decompress_toc (pure).
- `writer`: LayerWriter (a tar stream in, a blob and its annotations out).
- `reader`: LayerReader (file-system answers from a TOC, sans I/O), the ChunkLoader
  and ChunkMemo seams, RangeLoader and decode_chunk.

The package imports nothing outside shoal/ and builder/, so it can be used alone.
Callers import from the module that defines a name; the names below are re-exported
for convenience.
"""

from importlib import import_module

# name -> the module that defines it, imported on first use (PEP 562): a process that
# needs the footer alone (`shoal pull`) does not pay for the writer's and reader's imports
_HOME = {
    **dict.fromkeys(("FOOTER_MAGIC", "FOOTER_SIZE", "MANIFEST_CHECKSUM", "MANIFEST_POSITION", "MANIFEST_TYPE_CRFS",
                     "OLD_FOOTER_MAGIC", "OLD_FOOTER_SIZE", "OLD_MANIFEST_CHECKSUM", "OLD_MANIFEST_POSITION",
                     "SKIPPABLE_MAGIC", "TARSPLIT_POSITION", "ZSTD_MAGIC", "Position", "TocLocation",
                     "location_from_annotations", "parse_footer", "skippable_frame"), "footer"),
    **dict.fromkeys(("ChunkLoader", "ChunkMemo", "LayerReader", "RangeLoader", "Stat", "decode_chunk"), "reader"),
    **dict.fromkeys(("Chunk", "Entry", "Toc", "decompress_toc", "format_timestamp", "parse_toc"), "toc"),
    **dict.fromkeys(("LayerResult", "LayerWriter", "WriterOptions"), "writer"),
}

__all__ = list(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
