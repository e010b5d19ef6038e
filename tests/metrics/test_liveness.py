"""A line at least every 30 s (here 0.2 s): a silent phase is said with what it is doing; any line restarts the
wait, so a run that logs often never sees one."""

import logging
import time

from dtrain.metrics.liveness import doing, liveness


def test_a_silent_phase_is_said_with_what_it_does_and_for_how_long(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"), liveness(every_s=0.2):
        doing("in step 3 of 9")
        time.sleep(0.7)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still")]
    assert said and all(line.startswith("still in step 3 of 9: ") for line in said)
    assert 1 <= len(said) <= 4  # one per 0.2 s of silence, each restarting the wait
    doing("outside any run")  # no block: nothing to tell, no error


def test_a_phase_that_logs_often_gets_no_liveness_line(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"), liveness(every_s=0.3):
        for _ in range(8):
            logging.getLogger("dtrain").info("step line")
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.getMessage().startswith("still")]
