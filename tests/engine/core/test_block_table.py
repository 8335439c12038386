"""Block tables kept from step to step: rows follow each request's blocks, a step's table is its
requests' rows cut to the widest, and released rows come back clean."""

import numpy as np

from pagedbatch.engine.core.block_table import BlockTable


def test_a_steps_table_is_its_requests_rows_padded_with_zeros():
    table = BlockTable()
    table.append("a", [5, 6])
    table.append("b", [7])
    table.append("a", [9])
    assert table.gather(["b", "a"]).tolist() == [[7, 0, 0], [5, 6, 9]]
    assert table.gather(["b"]).tolist() == [[7]]
    assert table.gather(["a"]).dtype == np.int32


def test_a_released_row_is_cleared_and_handed_on():
    table = BlockTable(rows=1)
    table.append("a", [1, 2, 3])
    table.release("a")
    table.release("a")  # nothing left to release
    table.append("b", [4])
    assert table.gather(["b"]).tolist() == [[4]]
    table.append("c", [8])  # no row free: the table grows
    assert table.gather(["c", "b"]).tolist() == [[8], [4]]


def test_rows_grow_past_the_first_width_and_keep_their_blocks():
    table = BlockTable(rows=2, width=2)
    for i in range(5):
        table.append("long", [i])
        table.append("short", [100 + i] if i == 0 else [])
    assert table.gather(["long", "short"]).tolist() == [[0, 1, 2, 3, 4], [100, 0, 0, 0, 0]]
