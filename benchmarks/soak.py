"""The soak: the smoke recipe on an emulated v5p-16 in the sandbox under the shipped fault timeline
(benchmarks/soak_timeline.yaml: every fault class of `olmo-ctl sandbox fault` at least once, and a
capacity outage that sends the run to a v5p-8 and back), left to `olmo-ctl resume-until-done`, then
an uninterrupted twin. What it measures and how: tests/helpers/soak.py.

    PYTHONPATH=. python benchmarks/soak.py [--steps 200] [--timeline FILE] [--work DIR]

The last stdout lines are one JSON object: wall_s, train_s, goodput, lost_s (seconds lost per fault
class), losses_equal_twin_before_fallback, max_loss_diff_after_fallback, replay_mismatches, the
attempts and their devices. Exit 0 when both the soak and the twin finished (exit 0), else 1.
"""

from __future__ import annotations

import sys

from tests.helpers.soak import main

if __name__ == "__main__":
    sys.exit(main())
