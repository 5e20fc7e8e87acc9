"""The end-of-run summary (stderr): counts, seconds, throughput and where the time went."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from .progress import stderr_console


def print_summary(summary) -> None:
    """Print a RunSummary as a small table."""
    s = summary
    table = Table(title=f"dsv4enc: {escape(s.out)}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rate = (s.encoded + s.failed) / s.seconds if s.seconds else 0.0
    table.add_row("encoded", str(s.encoded))
    table.add_row("failed", str(s.failed))
    table.add_row("skipped (not images)", str(s.skipped))
    if s.reused:
        table.add_row("reused from earlier run", str(s.reused))
    table.add_row("seconds", f"{s.seconds:.1f}  ({rate:.1f} img/s, "
                  f"{s.tokens / s.seconds if s.seconds else 0:,.0f} tokens/s)")
    if s.encode_s:
        busy = min(1.0, s.model_s / s.encode_s)
        table.add_row("encoding loop", f"{s.encode_s:.1f}s  ({(s.encoded + s.failed) / s.encode_s:.1f} "
                      f"img/s; model busy {100 * busy:.0f}% of it)")
    table.add_row("time split", f"decode wait {s.decode_wait_s:.1f}s / H2D {s.h2d_s:.1f}s / "
                  f"model {s.model_s:.1f}s / write {s.write_s:.1f}s")
    table.add_row("padding waste", f"{100 * s.padding_waste:.1f}% of real tokens")
    if s.rank_loads and len(s.rank_loads) > 1:
        mean = sum(s.rank_loads) / len(s.rank_loads)
        loads = ", ".join(f"{load:,.0f}" for load in s.rank_loads)
        table.add_row("rank loads", f"{loads} (imbalance {max(s.rank_loads) / mean if mean else 1:.3f})")
    for kind, count in sorted(s.errors.items(), key=lambda kv: -kv[1])[:5]:
        table.add_row("error", f"{count} x {kind}")
    stderr_console.print(table)
