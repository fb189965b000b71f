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


_CHECKSUMS = {
    1: "of the body alone (an older ingest: re-ingest to have them name each sample)",
    2: "seeded with each sample's id",
}


def _rows(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [title, *(f"  {k:<{width}}  {v}" for k, v in rows)]


def _map_load(load: dict[str, Any], owned: bool) -> str:
    """How far the DRAM tier's load of the whole store got, as one table cell.

    ``owned``: loaded as a copy of the daemon's own, which may not lock pages.
    """
    done = f"{human_bytes(load['loaded_bytes'])} of {human_bytes(load['total_bytes'])}"
    how = ", copied (pages may not be locked)" if owned else ""
    if load.get("error"):
        return f"{done}{how} (stopped: {load['error']}; the rest as records are read)"
    return f"{done}{how} in {load['seconds']:.1f} s"


def _memory_rows(memory: dict[str, Any] | None) -> list[str]:
    """What the daemon could fill at start, and what it lowered to fit (``memory_split``)."""
    if not memory:
        return []
    where = f"its memory cgroup {memory['cgroup']}" if memory.get("cgroup") else "the machine"
    rows = [("at start", f"{human_bytes(memory['room_bytes'])} available ({where})")]
    for name, key, option in (("DRAM", "dram", "--dram-bytes"), ("rings", "rings", "--shm-bytes")):
        given, asked = memory[f"{key}_bytes"], memory[f"{key}_asked_bytes"]
        if given < asked:
            rows.append(
                (name, f"{human_bytes(given)}, lowered to fit ({option} {human_bytes(asked)})")
            )
    return _rows("memory", rows)


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
            *(
                [("checksums", _CHECKSUMS.get(ds["record_version"], str(ds["record_version"])))]
                if "record_version" in ds
                else []
            ),
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
        if "map_load" in tier:  # the whole store brought in at start (``map_loader.py``)
            rows.append(("store in RAM", _map_load(tier["map_load"], tier.get("map_owned", False))))
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
            ("damaged reads", f"{backing.get('corrupt', 0):,}"),
        ],
    )
    out += _memory_rows(stats.get("memory"))
    out += _read_path_rows(stats.get("readahead"), stats.get("miss_workers"))
    out += _loop_rows(stats.get("loop"))
    shm = stats.get("shm")
    if shm and (shm.get("rings") or shm.get("socket_jobs")):
        fallbacks = (
            f"socket fallbacks {shm['socket_fallbacks']:,}: ring full {shm.get('ring_full', 0):,},"
            f" too big {shm.get('too_big', 0):,}"
        )
        out += _rows(
            "shared memory",
            [
                *(
                    (f"ring {r['name']}", f"{r['slots']} slots of {human_bytes(r['slot_bytes'])}")
                    for r in shm.get("rings", [])
                ),
                ("lent", f"{shm['lent']} slots to {shm['consumers']} consumers"),
                ("delivered", f"{shm['delivered']:,} ({fallbacks})"),
                *((f"socket: {job}", why) for job, why in shm.get("socket_jobs", {}).items()),
            ],
        )
    disk = stats.get("state_disk")
    if disk:
        since = "" if disk.get("since") is None else f" since {_clock(disk['since'])}"
        status = "ok" if disk["ok"] else f"WRITES FAIL{since}: {disk['error']}"
        out += _rows(
            "state disk",
            [
                ("status", status),
                (
                    "free",
                    f"{human_bytes(disk['free_bytes'] or 0)} ({disk['failures']:,} failed writes)",
                ),
            ],
        )
    newest = (stats.get("snapshots") or {}).get("newest")
    if newest:
        durability = stats["snapshots"].get("durability", "?")
        out += _rows(
            "newest snapshot",
            [
                ("job / step", f"{newest['job']} / {newest['step']}"),
                ("size", f"{human_bytes(newest['bytes'])} ({durability})"),
            ],
        )
    tune = stats.get("autotune")
    if tune:
        cost = tune["last_cost"]
        knobs = ", ".join(f"{k} {v['value']:,}" for k, v in tune["knobs"].items())
        out += _rows(
            f"autotune ({tune['mode']})",
            [
                ("knobs", knobs),
                ("rounds", f"{tune['rounds']:,} (idle {tune['idle_rounds']:,})"),
                ("last cost", "-" if cost is None else f"{cost:.4f} ({tune['last_action']})"),
            ],
        )
    out += _cluster_rows(stats.get("cluster"))
    for name, job in stats["jobs"].items():
        rows = [
            ("epoch", f"{job['epoch']}  (world size {job['world_size']})"),
            ("served", f"{job['batches_served']:,} batches, {job['samples_served']:,} samples"),
            ("feedback", f"{job['feedback_samples']:,} losses"),
        ]
        out += _rows(f"job {name}", rows + _importance_rows(job.get("importance") or {}))
    out.append(f"uptime {stats['uptime_s']:.1f} s, daemon pid {stats['daemon']['pid']}")
    return "\n".join(out)


