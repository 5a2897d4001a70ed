"""`olmo-ctl verify RUN --reference REF`: the landmark table of a reproduction against its reference."""

import math
import os
from typing import Annotated

import typer

from olmo_ctl.backends import THIS_MACHINE
from olmo_ctl.cli.app import Output, OutputOpt, app, print_data
from olmo_ctl.cli.evaluate import SuiteOpt
from olmo_ctl.cli.options import SiteFlags, TimeoutOpt, _echo, note, site_options
from olmo_ctl.observe.verify_run import DEFAULT_KL_TOKENS


def _steps(text: str | None) -> list[int] | None:
    from olmo_ctl.core.errors import BadInput

    if not text:
        return None
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise BadInput(
            f"--steps {text!r} is not a list of step numbers", "e.g. --steps 10000,20000"
        ) from None


def _plain(x):
    """NaN (no accuracy task, say) as null in -o json."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def _path(p: str) -> str:
    from olmo_ctl import storage

    return p if storage.is_gcs(p) or p.startswith("hf:") else os.path.abspath(p)


@app.command(
    example="olmo-ctl verify gs://b/runs/olmo3-7b-s1 --reference gs://b/ai2-reference --backend gke --device v5p-64"
)
@site_options(exclude=("backend",))
def verify(
    run: Annotated[str, typer.Argument(metavar="RUN", help="The run directory (local or gs://).")],
    reference: Annotated[
        str,
        typer.Option(
            "--reference",
            help="Another run directory, a directory of checkpoints named by step (stage1-step10000, ...), "
            "or hf:ORG/NAME[@REVISION,...]: revisions of a Hugging Face repository in its local cache.",
        ),
    ],
    steps: Annotated[
        str | None, typer.Option("--steps", help="Landmark steps N,N,... (default: every step both have).")
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks", help="Downstream tasks LABEL,... or olmo3 (default: the run's eval.downstream)."
        ),
    ] = None,
    suite: SuiteOpt = None,
    lm: Annotated[
        str | None,
        typer.Option("--lm", help="LM sets: MIX, LABEL=PATH,... or none (default: the run's eval.lm)."),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Only each task's first N documents (0: all).")] = 0,
    kl_tokens: Annotated[
        int,
        typer.Option(
            "--kl-tokens",
            help="Held-out tokens of the KL, or all the held-out data holds when fewer (0: no KL).",
        ),
    ] = DEFAULT_KL_TOKENS,
    lm_tolerance: Annotated[
        float | None,
        typer.Option(
            "--lm-tolerance",
            help="|Δ held-out loss| (nats) above which it moved (default: --sigmas σ of each domain, "
            "from both sides' per-document variance).",
        ),
    ] = None,
    sigmas: Annotated[
        float,
        typer.Option(
            "--sigmas",
            help="A Δ beyond this many σ is outside its band (held-out loss, macro accuracy, each task).",
        ),
    ] = 2.0,
    kl_tolerance: Annotated[
        float | None,
        typer.Option(
            "--kl-tolerance",
            help="Mean KL (nats/token) above which it moved (default 0.5: two faithful independent runs "
            "measured 0.389; docs/verifying.md).",
        ),
    ] = None,
    precision: Annotated[
        str,
        typer.Option(
            "--precision", help="Both sides' matmuls in float32 or bfloat16 (logits float32 either way)."
        ),
    ] = "float32",
    no_floor: Annotated[
        bool,
        typer.Option(
            "--no-floor",
            help="Skip the noise floor (the reference at the first landmark in the other precision): "
            "no landmark is then judged identical.",
        ),
    ] = False,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="local: cpu-N, N host CPU devices of this process (default cpu-1); gke: the TPU slice "
            "each eval job runs on (v5p-8, tpu7x-8, v5p-64: one process per host, each reading its shards).",
        ),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="local: evaluate in this process; gke: every evaluation and KL an eval job on the cluster, "
            "submitted together. The backend site setting does not apply.",
        ),
    ] = THIS_MACHINE,
    timeout: TimeoutOpt = 86400.0,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="The run's recipe, for a run directory without run.yaml."),
    ] = None,
    plot: Annotated[
        str | None, typer.Option("--plot", help="Write both runs' macro accuracy and the Δ band to this PNG.")
    ] = None,
    output: OutputOpt = Output.table,
    *,
    site: SiteFlags,
) -> None:
    """Compare a run with its reference at every step both have a checkpoint of.

    Per landmark: Δ held-out loss per domain with σ (per-document variance), Δ per task judged
    jointly and Δ macro downstream accuracy with σ (the per-task standard errors of both sides in
    quadrature), the token-level KL(reference || run) on identical held-out tokens, tokens per step
    and the run's data audit, both sides in one precision; a level: identical (within the noise
    floor verify measures), same recipe (inside the bands of faithful independent runs) or moved
    (each surface named). Evaluations are kept in the run directory (eval/verify/): a second verify
    evaluates nothing new. --backend gke evaluates where the checkpoints are: each evaluation and KL
    an eval job on --device's slice, all submitted together, each read back from its result when it
    already ran.

    Exit codes: 0 every landmark within noise, 1 a surface moved (named), 2 bad input (no such run or
    reference, no step in common, a missing tokenizer, an unknown task, a path the pods cannot see),
    3 the cluster or storage unreachable, 4 an eval job gave up, 124 timed out waiting for eval jobs
    (they go on; the same command waits for them again), 130 interrupted.
    """
    from olmo_ctl.backends import backend_class
    from olmo_ctl.cli.convert import _need
    from olmo_ctl.cli.evaluate import chosen_tasks, cpu_count, parse_lm

    kind = backend_class(backend)  # an unknown name: one line, exit 2
    _need("jax", "orbax.checkpoint", extra="trainer")
    chosen = chosen_tasks(tasks, suite)
    lm_sets = None if lm is None else parse_lm(lm)
    landmarks = _steps(steps)
    remote = None
    if kind.trains_here:
        n = cpu_count(device or "cpu-1")
        from olmo_ctl.trainer.quiet import cpu_devices

        cpu_devices(n)  # before anything starts JAX
    else:
        n = 1
        remote = _eval_jobs(device, site.replace(backend=backend).resolve(), timeout)
        from olmo_ctl.trainer.quiet import cpu_only

        cpu_only()  # this machine only reads checkpoints' metadata and the kept results
    from olmo_ctl.observe.verify_run import verify as do_verify

    res = do_verify(
        _path(run),
        _path(reference),
        steps=landmarks,
        tasks=chosen,
        lm=lm_sets,
        limit=limit,
        kl_tokens=kl_tokens,
        devices=n,
        lm_tolerance=lm_tolerance,
        sigmas=sigmas,
        kl_tolerance=kl_tolerance,
        recipe_name=recipe,
        precision=precision,
        floor=not no_floor,
        remote=remote,
        log=note,
    )
    if plot:
        from olmo_ctl.observe.verify import plot as draw

        draw(res["landmarks"], _path(plot), sigmas=sigmas)
        res["plot"] = _path(plot)
    if output != Output.table:
        print_data(_plain(res), output)
    else:
        _table(res)
    if any(not m["within_noise"] for m in res["landmarks"]):
        raise typer.Exit(1)


def _eval_jobs(device: str | None, settings, timeout: float):
    """verify_run's `remote` for `--backend gke`: each spec resolved and checked as `eval --backend gke`
    checks one, every one of them before the first is submitted, then all run at once."""
    from olmo_ctl.core.errors import BadInput

    if device is None:
        raise BadInput("verify --backend gke needs the eval jobs' slice", "--device v5p-8 or tpu7x-8")
    from olmo_ctl.backends.base import Target

    dev = Target.parse(device).device

    def remote(specs: dict) -> dict:
        from olmo_ctl.backends import make_backend
        from olmo_ctl.core.errors import Interrupted
        from olmo_ctl.supervise import evaljob as J

        jobs = {key: J.resolve(spec, dev, settings) for key, spec in specs.items()}
        names = sorted({j.name for j in jobs.values()})  # one job for the same spec, whoever asks it
        note(f"verify: {len(names)} eval job(s) on {dev.name}: {', '.join(names)}")
        try:
            return J.run_jobs(jobs, lambda: make_backend(settings), timeout_s=timeout, log=_echo)
        except KeyboardInterrupt:
            raise Interrupted("the eval jobs go on; run the same command to wait for their results") from None

    return remote


def _g(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _beyond(j: dict | None) -> str:
    if not j or not j.get("judged"):
        return "-"
    return f"{len(j['beyond'])}/{j['judged']} ({j['expected']:g} by chance)"


def _table(res: dict) -> None:
    from rich.table import Table

    from olmo_ctl.cli.app import console

    t = Table(show_edge=False)
    for col in ("step", "Δ held-out (worst)", "Δ macro acc", "σ", "tasks > 2σ", "KL", "verdict"):
        t.add_column(col, justify="right" if col != "verdict" else "left")
    for m in res["landmarks"]:
        worst = max(m["lm"].items(), key=lambda kv: abs(kv[1]), default=None)
        ds = m["downstream"]
        t.add_row(
            str(m["step"]),
            "-" if worst is None else f"{worst[1]:+.4f} {worst[0]}",
            _g(ds["macro"], "+.4f"),
            _g(ds["sigma"], ".4f"),
            _beyond(m.get("tasks_beyond")),
            _g(m["kl"], ".3g"),
            m["verdict"],
        )
    con = console()
    con.print(t)
    fl = res.get("floor")
    if fl:
        worst = max(fl["lm"].values(), default=0.0)
        con.print(
            f"noise floor (reference at step {fl['step']}, {fl['between'][0]} vs {fl['between'][1]}): "
            f"held-out {worst:.2g} nats" + (f", KL {fl['kl']:.2g}" if fl.get("kl") is not None else "")
        )
    a = res.get("audit")
    if a is None:
        con.print("data order: not audited (the run recorded no data-coverage records)")
    con.print(
        f"verdict: {res['verdict']} ({res['evaluated']} evaluated, {res['cached']} from eval/verify/)"
        + (f"; plot: {res['plot']}" if res.get("plot") else "")
    )
