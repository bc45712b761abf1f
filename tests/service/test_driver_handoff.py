"""The handoff of an attempt's report secret and spec to its job driver, against a store of the GCS's shape."""

from __future__ import annotations

import logging

import pytest

from ringmaster.service import driver_handoff
from ringmaster.service.driver_handoff import (
    HANDOFF_NAMESPACE,
    DriverHandoff,
    HandoffMissing,
    HandoffUnreadable,
    handoff_key,
)
from ringmaster.service.spec import JobSpec

SECRET = "s3cr3t-report-token-of-attempt-1"


class DictStore:
    """The GCS key-value store's semantics in a dict: namespaces apart, put replaces, delete says if it removed."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], bytes] = {}
        self.delete_finds_nothing = False  # as when another driver deleted the key between this one's get and delete

    def put(self, namespace: str, key: str, value: bytes) -> None:
        self.values[(namespace, key)] = value

    def get(self, namespace: str, key: str) -> bytes | None:
        return self.values.get((namespace, key))

    def delete(self, namespace: str, key: str) -> bool:
        removed = self.values.pop((namespace, key), None) is not None
        return removed and not self.delete_finds_nothing


def _spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "handed-off",
            "model": "mlp",
            "workers": {"min": 1, "max": 2},
            "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        }
    )


def _handoff() -> DriverHandoff:
    return DriverHandoff(report_token=SECRET, spec=_spec())


def test_the_driver_takes_what_the_control_plane_put_secret_and_spec_alike() -> None:
    store = DictStore()
    driver_handoff.put(store, "ringmaster-job1-1", _handoff().to_json())
    taken = driver_handoff.take(store, "ringmaster-job1-1")
    assert taken.report_token.get_secret_value() == SECRET
    assert taken.spec == _spec()


def test_a_handoff_is_taken_once() -> None:
    store = DictStore()
    driver_handoff.put(store, "ringmaster-job1-1", _handoff().to_json())
    driver_handoff.take(store, "ringmaster-job1-1")
    assert store.values == {}, "the secret leaves the store with the driver that took it"
    with pytest.raises(HandoffMissing, match="ringmaster-job1-1"):
        driver_handoff.take(store, "ringmaster-job1-1")


def test_of_two_drivers_taking_one_handoff_only_the_one_that_deleted_it_gets_it() -> None:
    store = DictStore()
    driver_handoff.put(store, "ringmaster-job1-1", _handoff().to_json())
    store.delete_finds_nothing = True
    with pytest.raises(HandoffMissing):
        driver_handoff.take(store, "ringmaster-job1-1")


def test_each_attempt_has_a_key_of_its_own_in_ringmasters_namespace() -> None:
    store = DictStore()
    driver_handoff.put(store, "ringmaster-job1-1", _handoff().to_json())
    driver_handoff.put(store, "ringmaster-job1-2", DriverHandoff(report_token="second", spec=_spec()).to_json())
    assert set(store.values) == {
        (HANDOFF_NAMESPACE, handoff_key("ringmaster-job1-1")),
        (HANDOFF_NAMESPACE, handoff_key("ringmaster-job1-2")),
    }
    assert handoff_key("ringmaster-job1-1") != handoff_key("ringmaster-job1-2")
    assert driver_handoff.take(store, "ringmaster-job1-2").report_token.get_secret_value() == "second"
    assert driver_handoff.take(store, "ringmaster-job1-1").report_token.get_secret_value() == SECRET


def test_a_handoff_no_driver_took_is_dropped_and_dropping_twice_is_harmless() -> None:
    store = DictStore()
    driver_handoff.put(store, "ringmaster-job1-1", _handoff().to_json())
    driver_handoff.drop(store, "ringmaster-job1-1")
    driver_handoff.drop(store, "ringmaster-job1-1")
    assert store.values == {}


def test_the_secret_shows_in_no_repr_str_or_log_line(caplog: pytest.LogCaptureFixture) -> None:
    handoff = _handoff()
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("handed off %s (%r)", handoff, handoff)
    shown = [repr(handoff), str(handoff), repr(handoff.model_dump()), caplog.text]
    assert not any(SECRET in text for text in shown), shown
    assert SECRET in handoff.to_json(), "but the driver gets it"


def test_an_unreadable_handoff_is_named_by_its_fields_never_its_values() -> None:
    store = DictStore()
    store.put(
        HANDOFF_NAMESPACE, handoff_key("ringmaster-job1-1"), f'{{"report_token": "{SECRET}", "spec": 5}}'.encode()
    )
    with pytest.raises(HandoffUnreadable, match="spec") as unreadable:
        driver_handoff.take(store, "ringmaster-job1-1")
    assert SECRET not in str(unreadable.value)
    store.put(HANDOFF_NAMESPACE, handoff_key("ringmaster-job1-2"), f'{{"report_token": "{SECRET}'.encode())
    with pytest.raises(HandoffUnreadable) as cut_short:
        driver_handoff.take(store, "ringmaster-job1-2")
    assert SECRET not in str(cut_short.value) and cut_short.value.__cause__ is None
