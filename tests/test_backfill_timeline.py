"""Where a backfill run's missing replica-seconds went (trainer.backfill_timeline): each joiner's
start-up, its wait to be admitted, and the time with no joiner on the way; a joiner stopped in
its start-up is not counted as a wait, and its node's next joiner is measured from its own start."""
from spotguard.trainer.backfill_timeline import JoinerRecord, below_max, joiner_waits, summarize_joiners


def test_below_max_splits_the_missing_replicas_by_what_they_wait_for():
    # max 4: one member leaves at 10 (its standby started at 9, ready at 13, admitted at 14);
    # another leaves at 20, nobody is on the way until 24 (fallback-after), that joiner is
    # admitted at 28 (ready at 27).
    memberships = [(0.0, 4), (10.0, 3), (14.0, 4), (20.0, 3), (28.0, 4)]
    records = [JoinerRecord("od-0", 9.0, ready=13.0, admitted=14.0),
               JoinerRecord("od-1", 24.0, ready=27.0, admitted=28.0)]
    split = below_max(memberships, records, 4, since=0.0, until=40.0)
    assert split == {"startup": 3.0 + 3.0, "startup_stopped": 0.0, "admission": 1.0 + 1.0, "uncovered": 4.0}


def test_a_joiner_stopped_in_its_start_up_is_its_own_cause_and_no_wait():
    memberships = [(0.0, 2), (5.0, 1), (12.5, 2), (18.0, 1), (30.0, 2)]
    records = [JoinerRecord("node-1", 4.0, stopped=8.0),  # its node reclaimed during its start-up
               JoinerRecord("od-0", 8.0, ready=12.0, admitted=12.5),
               JoinerRecord("node-1", 20.0, ready=25.0, admitted=30.0)]
    split = below_max(memberships, records, 2, since=0.0, until=31.0)
    assert split == {"startup": 4.0 + 5.0, "startup_stopped": 3.0, "admission": 0.5 + 5.0, "uncovered": 2.0}
    assert joiner_waits(records) == [4.5, 10.0]  # not 26 s for node-1 (its first joiner never joined)
    summary = summarize_joiners(records)
    assert summary["admitted"] == 2 and summary["stopped"] == 1
    assert summary["startup_max_s"] == 5.0 and summary["admission_median_s"] == 2.75


def test_time_outside_the_window_and_at_max_counts_nothing():
    memberships = [(-5.0, 1), (2.0, 2)]
    assert below_max(memberships, [], 2, since=0.0, until=10.0)["uncovered"] == 2.0
