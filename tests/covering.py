"""Covering designs for test matrices: every pair of factor values in far fewer cases than the
full product, for sweeps whose properties are per factor or per pair of factors."""


def latin(rows: tuple, columns: tuple, choices: tuple) -> list[tuple]:
    """(row, column, choice) for every row x column, the choice rotating by row + column.

    Every row and every column meets every choice when there are at least as many rows and as
    many columns as choices (a Latin square when all three counts agree): all pairs of the three
    factors in len(rows) x len(columns) cases instead of the product's x len(choices).
    """
    return [(r, c, choices[(i + j) % len(choices)]) for i, r in enumerate(rows)
            for j, c in enumerate(columns)]


def staggered(rows: tuple, columns: tuple, per_row: int, choices: tuple) -> list[tuple]:
    """(row, column, choice) with row i meeting `per_row` consecutive columns from column i
    (cyclically), the choice rotating by i + j: every row meets every choice when per_row >=
    len(choices), and every column is met when len(rows) + per_row - 1 >= len(columns). For
    sweeps whose property is per row and per column but not per pair: len(rows) x per_row cases
    instead of latin's len(rows) x len(columns).
    """
    if len(rows) + per_row - 1 < len(columns) or per_row > len(columns):
        raise ValueError(f"{len(rows)} rows of {per_row} cannot meet all {len(columns)} columns")
    return [(r, columns[(i + j) % len(columns)], choices[(i + j) % len(choices)])
            for i, r in enumerate(rows) for j in range(per_row)]
