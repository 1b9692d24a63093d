"""The sweep: every valid prepare/finalize x experts pair of a spec, at each token count, checked
against the float64 reference and timed, one row per case into a run folder.

    spec.py       SweepSpec: what a sweep asks for
    cases.py      the plan of pairs, the row each case starts from, and the one loop (run_cases)
    measure.py    the one measure step: check, then time (the tuner's too)
    layer.py      a rank's layer for a spec and the work of a case
    variants.py   registered calls a case times beside the layer (a benchmark's variants)
    local.py      runner: one process, every expert here
    ranks.py      runner: real ranks (spawned or torchrun), rank 0 writes
    simulated.py  runner: one rank's share computed here, communication modeled
    driver.py     which runner a spec takes here, and the run folder (run_in_folder)
"""

from moebench.sweep.cases import cases_to_run, plan
from moebench.sweep.driver import (
    RunPlan,
    check_fits_for,
    check_ranks_fit,
    choose_mode,
    plan_run,
    run,
    run_in_folder,
    run_local,
    run_multirank,
    run_simulated,
    shared_gpu_note,
    simulated_spec,
)
from moebench.sweep.spec import SweepSpec, default_experts, resolve_names

__all__ = [
    "RunPlan", "SweepSpec", "cases_to_run", "check_fits_for", "check_ranks_fit", "choose_mode", "default_experts", "plan", "plan_run", "resolve_names", "run",
    "run_in_folder", "run_local", "run_multirank", "run_simulated", "shared_gpu_note", "simulated_spec",
]
