"""A preheat job's parts (prefetch/warmup.py `rotation`, `check_part`): node I of N
fetches every entry of its target once, its own part first, the parts contiguous and of
about equal compressed bytes, the nodes' first parts all different. Pure functions; the
swarm test (tests/test_p2p_swarm.py) measures what this saves the region."""

from __future__ import annotations

import random

import pytest

from prefetch.warmup import check_part, rotation


def _entries(seed: int, count: int) -> list[list]:
    rnd = random.Random(seed)
    out, at = [], 0
    for i in range(count):
        size = rnd.randint(1, 300_000)
        out.append([f"sha256:{i % 3:064x}", at, at + size])
        at += size + rnd.randint(0, 1000)
    return out


@pytest.mark.parametrize("of", [1, 2, 3, 4, 7])
def test_every_entry_once_own_part_first_parts_of_about_equal_bytes(of):
    entries = _entries(of, 400)
    total = sum(e[2] - e[1] for e in entries)
    firsts = set()
    for rank in range(of):
        order = rotation(entries, (rank, of))
        assert sorted(map(tuple, (e for _, e in order))) == sorted(map(tuple, entries))  # each once
        numbers = [n for n, _ in order]
        assert numbers[0] == rank and numbers == sorted(numbers, key=lambda n: (n - rank) % of)
        by_part: dict[int, list] = {}
        for n, e in order:
            by_part.setdefault(n, []).append(e)
        assert sorted(by_part) == list(range(of))
        for number, part in by_part.items():  # contiguous in the target's order: the own part in
            if number != rank:  # that order, the others from their end backwards (their owners
                part = part[::-1]  # fetch them from their start)
            at = entries.index(part[0])
            assert entries[at:at + len(part)] == part
            assert abs(sum(e[2] - e[1] for e in part) - total / of) <= 300_000  # one entry's size at most
        firsts.add(tuple(order[0][1]))
    assert len(firsts) == of  # every node starts somewhere else
    if of == 1:
        assert [e for _, e in rotation(entries, (0, 1))] == entries  # today's order


def test_bad_entries_are_left_out_and_few_entries_leave_parts_empty():
    good = [["sha256:" + "a" * 64, 0, 10], ["sha256:" + "a" * 64, 10, 30]]
    bad = [["x", 1], "text", ["sha256:" + "a" * 64, 1.5, 9], ["sha256:" + "a" * 64, True, 9], None]
    assert [e for _, e in rotation(good + bad, (0, 1))] == good
    assert sorted(map(tuple, (e for _, e in rotation(good + bad, (3, 5))))) == sorted(map(tuple, good))
    assert rotation([], (2, 4)) == []


@pytest.mark.parametrize("part", [[1, 1], [-1, 2], [0, 0], [2], "0/1", [0.5, 2], [True, 2], [0, 10**7]])
def test_a_bad_part_is_a_value_error_naming_it(part):
    with pytest.raises(ValueError, match="part"):
        check_part(part)


def test_no_part_is_0_of_1():
    assert check_part(None) == (0, 1) and check_part([2, 3]) == (2, 3) and check_part((0, 1)) == (0, 1)


def test_the_region_ranks_the_nodes_up_by_name_and_gives_the_others_no_part():
    pytest.importorskip("aiohttp", reason="aiohttp is needed for the region (shoal[node])")
    from region.preheat import _job_nodes

    nodes = _job_nodes(["n3", "n1", "ghost", "n2"], up={"n1", "n2", "n3", "other"})
    assert list(nodes) == ["n3", "n1", "ghost", "n2"]  # the job lists them as named
    assert {n: jn.part for n, jn in nodes.items()} == {"n1": (0, 3), "n2": (1, 3), "n3": (2, 3), "ghost": (0, 1)}
    assert _job_nodes(["n1"], up={"n1"})["n1"].part == (0, 1)
