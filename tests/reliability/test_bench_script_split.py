"""scripts/bench_fleet.script_split: what `--by-script` (bench_fleet, bench_job_records) reports
as a Lua script's own commands and the rest. It rests on how Redis logs a script's commands in
SLOWLOG (just before the script, under the client address '?:0'), checked here on a real
redis-server as well as on fixed entries."""

from __future__ import annotations

from typing import Any

from redis import Redis

from scripts.bench_fleet import _start_redis, script_split

CALLER = b"127.0.0.1:50000"
SCRIPT = b"?:0"
SHA = "a" * 40


def _entry(entry_id: int, command: str, client: bytes, duration: int) -> dict[str, Any]:
    return {"id": entry_id, "start_time": 0, "duration": duration, "command": command.encode(),
            "client_address": client, "client_name": b""}


def test_script_commands_go_to_the_script_that_ran_them() -> None:
    entries = [
        _entry(1, "SET a 1", SCRIPT, 3),
        _entry(2, "GET a", SCRIPT, 2),
        _entry(3, f"EVALSHA {SHA} 0", CALLER, 10),
        _entry(4, "SET b 1", CALLER, 4),  # a client's own command between two scripts
        _entry(5, f"EVALSHA {SHA} 0", CALLER, 7),  # a run that called nothing
        _entry(6, "HGET h f", SCRIPT, 1),
        _entry(7, "EVAL return 1 0", CALLER, 5),
        _entry(8, "EVALSHA " + "b" * 40 + " 0", CALLER, 2),  # a script not among the names
    ]
    # SLOWLOG GET answers newest first.
    split = script_split(list(reversed(entries)), {SHA: "probe"})
    assert split == {
        "evalsha:probe": (2, 17, 5),
        "set": (2, 7, 0),
        "get": (1, 2, 0),
        "hget": (1, 1, 0),
        "eval": (1, 5, 1),
        "evalsha:bbbbbbbb": (1, 2, 0),
    }


def test_redis_logs_a_scripts_commands_before_it_under_the_script_client() -> None:
    server, url = _start_redis()
    try:
        redis = Redis.from_url(url)
        sha = redis.script_load("redis.call('SET', KEYS[1], '1') return redis.call('GET', KEYS[1])")
        redis.config_set("slowlog-log-slower-than", 0)
        redis.slowlog_reset()
        redis.evalsha(sha, 1, "k")
        redis.set("own", "1")
        redis.evalsha(sha, 1, "k")
        entries = redis.slowlog_get(100)
        split = script_split(entries, {sha: "probe"})
        nested = sum(int(e["duration"]) for e in entries if e["client_address"] == SCRIPT)
        assert split["evalsha:probe"][0] == 2
        assert split["evalsha:probe"][2] == nested  # both runs' SET and GET, not the client's SET
        assert split["set"][0] == 3 and split["get"][0] == 2
        assert [e["command"].split(b" ")[0] for e in sorted(entries, key=lambda e: e["id"])
                if e["command"].split(b" ")[0] in (b"SET", b"GET", b"EVALSHA")] == [
            b"SET", b"GET", b"EVALSHA", b"SET", b"SET", b"GET", b"EVALSHA"]
    finally:
        server.terminate()
        server.wait(timeout=10)
