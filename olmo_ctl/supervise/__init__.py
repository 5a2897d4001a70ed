"""Run supervision: submit attempts of a run and keep them going until its final step is committed.

`attempts` is the attempt lifecycle (backend factory, submit_next, stop_and_wait, the live attempt,
`submit_attempt` for `olmo-ctl submit`); `supervisor.Supervisor` is the `resume-until-done` loop;
`policy` holds the outcome -> action table, the retry, backoff and stall rules as data; `resize`
and `smoke` drive attempts through `attempts` too.
"""
