"""Run supervision: submit attempts of a run and keep them going until its final step is committed.

`submit.submit_attempt` creates the run (or its next attempt); `supervisor.Supervisor` is the
`resume-until-done` loop; `policy` holds the retry, backoff and stall rules as data.
"""
