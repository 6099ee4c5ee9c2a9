"""Standard Webhooks signatures, against the spec's own test vector."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from webhooks.signing import WebhookSigner, secret_key

# The reference libraries' sign test (standard-webhooks/standard-webhooks,
# libraries/python/tests/test_webhooks.py, test_sign_function).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_PAYLOAD = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_signature_matches_the_spec_test_vector() -> None:
    assert WebhookSigner(SPEC_SECRET).signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD) == SPEC_SIGNATURE


def test_the_prefix_is_optional_and_the_key_is_the_base64_part() -> None:
    bare = SPEC_SECRET.removeprefix("whsec_")
    assert WebhookSigner(bare).signature(SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD) == SPEC_SIGNATURE
    assert secret_key(SPEC_SECRET) == base64.b64decode(bare)


def test_signature_is_hmac_sha256_of_id_timestamp_body() -> None:
    key = bytes(range(32))
    secret = "whsec_" + base64.b64encode(key).decode()
    expected = base64.b64encode(hmac.new(key, b"msg_1.1700000000.{}", hashlib.sha256).digest())
    assert WebhookSigner(secret).signature("msg_1", 1700000000, b"{}") == "v1," + expected.decode()


def test_headers_carry_id_timestamp_and_signature() -> None:
    headers = WebhookSigner(SPEC_SECRET).headers(SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD)
    assert headers == {"webhook-id": SPEC_ID, "webhook-timestamp": "1614265330",
                       "webhook-signature": SPEC_SIGNATURE, "content-type": "application/json"}


def test_verify_accepts_one_of_several_signatures_and_refuses_a_changed_body() -> None:
    signer = WebhookSigner(SPEC_SECRET)
    header = "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= " + SPEC_SIGNATURE
    assert signer.verify(SPEC_ID, SPEC_TIMESTAMP, SPEC_PAYLOAD, header)
    assert not signer.verify(SPEC_ID, SPEC_TIMESTAMP, b'{"test": 2432232315}', header)
    assert not signer.verify(SPEC_ID, SPEC_TIMESTAMP + 1, SPEC_PAYLOAD, SPEC_SIGNATURE)


@pytest.mark.parametrize("secret", ["whsec_not base64!", "whsec_" + base64.b64encode(b"short").decode(), ""])
def test_bad_secrets_are_refused(secret: str) -> None:
    with pytest.raises(ValueError, match="webhook secret"):
        WebhookSigner(secret)
