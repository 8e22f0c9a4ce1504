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
