"""The daemon's statistics: one JSON-ready object, and the table ``loaderd stats`` prints."""

from __future__ import annotations

from typing import Any


def build_stats(
    *,
    dataset: dict[str, Any],
    tiers: dict[str, Any],
    jobs: dict[str, dict[str, Any]],
    daemon: dict[str, Any],
    uptime_s: float,
) -> dict[str, Any]:
    """Assemble the STATS reply: ``dataset``, ``cache``, ``tiers``, ``backing``, ``jobs``..."""
    return {
        "dataset": dataset,
        "cache": tiers["cache"],
        "tiers": tiers["tiers"],
        "backing": tiers["backing"],
        **{k: v for k, v in tiers.items() if k not in ("cache", "tiers", "backing")},
        "jobs": jobs,
        "daemon": daemon,
        "uptime_s": round(uptime_s, 3),
    }


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _rows(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [title, *(f"  {k:<{width}}  {v}" for k, v in rows)]


def format_table(stats: dict[str, Any]) -> str:
    """A readable multi-section table of a STATS reply."""
    ds, cache, backing = stats["dataset"], stats["cache"], stats["backing"]
    fields = ", ".join(
        f"{f['name']}:{f['dtype']}{tuple(f['shape']) if f['shape'] else ''}" for f in ds["fields"]
    )
    out = _rows(
        "dataset",
        [
            ("path", ds.get("path", "?")),
            ("samples", f"{ds['samples']:,}"),
            ("bytes", human_bytes(ds["bytes"])),
            ("fields", fields),
        ],
    )
    for tier in stats.get("tiers", []):
        rows = [
            ("capacity", human_bytes(tier["capacity_bytes"])),
            ("used", f"{human_bytes(tier['used_bytes'])} in {tier['items']:,} items"),
            (
                "hits / misses",
                f"{tier['hits']:,} / {tier['misses']:,}  (hit rate {tier['hit_rate']:.1%})",
            ),
            ("evictions", f"{tier['evictions']:,}"),
        ]
        rows += [
            (k, str(tier[k]))
            for k in (
                "durability",
                "path",
                "recovered_items",
                "promotions",
                "demotions",
                "corrupt_dropped",
            )
            if k in tier
        ]
        out += _rows(f"tier {tier['name']}", rows)
    out += _rows(
        "cache (all tiers)",
        [
            (
                "hit rate",
                f"{cache['hit_rate']:.1%} ({cache['hits']:,} hits, {cache['misses']:,} misses)",
            ),
        ],
    )
    out += _rows(
        "backing store",
        [
            ("reads", f"{backing['reads']:,}"),
            ("bytes read", human_bytes(backing["bytes_read"])),
        ],
    )
    for name, job in stats["jobs"].items():
        rows = [
            ("epoch", str(job["epoch"])),
            ("world size", str(job["world_size"])),
            ("batches served", f"{job['batches_served']:,}"),
            ("samples served", f"{job['samples_served']:,}"),
            ("feedback samples", f"{job['feedback_samples']:,}"),
        ]
        imp = job.get("importance") or {}
        rows += [(f"importance {k}", _short(v)) for k, v in imp.items()]
        out += _rows(f"job {name}", rows)
    out.append(f"uptime {stats['uptime_s']:.1f} s, daemon pid {stats['daemon']['pid']}")
    return "\n".join(out)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_short(x)}" for k, x in v.items())
    return str(v)
