"""Ring sizes in bytes: the same meaning with 4 KiB and 64 KiB pages, and memory budgets
rounded to what perf rings allow (issue 20, item 6). Pure arithmetic, no kernel."""

from __future__ import annotations

import pytest

import aperf
from aperf._options import (
    MAX_RING_BYTES,
    budget_ring_bytes,
    check_memory_bytes,
    ring_data_bytes,
)

KIB = 1024
MIB = 1024 * KIB
PAGE_SIZES = [4 * KIB, 64 * KIB]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_ring_bytes_round_up_to_a_power_of_two_pages(page_size: int) -> None:
    assert ring_data_bytes(None, 1 * MIB, page_size) == 1 * MIB  # the same on both
    assert ring_data_bytes(None, 1, page_size) == page_size
    assert ring_data_bytes(None, 3 * page_size, page_size) == 4 * page_size
    assert ring_data_bytes(None, MAX_RING_BYTES, page_size) == MAX_RING_BYTES
    assert ring_data_bytes(2, None, page_size) == 2 * page_size  # pages mean pages


def test_ring_bytes_on_64k_pages_is_not_sixteen_times_bigger() -> None:
    # tracee #4817: a size in pages meant 16x the memory on 64 KiB hosts.
    assert ring_data_bytes(None, 256 * KIB, 4 * KIB) == ring_data_bytes(None, 256 * KIB, 64 * KIB)
    assert ring_data_bytes(None, 8 * KIB, 64 * KIB) == 64 * KIB  # one page at least


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_budget_rounds_down_to_the_largest_rings_that_fit(page_size: int) -> None:
    rings = 2
    for memory in (rings * 2 * page_size, 10 * MIB, 64 * MIB + 12345, 3 * MIB):
        data = budget_ring_bytes(memory, rings, page_size)
        pages = data // page_size
        assert pages & (pages - 1) == 0 and data % page_size == 0
        assert rings * (data + page_size) <= memory  # within the budget
        assert rings * (2 * data + page_size) > memory  # and the next size up is not


def test_budget_figures_for_both_page_sizes() -> None:
    # 8 MiB over 2 rings: 4 MiB each minus the metadata page, rounded down to 2 MiB.
    assert budget_ring_bytes(8 * MIB, 2, 4 * KIB) == 2 * MIB
    assert budget_ring_bytes(8 * MIB, 2, 64 * KIB) == 2 * MIB
    # 8 MiB + 2 metadata pages over 2 rings: exactly 4 MiB each.
    assert budget_ring_bytes(8 * MIB + 2 * 4 * KIB, 2, 4 * KIB) == 4 * MIB
    assert budget_ring_bytes(8 * MIB + 2 * 64 * KIB, 2, 64 * KIB) == 4 * MIB
    # 1 MiB over 64 CPUs: 16 KiB each -> 3 data pages of 4 KiB round to 2; on 64 KiB pages
    # a ring needs 128 KiB: impossible.
    assert budget_ring_bytes(1 * MIB, 64, 4 * KIB) == 8 * KIB
    with pytest.raises(aperf.RingSizeError, match="smallest possible is 8388608"):
        budget_ring_bytes(1 * MIB, 64, 64 * KIB)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_an_impossible_budget_says_the_smallest_and_largest(page_size: int) -> None:
    rings = 3
    smallest = rings * 2 * page_size
    largest = rings * (MAX_RING_BYTES + page_size)
    assert budget_ring_bytes(smallest, rings, page_size) == page_size
    assert budget_ring_bytes(largest, rings, page_size) == MAX_RING_BYTES
    for memory in (smallest - 1, largest + 1):
        with pytest.raises(aperf.RingSizeError) as info:
            budget_ring_bytes(memory, rings, page_size)
        message = str(info.value)
        assert f"smallest possible is {smallest}," in message
        assert f"the largest {largest}" in message
        assert f"memory_bytes={memory}" in message


def test_memory_bytes_is_checked_alone() -> None:
    assert check_memory_bytes(None, 8, None) is None
    assert check_memory_bytes(4096, None, None) == 4096
    with pytest.raises(aperf.RingSizeError, match="one of pages, ring_bytes or memory_bytes"):
        check_memory_bytes(1 * MIB, 8, None)
    with pytest.raises(aperf.RingSizeError, match="one of pages"):
        check_memory_bytes(1 * MIB, None, 4096)
    for bad in (0, -1, True, 1.5, "1M"):
        with pytest.raises(aperf.RingSizeError, match="positive int"):
            check_memory_bytes(bad, None, None)  # type: ignore[arg-type]
