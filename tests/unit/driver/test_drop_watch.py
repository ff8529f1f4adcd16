"""The wait's warning under dynamic sampling: once, when a batch's worth was dropped."""

from sluice.driver.session import DropWatch


def test_it_tells_once_when_a_batchs_worth_was_dropped():
    watch = DropWatch(batch=16, start=100)
    assert watch.first_batch(110) == 0  # 10 dropped: less than a batch
    assert watch.first_batch(120) == 20
    assert watch.first_batch(200) == 0  # said once a wait


def test_a_store_restarted_in_place_counts_from_zero_again():
    watch = DropWatch(batch=16, start=100)
    assert watch.first_batch(4) == 0  # the new store's count: from 0 now
    assert watch.first_batch(16) == 16
