"""timeline.png: throughput and the job's real world size over time, the injected events marked.

`world_size_series(report)` is the world-size line the plot draws, as data: (t, world size)
points of a step function (each value holds until the next point), built from report.json's
own records. A generation sets the world it was launched with; every change the ranks made in
place (`membership_changes`, path in-place) sets its `to_world`; between a generation's end and
the next one's launch, and after the last one ended, nobody trains (0). So an in-place run
(2 -> 1 -> 2) and a relaunching one (a new generation per change) draw what their ranks formed.

`plot(report, path)` writes the PNG. Event labels sit in a band above the data, staggered over
a few rows so neighbours never overprint each other or the curves; a legend names each line
and each kind of event.
"""
from __future__ import annotations

import collections

EVENT_COLORS = {"reclaim": "tab:red", "gpu-fault": "tab:purple", "capacity": "tab:olive",
                "maintenance": "tab:orange", "rebalance": "tab:brown", "cancel": "tab:gray"}
LABEL_ROWS = 4  # label heights cycled through, so labels of close events stack instead of overprint


def world_size_series(report: dict) -> list[tuple[float, int]]:
    """See the module docstring."""
    points: list[tuple[float, int]] = []
    generations = sorted(report.get("generations", []), key=lambda g: g["launched"])
    changes = [c for c in report.get("membership_changes", []) if c.get("path") == "in-place"
               and c.get("to_world") is not None]
    for i, g in enumerate(generations):
        points.append((g["launched"], int(g["world_size"])))
        points += [(c["t"], int(c["to_world"])) for c in changes if c.get("generation") == g["index"]]
        nxt = generations[i + 1]["launched"] if i + 1 < len(generations) else None
        if g.get("ended") is not None and (nxt is None or nxt > g["ended"]):
            points.append((g["ended"], 0))
    points.sort(key=lambda p: p[0])
    series: list[tuple[float, int]] = []
    for t, world in points:  # a point that repeats the value drawn already adds nothing
        if not series or series[-1][1] != world:
            series.append((round(t, 3), world))
    return series


def plot(report: dict, path: str) -> None:
    """Writes the PNG (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax1 = plt.subplots(figsize=(11, 5), dpi=110)
    by_generation: dict[int, list[dict]] = collections.defaultdict(list)
    for p in report["throughput"]:
        by_generation[p.get("generation", 0)].append(p)
    for _, points in sorted(by_generation.items()):
        ax1.plot([p["t"] for p in points], [p["samples_per_s"] or 0 for p in points], color="tab:blue")
    ax1.set_xlabel("seconds since training started")
    ax1.set_ylabel("samples/s", color="tab:blue")
    top = max([p["samples_per_s"] or 0 for p in report["throughput"]] + [1.0])
    ax1.set_ylim(0, top * 1.6)  # the band above 1.15 x the peak holds the event labels
    ax2 = ax1.twinx()
    series = world_size_series(report)
    if series:
        xs = [t for t, _ in series] + [max(report["wall_s"], series[-1][0])]
        ys = [w for _, w in series] + [series[-1][1]]
        ax2.step(xs, ys, where="post", color="tab:green", linewidth=2)
    peak = max([w for _, w in series] + [1])
    ax2.set_ylim(0, peak * 1.6)
    ax2.set_yticks(range(0, peak + 1))
    ax2.set_ylabel("world size", color="tab:green")
    kinds: list[str] = []
    for i, e in enumerate(sorted(report["timeline"], key=lambda e: e["served"])):
        color = EVENT_COLORS.get(e["kind"], "black")
        ax1.axvline(e["served"], color=color, linestyle="--", alpha=0.8)
        y = top * (1.2 + 0.1 * (i % LABEL_ROWS))
        ax1.annotate(f"{e['kind']} {e['node']}", (e["served"], y), fontsize=7, ha="left", va="bottom",
                     xytext=(3, 0), textcoords="offset points",
                     bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": color, "alpha": 0.9})
        if e["kind"] not in kinds:
            kinds.append(e["kind"])
    handles = [Line2D([], [], color="tab:blue", label="throughput (samples/s, rank 0)"),
               Line2D([], [], color="tab:green", linewidth=2, label="world size (ranks in the group)")]
    handles += [Line2D([], [], color=EVENT_COLORS.get(k, "black"), linestyle="--", label=f"{k} served")
                for k in kinds]
    ax1.legend(handles=handles, loc="lower left", fontsize=7, framealpha=0.9)
    ax1.set_title(f"spotguard dry-run: {report['scenario'].get('name')} "
                  f"({'OK' if report['ok'] else 'FAILED'}, {report['steps_lost']} steps lost)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