def _read_path_rows(ra: dict[str, Any] | None, workers: dict[str, Any] | None) -> list[str]:
    """How misses are read: the read-ahead's window and unit, and the miss workers."""
    out: list[str] = []
    if ra and ra.get("budget_bytes"):
        unit = ra.get("read_unit_bytes") or 0
        how = f"{human_bytes(unit)} blocks" if unit else "each record's pages"
        if ra.get("advice_skipped"):
            how += f"; {ra['advice_skipped']:,} batches found in the page cache"
        out += _rows(
            "read-ahead",
            [
                (
                    "window",
                    f"{human_bytes(ra['window_bytes'])} of {human_bytes(ra['budget_bytes'])} "
                    f"(peak {human_bytes(ra['peak_window_bytes'])})",
                ),
                (
                    "advised",
                    f"{ra['advised_records']:,} records in {ra['advise_calls']:,} calls ({how})",
                ),
            ],
        )
    if workers and workers.get("procs"):
        out += _rows(
            "miss workers",
            [
                ("running", f"{workers['running']} of {workers['procs']} ({workers['lost']} lost)"),
                (
                    "batches",
                    f"{workers['batches']:,} (assembled by the daemon instead: "
                    f"{workers['fallbacks']:,})",
                ),
                (
                    "read how",
                    f"{workers.get('read', 0) - workers.get('copied', 0):,} batches from the "
                    f"file into their slot, {workers.get('copied', 0):,} copied from a map of "
                    f"it, {workers.get('sliced', 0) - workers.get('read', 0):,} sliced from "
                    "LMDB's map",
                ),
                ("from the arena", f"{workers.get('from_arena', 0):,} batches"),
            ],
        )
    return out


def _loop_rows(loop: dict[str, Any] | None) -> list[str]:
    """How busy the server loop was lately, and on what (``loaderd.loop_clock``)."""
    if not loop or loop.get("busy_share") is None:
        return []
    busy = loop["busy_share"]
    note = "  (one interpreter: near 100% it bounds misses, not the disk)" if busy >= 0.9 else ""
    shares = ", ".join(f"{p.replace('_', ' ')} {v:.0%}" for p, v in loop["shares"].items())
    rows = [("busy", f"{busy:.0%} of the last {loop['window_s']:.0f} s{note}"), ("on", shares)]
    on_core = loop.get("on_core_share")
    if on_core is not None:
        # Busy but off a core: waiting for the GIL its own threads hold, or for a core.
        waits = busy >= 0.5 and on_core < 0.8 * busy
        why = "  (it waited for the GIL or a core the rest of its busy time)" if waits else ""
        rows.insert(1, ("on a core", f"{on_core:.0%}{why}"))
    return _rows("server loop", rows)


def _importance_rows(imp: dict[str, Any]) -> list[tuple[str, str]]:
    """The importance engine's state in four lines (the JSON has every figure)."""
    if not imp:
        return []
    rows = [("sampler", f"{imp.get('sampler', '?')} ({imp.get('phase', '?')} phase)")]
    if imp.get("groups_epoch", -1) >= 0:
        rows.append(
            (
                "fluctuation",
                f"{imp['high_group']:,} high (mean variance {_short(imp['high_mean_variance'])}), "
                f"{imp['low_group']:,} low ({_short(imp['low_mean_variance'])})",
            )
        )
    if imp.get("kept_fraction") is not None:
        rows.append(
            (
                "selected",
                f"{imp['selected']:,} ({imp['kept_fraction']:.0%}) "
                f"for epoch {imp['selected_epoch']}, {imp['rescored']:,} re-scored",
            )
        )
    if imp.get("loss_p50") is not None:
        rows.append(
            (
                "loss p10/p50/p90",
                " / ".join(_short(imp[k]) for k in ("loss_p10", "loss_p50", "loss_p90")),
            )
        )
    return rows


def _clock(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _short(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_short(x)}" for k, x in v.items())
    return str(v)


def _cluster_rows(cluster: dict[str, Any] | None) -> list[str]:
    """A cluster daemon's section: the group, then each job on every node (the last round)."""
    if not cluster:
        return []
    generation = cluster.get("generation")
    head = (
        f"cluster (node {cluster['node_rank']} of {cluster['nodes']}, {cluster['state']}"
        f"{'' if generation is None else f', generation {generation}'}, "
        f"round {cluster['round']})"
    )
    rows = [("joined", ", ".join(cluster.get("joined") or []) or "-")]
    if cluster.get("error"):
        rows.append(("error", cluster["error"]))
    rows.append(("pending", f"{cluster['pending_entries']:,} losses to send"))
    for name, job in (cluster.get("jobs") or {}).items():
        p = job.get("progress")
        if not p:
            rows.append((f"job {name}", f"agreed {job.get('agreed') or '-'}"))
            continue
        rows.append(
            (
                f"job {name}",
                f"epoch {p['epoch']} (slowest rank), agreed {job.get('agreed') or '-'}, "
                f"{p['ranks_reporting']} of {p['world_size']} ranks in round {p['round']}",
            )
        )
        for node, n in p["nodes"].items():
            ranks = ",".join(str(r) for r in n["ranks"])
            rows.append(
                (
                    f"  node {node}",
                    f"ranks {ranks} at {n['at']}, {n['complete']} done, {n['waiting']} waiting",
                )
            )
    return _rows(head, rows)


def format_jobs(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """``loaderd jobs``: one line per job (name, epoch, progress, sampler, last activity)."""
    import time

    if not rows:
        return "no jobs"
    now = time.time() if now is None else now
    head = ("job", "epoch", "progress", "sampler", "ranks", "batch", "last active")
    lines = [head]
    for r in rows:
        done = f"{r['acked']}/{r['batches']} batches" if r["batches"] else "-"
        lines.append(
            (
                str(r["name"]),
                str(r["epoch"]),
                done,
                str(r["sampler"]),
                str(r["world_size"]),
                str(r["batch_size"]),
                _ago(now - float(r["last_active"])),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"
