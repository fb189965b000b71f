"""loaderd/stats.py: the STATS object and the table ``loaderd stats`` prints."""

from __future__ import annotations

from typing import Any

import pytest

from loaderd.stats import build_stats, format_table, human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (10 * 1024**2, "10.0 MiB"),
        (2 * 1024**3, "2.0 GiB"),
        (3 * 1024**4, "3.0 TiB"),
        (1024**5, "1024.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_human_bytes(n: float, text: str) -> None:
    assert human_bytes(n) == text


def realistic_stats() -> dict[str, Any]:
    dram = {
        "name": "dram",
        "capacity_bytes": 2 << 30,
        "used_bytes": 1536 << 20,
        "items": 123_456,
        "hits": 987_654,
        "misses": 12_346,
        "evictions": 4_321,
        "hit_rate": 987_654 / 1_000_000,
    }
    return build_stats(
        dataset={
            "path": "/data/imagenet.ldb",
            "samples": 1_281_167,
            "bytes": 150 * 1024**3,
            "fields": [
                {"name": "image", "dtype": "uint8", "shape": [224, 224, 3]},
                {"name": "label", "dtype": "int64", "shape": []},
                {"name": "caption", "dtype": "string", "shape": []},
            ],
            "record_version": 2,
        },
        tiers={
            "cache": {k: v for k, v in dram.items() if k != "name"},
            "tiers": [dram],
            "backing": {"reads": 12_346, "bytes_read": 3 * 1024**3},
            "nvram": {"note": "extra key is kept"},
            "readahead": {
                "budget_bytes": 256 << 20,
                "window_bytes": 100 << 20,
                "peak_window_bytes": 250 << 20,
                "advised_records": 98_400,
                "advise_calls": 3_108,
                "read_unit_bytes": 128 << 10,
            },
            "miss_workers": {
                "procs": 2,
                "running": 2,
                "lost": 0,
                "batches": 1_537,
                "fallbacks": 3,
                "sliced": 1_500,
                "read": 1_400,
                "copied": 400,
                "from_arena": 1_204,
            },
        },
        jobs={
            "resnet": {
                "epoch": 7,
                "world_size": 8,
                "batches_served": 40_000,
                "samples_served": 10_240_000,
                "feedback_samples": 9_999_999,
                "importance": {
                    "sampler": "importance",
                    "phase": "select",
                    "groups_epoch": 6,
                    "high_group": 120_000,
                    "low_group": 1_161_167,
                    "high_mean_variance": 1.5,
                    "low_mean_variance": 0.0123456,
                    "selected_epoch": 7,
                    "selected": 896_817,
                    "kept_fraction": 0.700012345,
                    "rescored": 120_000,
                    "loss_p10": 0.01,
                    "loss_p50": 0.25,
                    "loss_p90": 1.75,
                },
            }
        },
        daemon={"pid": 4242, "version": "0.1.0"},
        uptime_s=3723.45678,
    )


def test_build_stats_layout() -> None:
    s = realistic_stats()
    assert s["uptime_s"] == 3723.457
    assert s["cache"]["hits"] == 987_654 and s["tiers"][0]["name"] == "dram"
    assert s["backing"]["reads"] == 12_346
    assert s["nvram"] == {"note": "extra key is kept"}
    assert set(s) >= {"dataset", "cache", "tiers", "backing", "jobs", "daemon", "uptime_s"}


def test_format_table_contains_the_key_figures() -> None:
    table = format_table(realistic_stats())
    lines = table.splitlines()
    for expected in [
        "/data/imagenet.ldb",
        "1,281,167",  # samples
        "150.0 GiB",  # dataset bytes
        "image:uint8(224, 224, 3), label:int64, caption:string",
        "seeded with each sample's id",
        "tier dram",
        "2.0 GiB",  # capacity
        "1.5 GiB in 123,456 items",
        "987,654 / 12,346  (hit rate 98.8%)",
        "4,321",  # evictions
        "98.8% (987,654 hits, 12,346 misses)",
        "3.0 GiB",  # backing bytes read
        "job resnet",
        "40,000",
        "10,240,000",
        "9,999,999",
        "importance (select phase)",
        "120,000 high (mean variance 1.5), 1,161,167 low (0.01235)",
        "896,817 (70%) for epoch 7, 120,000 re-scored",
        "0.01 / 0.25 / 1.75",
        "uptime 3723.5 s, daemon pid 4242",
        "100.0 MiB of 256.0 MiB (peak 250.0 MiB)",
        "98,400 records in 3,108 calls (128.0 KiB blocks)",
        "2 of 2 (0 lost)",
        "1,537 (assembled by the daemon instead: 3)",
        "1,204 batches",  # of them, with arena records the workers copied
        "1,000 batches from the file into their slot, 400 copied from a map of it, 100 sliced",
    ]:
        assert expected in table, f"{expected!r} missing from:\n{table}"
    assert lines[0] == "dataset"
    assert "cache (all tiers)" in lines and "backing store" in lines
    assert "read-ahead" in lines and "miss workers" in lines


def test_format_table_says_when_the_stores_checksums_do_not_name_their_samples() -> None:
    stats = realistic_stats()
    stats["dataset"]["record_version"] = 1
    assert "of the body alone (an older ingest: re-ingest" in format_table(stats)
    del stats["dataset"]["record_version"]  # a daemon of an earlier version
    assert "checksums" not in format_table(stats)


def test_format_table_says_how_misses_are_read_only_where_it_applies() -> None:
    s = realistic_stats()
    s["readahead"]["read_unit_bytes"] = 0
    assert "98,400 records in 3,108 calls (each record's pages)" in format_table(s)
    s["readahead"]["advice_skipped"] = 1_200
    assert "(each record's pages; 1,200 batches found in the page cache)" in format_table(s)
    s["readahead"]["budget_bytes"] = 0  # read-ahead off
    s["miss_workers"]["procs"] = 0  # none allowed
    lines = format_table(s).splitlines()
    assert "read-ahead" not in lines and "miss workers" not in lines
    del s["readahead"], s["miss_workers"]  # an older daemon's reply
    assert "backing store" in format_table(s).splitlines()


def test_format_table_aligns_values_within_a_section() -> None:
    lines = format_table(realistic_stats()).splitlines()
    start = lines.index("tier dram")
    section = lines[start + 1 : start + 5]
    columns = {
        line.index(value)
        for line, value in zip(section, ["2.0 GiB", "1.5 GiB", "987,654", "4,321"], strict=True)
    }
    assert len(columns) == 1


def test_format_table_with_extra_tier_keys_and_no_jobs() -> None:
    s = realistic_stats()
    s["jobs"] = {}
    s["tiers"].append(
        {
            "name": "nvram",
            "capacity_bytes": 0,
            "used_bytes": 0,
            "items": 0,
            "hits": 0,
            "misses": 0,
            "evictions": 0,
            "hit_rate": 0.0,
            "durability": "adr",
            "recovered_items": 17,
        }
    )
    table = format_table(s)
    assert "tier nvram" in table and "durability" in table and "adr" in table
    assert "recovered_items  17" in table
    assert "job " not in table


def test_format_table_shows_the_cluster_view() -> None:
    s = realistic_stats()
    progress = {
        "round": 25,
        "ranks_reporting": 4,
        "world_size": 4,
        "epoch": 3,
        "nodes": {
            "0": {"ranks": [0, 1], "at": "3:train", "complete": 2, "waiting": 0},
            "1": {"ranks": [2, 3], "at": "3:rescore", "complete": 1, "waiting": 1},
        },
    }
    s["cluster"] = {
        "node_rank": 1,
        "nodes": 2,
        "state": "formed",
        "generation": 4,
        "round": 25,
        "joined": ["node 0 (a)", "node 1 (b)"],
        "error": None,
        "pending_entries": 0,
        "jobs": {"resnet": {"agreed": "3:train", "progress": progress}},
    }
    lines = format_table(s).splitlines()
    start = lines.index("cluster (node 1 of 2, formed, generation 4, round 25)")
    assert lines[start + 1].split() == ["joined", "node", "0", "(a),", "node", "1", "(b)"]
    assert "epoch 3 (slowest rank), agreed 3:train, 4 of 4 ranks in round 25" in lines[start + 3]
    assert " ".join(lines[start + 5].split()) == "node 1 ranks 2,3 at 3:rescore, 1 done, 1 waiting"


def test_format_table_says_how_busy_the_server_loop_was() -> None:
    s = realistic_stats()
    s["loop"] = {
        "turns": 9_000,
        "busy_s": 40.0,
        "waited_s": 2.0,
        "window_s": 10.2,
        "busy_share": 0.97,
        "shares": {"requests": 0.31, "assembled": 0.44, "other": 0.25},
    }
    lines = format_table(s).splitlines()
    at = lines.index("server loop")
    assert "97% of the last 10 s" in lines[at + 1] and "bounds misses" in lines[at + 1]
    assert lines[at + 2].split(None, 1)[1] == "requests 31%, assembled 44%, other 25%"
    assert not any("on a core" in line for line in lines)  # a daemon that does not say
    s["loop"]["on_core_share"] = 0.6  # busy 97 %, on a core 60 %: it waited
    lines = format_table(s).splitlines()
    assert lines[at + 2].split()[:4] == ["on", "a", "core", "60%"]
    assert "waited for the GIL or a core" in lines[at + 2]
    s["loop"]["on_core_share"] = 0.9  # busy and running: no remark
    assert "waited for the GIL" not in format_table(s)
    s["loop"]["busy_share"] = 0.4  # far from saturated: no remark
    assert "bounds misses" not in format_table(s)
    s["loop"]["busy_share"] = None  # a daemon that has not served a turn
    assert "server loop" not in format_table(s).splitlines()


def test_format_table_says_how_much_of_the_store_dram_brought_in_at_start() -> None:
    s = realistic_stats()
    assert "store in RAM" not in format_table(s)  # DRAM does not hold the whole store
    load = {"loaded_bytes": 2 << 30, "total_bytes": 2 << 30, "seconds": 0.61, "error": None}
    s["tiers"][0]["map_load"] = load
    row = next(r for r in format_table(s).splitlines() if "store in RAM" in r)
    assert " ".join(row.split()) == "store in RAM 2.0 GiB of 2.0 GiB in 0.6 s"
    s["tiers"][0]["map_load"] = {**load, "loaded_bytes": 512 << 20, "error": "Out of memory"}
    assert "512.0 MiB of 2.0 GiB (stopped: Out of memory; the rest as records are read)" in (
        format_table(s)
    )
    s["tiers"][0].update(map_owned=True, map_load=load)  # a daemon that may not lock
    row = next(r for r in format_table(s).splitlines() if "store in RAM" in r)
    assert " ".join(row.split()) == (
        "store in RAM 2.0 GiB of 2.0 GiB, copied (pages may not be locked) in 0.6 s"
    )


def test_format_table_says_what_memory_the_daemon_had_and_what_it_lowered() -> None:
    s = realistic_stats()
    assert "lowered" not in format_table(s)
    gib = 1 << 30
    s["memory"] = {
        "room_bytes": 20 * gib,
        "cgroup": None,
        "dram_bytes": 2 * gib,
        "dram_asked_bytes": 2 * gib,
        "rings_bytes": gib,
        "rings_asked_bytes": gib,
    }
    table = format_table(s)
    assert "20.0 GiB available (the machine)" in table and "lowered" not in table
    s["memory"].update(room_bytes=gib, cgroup="/sys/fs/cgroup/job", dram_bytes=600 << 20)
    s["memory"].update(rings_bytes=256 << 20, dram_asked_bytes=3 * gib)
    rows = [" ".join(r.split()) for r in format_table(s).splitlines()]
    assert "at start 1.0 GiB available (its memory cgroup /sys/fs/cgroup/job)" in rows
    assert "DRAM 600.0 MiB, lowered to fit (--dram-bytes 3.0 GiB)" in rows
    assert "rings 256.0 MiB, lowered to fit (--shm-bytes 1.0 GiB)" in rows
