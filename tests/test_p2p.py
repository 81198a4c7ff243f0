"""The swarm's parts, in one process: bencode and torrent metadata (checked against
libtorrent's own reader and writer), the tracker's peer table and HTTP service (aiohttp
on 127.0.0.1:0), and real libtorrent sessions exchanging pieces over loopback (each on
its own 127.0.0.x address). The multi-node tests in network namespaces are in
test_p2p_swarm.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
lt = pytest.importorskip("libtorrent", reason="libtorrent is needed for the swarm (shoal[node])")
from aiohttp import web

from cache.source import BlobRef, FetchChain, Held, NotHere, Source
from p2p import bencode, metainfo
from p2p.config import SwarmConfig
from p2p.ondemand import SwarmSource
from p2p.swarm import Swarm
from p2p.tracker.client import MetadataClient
from p2p.tracker.peers import PeerTable
from p2p.tracker.server import FileTorrents, mount, parse_query
from shoal.errors import DigestMismatch, FormatError
from tests.test_region import region_factory  # noqa: F401  (fixture)

# --- bencode ----------------------------------------------------------------------------------

BENCODE_TABLE = [
    (0, b"i0e"),
    (-42, b"i-42e"),
    (b"", b"0:"),
    (b"spam", b"4:spam"),
    ([], b"le"),
    ([1, b"a", [b"b"]], b"li1e1:al1:bee"),
    ({}, b"de"),
    ({b"b": 1, b"a": b"x"}, b"d1:a1:x1:bi1ee"),
]


@pytest.mark.parametrize("value, encoded", BENCODE_TABLE)
def test_bencode_table(value, encoded):
    assert bencode.encode(value) == encoded
    assert bencode.decode(encoded) == value
    with pytest.raises(FormatError):
        bencode.decode(encoded + b"x")  # trailing data
    for cut in range(len(encoded)):
        with pytest.raises(FormatError):
            bencode.decode(encoded[:cut])  # every truncation


@pytest.mark.parametrize("bad", [b"i01e", b"i-0e", b"ie", b"i-e", b"01:a", b"d1:bi1e1:ai2ee", b"d1:ai1e1:ai2ee",
                                 b"di1ei2ee", b"x", b"l" * 100 + b"e" * 100, b"5:abc"])
def test_bencode_rejects_noncanonical(bad):
    with pytest.raises(FormatError):
        bencode.decode(bad)


def test_bencode_fuzz_only_format_errors():
    rng = random.Random(5)
    seeds = [e for _, e in BENCODE_TABLE]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds) * rng.randint(1, 3))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            bencode.decode(bytes(data))
        except FormatError:
            pass


# --- metadata ----------------------------------------------------------------------------------


def _blob(tmp_path: Path, size: int, seed: int = 1) -> tuple[Path, str]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"blob-{seed}"
    path.write_bytes(data)
    return path, "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size", [1, 256 << 10, (256 << 10) + 1, 3 << 20])
def test_make_torrent_matches_libtorrent(tmp_path, size):
    """Our v1 metadata is what libtorrent itself makes from the same file."""
    path, digest = _blob(tmp_path, size)
    ours = metainfo.make_torrent(path, 256 << 10, "http://tracker.invalid/announce", digest=digest)
    meta, announce = metainfo.parse_torrent(ours, digest, size)
    assert announce == "http://tracker.invalid/announce"
    # libtorrent's writer, on a file of the same name
    (tmp_path / "lt").mkdir()
    os.link(path, tmp_path / "lt" / meta.name)
    ct = lt.create_torrent([lt.create_file_entry(meta.name, size)], 256 << 10, lt.create_torrent.v1_only)
    ct.set_priv(True)
    lt.set_piece_hashes(ct, str(tmp_path / "lt"))
    theirs = lt.torrent_info(lt.bencode(ct.generate()))
    ti = lt.torrent_info(ours)
    assert ti.info_hashes().v1.to_bytes() == meta.info_hash == theirs.info_hashes().v1.to_bytes()
    assert ti.priv() and not ti.info_hashes().has_v2()
    assert ti.num_pieces() == meta.num_pieces == -(-size // (256 << 10))


def test_metadata_is_made_only_from_verified_bytes(tmp_path):
    path, digest = _blob(tmp_path, 100_000)
    other = "sha256:" + "0" * 64
    with pytest.raises(DigestMismatch):
        metainfo.make_torrent(path, digest=other)
    with open(path, "rb") as fh:
        info = metainfo.make_info(fh, 100_000, digest)
    with pytest.raises(FormatError, match="names"):
        metainfo.parse_info(info, other)  # metadata of another blob
    with pytest.raises(FormatError, match="length"):
        metainfo.parse_info(info, digest, size=99_999)
    d = bencode.decode(info)
    del d[b"private"]
    with pytest.raises(FormatError, match="private"):
        metainfo.parse_info(bencode.encode(d), digest)


def test_piece_size_policy():
    assert metainfo.piece_size_for(1) == 256 << 10
    assert metainfo.piece_size_for(1 << 30) == 256 << 10
    assert metainfo.piece_size_for(30 << 30) == 2 << 20
    for size in (1, 5 << 30, 100 << 30):
        assert -(-size // metainfo.piece_size_for(size)) <= metainfo.TARGET_PIECES


def test_pieces_for_and_slice(tmp_path):
    path, digest = _blob(tmp_path, 1_000_000)
    data = path.read_bytes()
    with open(path, "rb") as fh:
        meta = metainfo.parse_info(metainfo.make_info(fh, len(data), digest, 64 << 10), digest)
    ranges = [(0, 1), (65535, 65537), (100_000, 400_000), (999_999, 1_000_000)]
    pieces = meta.pieces_for(ranges)
    assert pieces == sorted({0, 1, *range(1, 7), 15})
    got = metainfo.slice_pieces(meta, {p: data[slice(*meta.piece_span(p))] for p in pieces}, ranges)
    assert got == [data[a:b] for a, b in ranges]
    with pytest.raises(ValueError):
        meta.pieces_for([(0, 1_000_001)])


# --- the tracker ---------------------------------------------------------------------------------


def test_peer_table_rules():
    table = PeerTable(interval=10, rng=random.Random(1), max_answer=3)
    ih = b"\1" * 20
    assert table.announce(ih, "10.0.0.1", 6881, 100, "started", 50, now=0).peers == []
    for i in range(2, 7):
        table.announce(ih, f"10.0.0.{i}", 6881, 100, "started", 50, now=1)
    answer = table.announce(ih, "10.0.0.1", 6881, 100, "", 50, now=2)
    assert len(answer.peers) == 3 and ("10.0.0.1", 6881) not in answer.peers  # capped, not itself
    assert (answer.complete, answer.incomplete) == (0, 6)
    table.announce(ih, "10.0.0.2", 6881, 0, "completed", 50, now=3)
    seed_view = table.announce(ih, "10.0.0.3", 6881, 0, "", 50, now=3)
    assert ("10.0.0.2", 6881) not in seed_view.peers  # seeds are not told about seeds
    table.announce(ih, "10.0.0.4", 6881, 100, "stopped", 50, now=4)
    assert table.scrape(ih) == (2, 3, 1)
    assert table.expire(now=100) == 5 and table.statistics()["peers"] == 0
    with pytest.raises(ValueError):
        table.announce(b"short", "10.0.0.1", 6881, 0, "", 50, now=0)


def test_ranks_split_the_first_fetch():
    """Downloaders get ranks 0..n-1 in order of arrival; a leaver's rank goes to the last
    arrival; a completed or silent downloader leaves the ranking."""
    table = PeerTable(rank_ttl=10)
    ih = b"\2" * 20
    ips = [f"10.0.0.{i}" for i in range(1, 6)]
    for ip in ips:
        table.announce(ih, ip, 6881, 100, "started", 50, now=0)
    assert [table.rank(ih, ip, 6881, now=0) for ip in ips] == [(i, i + 1) for i in range(5)]
    assert table.rank(ih, ips[2], 6881, now=1) == (2, 5)
    table.announce(ih, ips[1], 6881, 0, "completed", 50, now=2)
    assert table.rank(ih, ips[4], 6881, now=3) == (1, 4)  # took the leaver's rank
    assert table.rank(ih, ips[2], 6881, now=3) == (2, 4)  # unchanged
    assert table.rank(ih, ips[2], 6881, now=14) == (0, 1)  # the others stopped asking


def test_tracker_ranks_only_announced_peers_and_stays_bounded():
    """A rank needs an announce from the same address (and port); one address announces
    few ports; the table forgets the least recently announced swarm to make room."""
    table = PeerTable(max_swarms=3, max_ports_per_ip=2)
    ih = b"\3" * 20
    with pytest.raises(ValueError, match="has not announced"):
        table.rank(ih, "10.0.0.1", 6881, now=0)
    table.announce(ih, "10.0.0.1", 6881, 100, "started", 50, now=0)
    assert table.rank(ih, "10.0.0.1", None, now=0) == (0, 1)  # the port from the announce
    with pytest.raises(ValueError, match="has not announced"):
        table.rank(ih, "10.0.0.1", 7000, now=0)  # a port of its own choosing counts for nothing
    with pytest.raises(ValueError, match="has not announced"):
        table.rank(ih, "10.0.0.2", 6881, now=0)  # nor another address's
    table.announce(ih, "10.0.0.1", 6882, 100, "started", 50, now=0)
    with pytest.raises(ValueError, match="more than 2 ports"):
        table.announce(ih, "10.0.0.1", 6883, 100, "started", 50, now=0)
    assert table.statistics()["peers"] == 2 and table.statistics()["refused"] == 4
    for i in range(4, 10):
        table.announce(bytes([i]) * 20, "10.0.0.1", 6881, 100, "started", 50, now=1)
        table.announce(ih, "10.0.0.1", 6881, 100, "", 50, now=1)  # keeps ih the most recent
    stats = table.statistics()
    assert stats["swarms"] == 3 and stats["swarms_evicted"] == 4 and stats["ranked_swarms"] == 1
    assert table.rank(ih, "10.0.0.1", 6881, now=2) == (0, 1)


def test_a_seed_is_never_ranked_among_the_downloaders():
    """A node's last rank request may reach the tracker after its completion announce:
    the seed then took a rank again and kept its extents from the others until the rank
    expired (10 s; the kill test's 1.26 copies, every node helping the stalled swarm)."""
    table = PeerTable()
    ih = b"\4" * 20
    for ip in ("10.0.0.1", "10.0.0.2"):
        table.announce(ih, ip, 6881, 100, "started", 50, now=0)
        table.rank(ih, ip, 6881, now=0)
    table.announce(ih, "10.0.0.1", 6881, 0, "completed", 50, now=1)
    assert table.rank(ih, "10.0.0.2", 6881, now=1) == (0, 1)
    with pytest.raises(ValueError, match="a seed has no rank"):
        table.rank(ih, "10.0.0.1", 6881, now=1)  # the late request of the node that completed
    assert table.rank(ih, "10.0.0.2", 6881, now=2) == (0, 1)


def test_jump_hash_is_balanced_and_moves_little():
    from p2p.extents import extent_key, jump_hash

    keys = [extent_key(b"\3" * 20, e) for e in range(4096)]
    for n in (1, 2, 16, 1000):
        counts = [0] * n
        for k in keys:
            counts[jump_hash(k, n)] += 1
        assert sum(counts) == 4096 and max(counts) <= 4096 / n * 1.5 + 10
    moved = sum(jump_hash(k, 16) != jump_hash(k, 17) for k in keys)
    assert moved < 4096 / 17 * 1.5  # about 1/17 of the extents move to the newcomer


def test_a_swarm_whose_peers_gain_pieces_is_not_stalled():
    """Stall help (p2p/extents.py) waits while the peers' pieces grow, though this node
    gets none; a peer leaving is no progress; with nothing moving the swarm stalls."""
    from p2p.extents import assign, extent_key, jump_hash, progress

    info_hash = b"\1" * 20
    mine = [jump_hash(extent_key(info_hash, e), 2) == 0 for e in range(8)]
    assert 0 < sum(mine) < 8
    have = [int(mine[p // 4]) for p in range(32)]  # this node (rank 0 of 2) has its own extents

    def stalled(last_progress: float, now: float) -> str:
        got = assign(info_hash=info_hash, num_pieces=32, per=4, have=have, inflight=(), availability=[0] * 32,
                     running=(), me="a", candidates={"a", "b"}, rank=(0, 2, now), rank_changed=0.0,
                     ranks_expected=True, now=now, added=0.0, last_progress=last_progress, stall_timeout=3.0,
                     limit=4, rng=random.Random(1))
        return got.why if got.todo else "waits"

    last, seen = progress(0.0, 0, [1, 1, 0, 0], 1.0)  # peers' bitfields: the swarm moved at 1.0
    assert (last, seen) == (1.0, 2)
    last, seen = progress(last, seen, [1, 1, 1, 0], 5.0)  # a peer's owner brought a piece in
    assert (last, seen) == (5.0, 3)
    assert stalled(last, 7.0) == "waits"  # 6 s since this node's last piece, 2 s since its peers'
    last, seen = progress(last, seen, [0, 0, 0, 0], 8.0)  # the peer left with its pieces
    assert (last, seen) == (5.0, 0)
    last, seen = progress(last, seen, [0, 0, 0, 0], 9.0)
    assert (last, seen) == (5.0, 0)
    assert stalled(last, 9.0) == "stalled"  # nothing moved for 4 s: help


class ServiceThread:
    """The swarm service (tracker + metadata) in an aiohttp server on a thread."""

    def __init__(self, torrents=None, interval: int = 10, host: str = "127.0.0.1") -> None:
        self.loop = asyncio.new_event_loop()
        self.torrents = torrents
        self.interval = interval
        self.host = host
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.url = f"http://{host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        mount(app, torrents=self.torrents, table=PeerTable(interval=self.interval))
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, self.host, self.port)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _get(url: str) -> tuple[int, dict, bytes]:
    import requests

    r = requests.get(url, timeout=5)
    return r.status_code, r.headers, r.content


def test_service_announce_and_torrents(tmp_path):
    path, digest = _blob(tmp_path, 300_000)
    service = ServiceThread(FileTorrents(tmp_path / "torrents", lambda d: str(path) if d == digest else None))
    try:
        status, headers, body = _get(f"{service.url}/p2p/v1/torrents/{digest}")
        assert status == 200 and headers["Content-Type"] == "application/x-bittorrent"
        meta, announce = metainfo.parse_torrent(body, digest, 300_000)
        assert announce == f"{service.url}/p2p/v1/announce"
        assert _get(f"{service.url}/p2p/v1/torrents/sha256:{'1' * 64}")[0] == 404
        assert _get(f"{service.url}/p2p/v1/torrents/latest")[0] == 400
        ih = "".join(f"%{b:02x}" for b in meta.info_hash)
        for port in (7001, 7002):
            status, _, body = _get(f"{announce}?info_hash={ih}&peer_id=-XX0000-{port:012d}&port={port}"
                                   f"&uploaded=0&downloaded=0&left=5&event=started&compact=1")
        answer = bencode.decode(body)
        assert answer[b"peers"] == socket.inet_aton("127.0.0.1") + (7001).to_bytes(2, "big")  # BEP 23
        assert answer[b"interval"] == 10 and answer[b"incomplete"] == 2
        _, _, body = _get(f"{announce}?info_hash={ih}&port=7003&left=0&compact=0")
        assert bencode.decode(body)[b"peers"] == [{b"ip": b"127.0.0.1", b"port": 7001},
                                                    {b"ip": b"127.0.0.1", b"port": 7002}]
        _, _, body = _get(f"{announce}?info_hash=abc&port=1")
        assert b"failure reason" in bencode.decode(body)
        rank_url = announce.replace("/announce", "/rank")
        assert json.loads(_get(f"{rank_url}?info_hash={ih}&port=7001")[2]) == {"rank": 0, "of": 1, "ttl": 10.0}
    finally:
        service.stop()


def test_parse_query_keeps_binary():
    q = parse_query("info_hash=%00%ff%20a&port=1&info_hash=ignored")
    assert q["info_hash"] == b"\x00\xff a" and q["port"] == b"1"


# --- sessions over loopback ------------------------------------------------------------------------


class MemorySource(Source):
    """The region, in memory: counts the bytes it serves; can be turned off."""

    name = "region"

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs, self.bytes, self.up = blobs, 0, True

    def read_ranges(self, blob, ranges):
        if not self.up:
            raise NotHere("region down")
        self.bytes += sum(b - a for a, b in ranges)
        return [self.blobs[blob.digest][a:b] for a, b in ranges]


@pytest.fixture
def loopback_swarm(tmp_path):
    """make(i, **config) -> (Swarm, MemorySource): node i on 127.0.0.(10+i)."""
    data = random.Random(7).randbytes(6 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (tmp_path / "blob").write_bytes(data)
    service = ServiceThread(FileTorrents(tmp_path / "torrents", lambda d: str(tmp_path / "blob")))
    made: list[Swarm] = []

    def make(i: int, **overrides):
        source = MemorySource({digest: data})
        config = SwarmConfig(enabled=True, storage=str(tmp_path / f"n{i}"), listen=f"127.0.0.{10 + i}:6881",
                             advertise_ip=f"127.0.0.{10 + i}", ssrf_mitigation=False, **overrides)
        swarm = Swarm(config, MetadataClient(service.url, tmp_path / f"n{i}" / "meta"), FetchChain([source]))
        made.append(swarm.start())
        return swarm, source

    make.blob = BlobRef("registry.invalid", "test/blob", digest, len(data))
    make.data = data
    make.service = service
    try:
        yield make
    finally:
        for swarm in made:
            swarm.close()
        service.stop()


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_on_demand_read_shares_what_it_fetched(loopback_swarm):
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, region_a = loopback_swarm(1)
    ranges = [(0, 100), (1 << 20, (3 << 20) + 7), (len(data) - 10, len(data))]
    got = a.read(blob, ranges)
    assert got == [data[x:y] for x, y in ranges] and all(isinstance(d, Held) for d in got)
    assert region_a.bytes == 11 * (256 << 10)  # whole pieces (0, 4..12, 23), so that they can be shared
    b, region_b = loopback_swarm(2)
    assert b.ensure(blob) is not None
    assert _wait(lambda: b.statistics()["peers_connected"] >= 1)
    got = b.read(blob, [(1 << 20, 2 << 20)])  # pieces node a has: from a, not the region
    assert got == [data[1 << 20:2 << 20]]
    assert region_b.bytes == 0 and b.statistics()["read_pieces_peers"] == 4
    assert b.read(blob, [(5 << 20, 6 << 20)]) == [data[5 << 20:]]  # pieces 20-22 from the region, 23 from a
    assert region_b.bytes == 3 * (256 << 10)


def test_download_completes_verifies_and_seeds(loopback_swarm):
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, region_a = loopback_swarm(1)
    path = a.download(blob, timeout=30)
    assert Path(path).read_bytes() == data and region_a.bytes == len(data)
    b, region_b = loopback_swarm(2)
    assert Path(b.download(blob, timeout=30)).read_bytes() == data
    assert region_b.bytes == 0 and b.statistics()["bytes_from_peers"] >= len(data)
    assert a.statistics()["bytes_to_peers"] >= len(data)
    assert b.has(blob) == "complete"
    got = b.read(blob, [(10, 20)])  # complete: straight from the file
    assert got == [data[10:20]]


def test_pieces_a_node_had_survive_its_restart_checked_again(loopback_swarm, tmp_path):
    """The swarm's bytes are the node's one copy of them (never also in the chunk store),
    so they outlive a restart: the new session adds the blob's torrent again over the
    earlier run's file, libtorrent checks each piece against its SHA-1, and the pieces
    that pass are read locally; one spoiled between the runs is fetched again."""
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, region_a = loopback_swarm(1)
    ranges = [(0, 100), (1 << 20, (3 << 20) + 7), (len(data) - 10, len(data))]
    assert a.read(blob, ranges) == [data[x:y] for x, y in ranges]
    assert region_a.bytes == 11 * (256 << 10)  # pieces 0, 4..12, 23
    a.close()
    piece = 256 << 10
    with open(tmp_path / "n1" / "data" / f"sha256-{blob.digest[7:]}", "r+b") as fh:  # spoil piece 5
        fh.seek(5 * piece + 1000)
        fh.write(b"\xff" * 16)
    again, region_again = loopback_swarm(1)
    assert _wait(lambda: again.statistics()["pieces_resumed"] >= 10)
    assert again.statistics()["pieces_resumed"] == 10 and again.has(blob) == "partial"
    assert again.read(blob, ranges) == [data[x:y] for x, y in ranges]
    assert region_again.bytes == piece  # piece 5 alone, fetched again
    unseen = tmp_path / "n1" / "data" / ("sha256-" + "3" * 64)
    unseen.write_bytes(b"no mark: not ours")
    again.close()
    third, _ = loopback_swarm(1)
    assert not unseen.exists()  # a file without a mark is dropped at start
    assert _wait(lambda: third.statistics()["pieces_resumed"] >= 11)


def _peer_sockets_nodelay(ports: set[int]) -> list[int]:
    """TCP_NODELAY of each connected TCP socket of this process with an end on `ports`."""
    from p2p.session import tcp_sockets

    out = []
    for sock in tcp_sockets():
        try:
            ends = {sock.getsockname()[1], sock.getpeername()[1]}
        except OSError:
            continue  # listening
        if ends & ports:
            out.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    return out


def test_peer_connections_send_without_waiting_for_acks(loopback_swarm):
    """libtorrent leaves Nagle's algorithm on for its peer connections: the session turns it
    off (TCP_NODELAY), or an on-demand read a peer answers waits for delayed ACKs."""
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, _ = loopback_swarm(1)
    a.download(blob, timeout=30)
    b, region_b = loopback_swarm(2)
    assert b.read(blob, [(0, 1000)]) == [data[:1000]] and region_b.bytes == 0  # from a
    ports = {a.listen_port, a.ssl_listen_port}
    assert _wait(lambda: (got := _peer_sockets_nodelay(ports)) and all(got)), _peer_sockets_nodelay(ports)


def test_session_ticks_fast_only_under_a_rate_limit(loopback_swarm):
    """A live session ticks every 20 ms when a rate limit is set (quota in small steps),
    at libtorrent's 500 ms otherwise (50 wakeups a second cost a start CPU)."""
    plain, _ = loopback_swarm(1)
    capped, _ = loopback_swarm(2, upload_rate_limit=10 << 20)
    ticks = [s.session.call(lambda s=s: s.session._ses.get_settings()["tick_interval"]).result(10)
             for s in (plain, capped)]
    assert ticks == [500, 20]


def test_a_read_waiting_on_a_peer_that_leaves_takes_the_rest_from_the_region(loopback_swarm):
    """A read waiting on pieces asked of the one peer that had them, which leaves mid-read
    (its session closed), takes the pieces still missing from the region as soon as the
    owner sees that no connected peer has them: counted as peer_gone_pieces, with no peer
    timeout (peer_wait is 60 s here: without the release the read waits that long, then
    counts every piece still missing as a timeout)."""
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, _ = loopback_swarm(1, upload_rate_limit=512 << 10)  # 24 pieces of 256 KiB: about 12 s
    a.download(blob, timeout=30)
    b, region_b = loopback_swarm(2, peer_wait=60.0)
    b.ensure(blob)  # (until b counts a as a seed, b's plan asks the region for every piece)
    assert _wait(lambda: b.statistics()["torrents"][0]["seeds"] >= 1)
    done: list = []
    reader = threading.Thread(target=lambda: done.append(b.read(blob, [(0, len(data))])), daemon=True)
    reader.start()
    assert _wait(lambda: b.statistics()["bytes_from_peers"] >= 256 << 10)  # the read is under way, from a
    a.close()
    reader.join(timeout=120)
    assert done == [[data]]
    figures = b.statistics()
    assert figures["peer_gone_pieces"] >= 1 and figures["peer_timeouts"] == 0, figures
    assert 0 < region_b.bytes < len(data)  # the rest, not the whole blob again


def test_tracker_and_region_outages_never_fail_a_read(loopback_swarm):
    """Connected peers keep exchanging when the tracker is gone; a node that cannot
    reach the tracker reads from the region; a node with neither says NotHere."""
    blob, data = loopback_swarm.blob, loopback_swarm.data
    a, _ = loopback_swarm(1)
    a.download(blob, timeout=30)
    b, region_b = loopback_swarm(2)
    b.ensure(blob)
    assert _wait(lambda: b.statistics()["peers_connected"] >= 1)
    loopback_swarm.service.stop()  # tracker and metadata service gone
    assert b.read(blob, [(0, len(data))]) == [data]
    assert region_b.bytes == 0  # all from the peer met before the outage
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/announce"
    c, region_c = loopback_swarm(3, tracker_url=dead)
    c.metadata = b.metadata  # metadata from b's disk cache (the service is down)
    assert c.read(blob, [(0, 1000)]) == [data[:1000]]
    assert region_c.bytes == 256 << 10
    d, _ = loopback_swarm(4)
    other = BlobRef("registry.invalid", "test/blob", "sha256:" + "2" * 64, 10)
    with pytest.raises(NotHere):
        SwarmSource(d).read_ranges(other, [(0, 10)])


def test_assembled_chain_puts_the_swarm_first(tmp_path, loopback_swarm):
    from snapshotter.assemble import make_chain

    config = {"region_url": loopback_swarm.service.url, "root": str(tmp_path / "node"),
              "swarm": {"enabled": True, "listen": "127.0.0.30:6881", "ssrf_mitigation": False}}
    chain = make_chain(config)
    try:
        assert [s.name for s in chain.sources] == ["swarm", "region", "origin"]
        stats = chain.statistics()
        assert "peers_connected" in stats["swarm"] and "bytes_from_peers" in stats["swarm"]
    finally:
        chain.close()
    assert [s.name for s in make_chain({"region_url": "http://127.0.0.1:1"}).sources] == ["region", "origin"]


# --- the swarm's fallback verifies what the region and the origin send ------------------------


def test_pieces_that_fail_their_hash_are_never_returned(tmp_path, registry, region_factory):  # noqa: F811
    """A swarm whose fallback is the real region (its stored copy of the blob corrupt)
    and the real origin: each piece from the region fails its SHA-1, so the chain takes
    it from the origin; the region is counted. With the region alone, the read raises
    (TransportError: the outer chain goes on) instead of returning the bad piece."""
    from cache.origin import OriginSource
    from cache.region.client import RegionSource
    from shoal.errors import TransportError
    from tests.test_region import push_blob

    region = region_factory(registry)
    paths = {}

    def corrupt_in_region(seed: int) -> tuple[BlobRef, bytes]:
        data = random.Random(seed).randbytes(2 << 20)
        digest = push_blob(registry, "swarm/verify", data, tmp_path)
        paths[digest] = tmp_path / f"blob{seed}"
        paths[digest].write_bytes(data)
        blob = BlobRef(registry.host, "swarm/verify", digest, len(data), plain_http=True)
        assert RegionSource(region.url).read_ranges(blob, [(0, 10)]) == [data[:10]]
        region.wait_idle()
        bad = bytearray(data)
        for p in range(len(data) // (256 << 10)):
            bad[p * (256 << 10) + 100] ^= 0xFF  # every piece
        with open(region.backend.local_path(digest), "r+b") as fh:
            fh.write(bad)
        return blob, data

    service = ServiceThread(FileTorrents(tmp_path / "torrents", lambda d: str(paths[d])))
    swarms = []
    ranges = [(0, 100), (1 << 20, (1 << 20) + 300_000)]
    try:
        for i, sources in enumerate(([RegionSource(region.url), OriginSource()], [RegionSource(region.url)])):
            blob, data = corrupt_in_region(20 + i)
            chain = FetchChain(sources)
            config = SwarmConfig(enabled=True, storage=str(tmp_path / f"n{i}"), listen=f"127.0.0.{40 + i}:6881",
                                 advertise_ip=f"127.0.0.{40 + i}", ssrf_mitigation=False)
            swarm = Swarm(config, MetadataClient(service.url, tmp_path / f"n{i}" / "meta"), chain).start()
            swarms.append(swarm)
            if i == 0:
                assert swarm.read(blob, ranges) == [data[a:b] for a, b in ranges]
                stats = chain.statistics()
                assert stats["region"]["verify_failures"] >= 1 and stats["origin"]["bytes"] > 0, stats
                assert stats["origin"]["verify_failures"] == 0
            else:
                with pytest.raises(TransportError, match="failed verification"):
                    SwarmSource(swarm).read_ranges(blob, ranges)
                assert chain.statistics()["region"]["verify_failures"] >= 1
    finally:
        for swarm in swarms:
            swarm.close()
        service.stop()
