"""`make preflight-shipped`: compile shipped recipes for slices of the catalog and record the results in
`olmo_ctl/preflight/shipped.json`, the package data `submit` and `preflight` answer from without compiling
(with the same trainer version, jax, jaxlib and libtpu, and no site XLA flags of one's own).

    python -m tools.preflight_shipped [RECIPE:DEVICE ...] [--out FILE] [--recompile]

Each pair is lowered as `olmo-ctl preflight --recipe RECIPE --device DEVICE` lowers it (in a process of
its own, the recipe as shipped, the plan's micro-batch, the pods' XLA flags), never answered from the
user's cache. Where the file already holds the pair's result for the same compilers and its program
(`program_digest`: the lowered train and eval steps) is the one this trainer lowers, the result is
re-keyed to this trainer version without compiling (seconds: an edit of the trainer that changes no
program costs nothing); otherwise, or with `--recompile`, the pair is compiled and its result replaces
the entry. The other entries of the same trainer and compilers stay. Without pairs: DEFAULT_PAIRS
(OLMo 3 7B's three stages on the case study's two slices, and the smoke recipe on v5p-8; compiling all
of them takes about 18 to 23 minutes on a 2-core machine, re-keying them about 1 to 2 minutes). Results
of other compiler or trainer versions are dropped: nothing would use them beside these.

Exit codes: 0 written, 2 bad input (an unknown recipe or device, a pair the plan refuses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from olmo_ctl.core.errors import OlmoCtlError

DEFAULT_PAIRS = (
    *(f"olmo3-7b-stage{stage}:{device}" for stage in (1, 2, 3) for device in ("tpu7x-128", "v5p-256")),
    "smoke:v5p-8",  # seconds to compile: the one tests/test_preflight.py compiles again and compares
)


def record(pairs: list[str], out: Path, log=print, recompile: bool = False) -> dict:
    """Re-key or compile each RECIPE:DEVICE pair and write `out`; returns what was written."""
    from olmo_ctl.core.devices import get_device
    from olmo_ctl.core.errors import BadInput
    from olmo_ctl.core.recipe import load_recipe
    from olmo_ctl.preflight.cache import compiler_versions, trainer_version
    from olmo_ctl.preflight.compile import compile_in_own_process, shipped_key_for

    jobs = []
    for pair in pairs:
        name, sep, device_name = pair.partition(":")
        if not sep or not name or not device_name:
            raise BadInput(f"`{pair}` is not RECIPE:DEVICE", "for example olmo3-7b-stage1:tpu7x-128")
        recipe, device = load_recipe(name), get_device(device_name)
        jobs.append((pair, recipe, device, shipped_key_for(recipe, device)))  # refuses before compiling
    compilers = compiler_versions()
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    # Results of other compiler versions, or of another trainer version (used by nothing once this one
    # is shipped), are dropped.
    version = trainer_version()
    previous = {
        k: v
        for k, v in (data.get("results") or {}).items()
        if data.get("compilers") == compilers and isinstance(v, dict)
    }
    results = {k: v for k, v in previous.items() if v.get("trainer_version") == version}
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    for pair, recipe, device, key in jobs:
        before = previous.get(key)
        reuse = before if not recompile and isinstance(before, dict) and before.get("program") else None
        log(
            f"{pair}: "
            + ("lowering to compare with the result of the same program" if reuse else "compiling")
        )
        # In a process of its own, as `submit` and `preflight` compile it: libtpu keeps the flags it
        # started with for the life of a process (olmo_ctl/preflight/compile.py).
        result = compile_in_own_process(recipe, device, log=progress, reuse=reuse).to_dict()
        kept = reuse is not None and result.get("program") == reuse["program"]
        if kept:  # the figures as compiled, re-keyed to this trainer version
            result = {**reuse, "trainer_version": version}
        result.update(cached=False, shipped=False)
        results[key] = result
        verdict = "fits" if result["fits"] else "does not fit"
        how = f"the same program as trainer {reuse['trainer_version']}'s, re-keyed" if kept else "compiled"
        log(f"{pair}: {how}: {verdict}, peak {result['peak_bytes_per_device'] / 2**30:.2f} GiB per device")
    data = {"compilers": compilers, "results": dict(sorted(results.items()))}
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    from olmo_ctl.preflight.cache import SHIPPED_PATH

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="*", default=list(DEFAULT_PAIRS), metavar="RECIPE:DEVICE")
    ap.add_argument("--out", type=Path, default=SHIPPED_PATH)
    ap.add_argument("--recompile", action="store_true", help="compile every pair, even an unchanged program")
    args = ap.parse_args(argv)
    try:
        data = record(args.pairs, args.out, recompile=args.recompile)
    except OlmoCtlError as e:
        sys.stderr.write(f"error: {e.one_line()}\n")
        return e.exit_code
    print(f"wrote {args.out}: {len(data['results'])} results for {data['compilers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
