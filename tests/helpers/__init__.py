"""Helpers the test modules share (no test module imports another): import them as `helpers.<module>`.

* `waiting`: `wait_for` (poll a predicate) and `kill_stopped_or_running` (clean up started processes).
* `trainer`: `train` (the bundled trainer as a subprocess), `scalars` (a run's TensorBoard scalars),
  `resume_copy`, `same_steps` (the bit-for-bit comparison of resumed steps).
* `events`: `write_segment` (contract-named event files written by TensorBoard's writer) and the
  deterministic `value(tag, step)` they hold.
* `cli`: `invoke` (the command line in this process: exit code, stdout, stderr) and `clean_env`.
* `runs`: `copy_run` (a copy of the session's trained smoke run, for tests that only read one).
* `attempts`: `attempt` and `attempt_of`, attempt requests built as `supervise.attempts.prepare` builds
  them (target, recipe, plan), for tests that hand one to a backend directly.
* `storage_proxy`: `StallingProxy`, a TCP proxy in front of the GCS emulator that, from a chosen
  request on, accepts and never answers (storage deadlines).
* `soak`: the soak (`run_soak`), which `tests/test_soak.py` and `benchmarks/soak.py` run (the latter
  with the repository root on PYTHONPATH, as `tests.helpers.soak`).

See docs/testing.md.
"""
