"""Run supervision: submit attempts of a run and keep them going until its final step is committed.

`submit` is the one submit path (prepare one attempt with one plan, check it, create the run, submit
it); `attempts` is the attempt lifecycle under it (the run's site settings, submit_next,
stop_and_wait, the live attempt); `supervisor.Supervisor` is the `resume-until-done` loop; `policy`
holds the outcome -> action table, the retry, backoff and stall rules as data; `resize` and `smoke`
drive attempts through `attempts` and check them through `submit` too.
"""
