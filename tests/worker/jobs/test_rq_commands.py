"""rq's worker commands as RQCommands reads them: rq.command's own payloads, and anything else
on the channel ignored without stopping the worker."""

from __future__ import annotations

from rq.command import send_command, send_kill_horse_command, send_shutdown_command

from tests.worker.jobs.job_support import fake_redis
from worker.jobs.rq_commands import RQCommand, RQCommands


def test_commands_sent_with_rqs_functions_arrive_in_order_and_garbage_is_skipped() -> None:
    redis = fake_redis()
    commands = RQCommands(redis, "w1")
    assert commands.received() == []  # not subscribed yet: nothing, and no error
    commands.subscribe()
    send_command(redis, "w1", "stop-job", job_id="job-7")
    redis.publish(commands.channel, b"not json")
    redis.publish(commands.channel, b'{"no": "command"}')
    send_kill_horse_command(redis, "w1")
    send_shutdown_command(redis, "w2")  # another worker's channel
    send_shutdown_command(redis, "w1")
    assert commands.received() == [RQCommand("stop-job", "job-7"), RQCommand("kill-horse"),
                                   RQCommand("shutdown")]
    assert commands.received() == []
    commands.close()
