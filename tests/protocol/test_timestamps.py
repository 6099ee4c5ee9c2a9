from protocol.timestamps import rfc3339_utc


def test_epoch_seconds_as_rfc3339_utc() -> None:
    assert rfc3339_utc(1) == "1970-01-01T00:00:01Z"
    assert rfc3339_utc(1796558100.25) == "2026-12-06T11:55:00.250000Z"
