"""`base doctor`'s distributed section, with the loopback link measured by a real 2-rank group."""

from __future__ import annotations

from baselm.commands import doctor_links as doctor
from baselm.distributed.probe import SIZES


def test_doctor_lists_the_ring_backend_and_times_a_loopback_all_sum():
    report = doctor.collect(links=True)
    assert report["backends"]["ring"] is True
    links = report["links"]
    assert (links["backend"], links["ranks"]) == ("ring", 2)
    assert [int(size) for size in links["all_sum_us_by_bytes"]] == list(SIZES)
    assert all(us > 0 for us in links["all_sum_us_by_bytes"].values())
    assert "ring all_sum over loopback" in doctor.summary(report)


def test_doctor_without_links_says_how_to_measure_them():
    report = doctor.collect()
    assert report["links"] is None
    assert "base doctor --links" in doctor.summary(report)
