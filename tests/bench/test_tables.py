"""The one table every benchmark prints: padded text for the terminal, Markdown for pages."""

from bench.lib.tables import table


def test_text_columns_are_as_wide_as_their_widest_cell_names_left_numbers_right():
    lines = table(["engine", "ms"], [["ours", "1.5"], ["llama.cpp", "22.25"]]).splitlines()
    assert lines == ["engine        ms", "ours         1.5", "llama.cpp  22.25"]


def test_least_widths_line_up_rows_printed_one_at_a_time_under_their_header():
    widths = (10, 8)
    header = table(["engine", "ms"], [], widths=widths)
    row = table(["engine", "ms"], [["ours", "1.5"]], widths=widths).splitlines()[1]
    assert header.index("ms") + len("ms") == len(row)


def test_markdown_cells_are_not_padded_and_keep_a_pipe_inside_their_cell():
    lines = table(["figure", "value"], [["a | b", "3 ms"]], markdown=True).splitlines()
    assert lines == ["| figure | value |", "|---|---:|", "| a \\| b | 3 ms |"]
    assert table(["figure", "value"], [], align="<<", markdown=True).splitlines()[1] == "|---|---|"
