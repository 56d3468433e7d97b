"""The demo's report: its lines of prose and tables within WIDTH characters, and the load
sweep's table and plot."""

from __future__ import annotations

import textwrap

WIDTH = 120  # the longest line the demo prints (but an error's one line, and --json)
SWEEP_RUNS = ("offload", "drop", "never_evict")  # the runs served at each rate of a sweep



def wrap(text: str, indent: str = "  ") -> list[str]:
    """A line of prose as lines of at most WIDTH characters, the later ones indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [""]


def title_lines(title: str) -> list[str]:
    """A title of parts apart by "; " (what is served; the model, the device): on one line
    where it fits, else what is served first and the rest below it, indented."""
    if len(title) <= WIDTH or "; " not in title:
        return wrap(title)
    served, _, rest = title.partition("; ")
    return [*wrap(served), *wrap("  " + rest, "    ")]


def column_groups(first: int, widths: list[int], gap: int = 3) -> list[list[int]]:
    """The columns (their indices) in groups, each printed beside the first column (`first`
    wide) within WIDTH: as many in each group as fit, in order, at least one."""
    groups: list[list[int]] = []
    used = WIDTH + 1
    for i, w in enumerate(widths):
        if used + gap + w > WIDTH:
            groups.append([])
            used = first
        groups[-1].append(i)
        used += gap + w
    return groups


def grid(header: list[str], rows: list[list[str]], gap: int = 3) -> list[str]:
    """Rows of cells in columns as wide as their widest cell (header included), at least
    `gap` spaces apart: the first column left-aligned, the others right-aligned. Columns that
    do not fit WIDTH go to another block below, after a blank line, beside the first column
    again."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines: list[str] = []
    for group in column_groups(widths[0], widths[1:], gap):
        if lines:
            lines.append("")
        for cells in [header, *rows]:
            lines.append(f"{cells[0]:<{widths[0]}}" + "".join(
                f"{' ' * gap}{cells[1 + i]:>{widths[1 + i]}}" for i in group))
    return lines


def sweep_table(title: str, points: list[dict]) -> str:
    """The load sweep: per rate, each run's TTFT p50 / p90 and output tokens/s; then per rate
    the closing line."""
    def ms(x: float) -> str:
        return f"{1e3 * x:,.1f}"

    header = ["arrival rate (/s)"]
    for name in SWEEP_RUNS:
        header += [f"{name} TTFT p50 / p90 (ms)", f"{name} tokens/s"]
    rows = []
    for p in points:
        row = [f"{p['arrival_rate']:g}"]
        for name in SWEEP_RUNS:
            r = p["runs"][name]
            row += [f"{ms(r['ttft_s']['p50'])} / {ms(r['ttft_s']['p90'])}",
                    f"{r['output_tokens_per_s']:,.1f}"]
        rows.append(row)
    lines = [*title_lines(title), "", *grid(header, rows), ""]
    lines += [line for p in points for text in p["closing"]["lines"]
              for line in wrap(f"at {p['arrival_rate']:g}/s: {text}")]
    return "\n".join(lines)


def plot_sweep(path: str, points: list[dict]) -> None:
    """TTFT p50 (solid) and p90 (dashed) against the arrival rate, and output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p["arrival_rate"] for p in points]
    fig, (ttft, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(SWEEP_RUNS):
        for q, style in (("p50", "-"), ("p90", "--")):
            ttft.plot(rates, [1e3 * p["runs"][name]["ttft_s"][q] for p in points], style,
                      color=f"C{i}", marker="o", label=f"{name} {q}")
        rate.plot(rates, [p["runs"][name]["output_tokens_per_s"] for p in points],
                  color=f"C{i}", marker="o", label=name)
    ttft.set(xlabel="arrival rate (/s)", ylabel="TTFT (ms)", title="time to first token vs load",
             yscale="log")
    rate.set(xlabel="arrival rate (/s)", ylabel="output tokens/s", title="throughput vs load")
    ttft.legend(fontsize=8)
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
