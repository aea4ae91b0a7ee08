"""The relay's message body: the payload as compact UTF-8 JSON, whatever JSON value it holds (no broker needed)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sqla_jobs.drivers.base import Claimed
from sqla_jobs.relay._message import HEADER_ATTEMPT, HEADER_ID, outgoing

# What a payload may hold: JSON's values, with integers past 64 bits (orjson refuses those; the standard
# library's encoder takes over) and text past ASCII (written as UTF-8, not escaped).
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=12
)


def _job(payload: Any) -> Claimed:
    return Claimed(41, "order.created", "relay", payload, 2, 5, 0, "token")


@given(st.dictionaries(st.text(), values, max_size=6))
def test_the_body_is_the_payload_as_json(payload: dict[str, Any]) -> None:
    message = outgoing(_job(payload))
    assert json.loads(message.body) == payload
    assert (message.headers[HEADER_ID], message.headers[HEADER_ATTEMPT]) == ("41", "2")


@given(st.dictionaries(st.text(), st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                               lambda inner: st.lists(inner, max_size=3), max_leaves=8)))
def test_without_floats_the_body_is_the_compact_utf8_json_of_the_standard_library(payload: dict[str, Any]) -> None:
    # Floats are the one place two correct encoders may differ (1e+16 against 1e16); every other value
    # is written byte for byte as json.dumps(separators=(",", ":"), ensure_ascii=False) writes it.
    expected = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    assert outgoing(_job(payload)).body == expected
