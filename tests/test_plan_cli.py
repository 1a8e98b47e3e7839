"""``python -m meshtrain.plan`` as a command: pipeline layouts whose temp memory is estimated loosely
are marked ``fits?`` and ``--verify``'s compiled verdict overrules the estimate, a plugin family is
planned, and the device count is capped.
"""

from __future__ import annotations

from utils import REPO, TINY


def test_pipeline_verdicts_are_marked_and_verify_overrules(capsys):
    """meshtrain.plan ranked pipeline layouts as "fits" that its own --verify measured at several times
    the estimate: they are marked, and the compiled verdict is printed beside the estimate."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config

    plan = planner.make_plan(load_config(TINY), 8, 80e9, meshes=[(1, 4, 1, 2), (2, 2, 2, 1)], zero_stages=[3],
                             remats=[planner.RematPolicy.FULL])
    text = planner.format_plan(plan, top=10, show_infeasible=0)
    rows = {line.split()[1]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert rows["(1,4,1,2)"].rstrip().endswith("fits?") and rows["(2,2,2,1)"].rstrip().endswith("fits")
    assert "fits? = pipeline temp memory is estimated within" in text and "--verify" in text
    est = next(e for e in plan.estimates if e.candidate.stage == 2)
    measured = {"argument": 1e9, "output": 1e9, "temp": 90e9, "seconds": 1.0}  # what XLA could report
    assert planner.verified_verdict(measured, 80e9) == "does not fit: XLA needs 91 GB"
    assert "does not fit: XLA needs 91 GB" in planner.format_verify([(est, measured)], 8, 80e9)


def test_the_plan_cli_plans_a_plugin_family(capsys):
    from meshtrain import plan as planner

    toy = str(REPO / "tests" / "toy_gpt.yaml")
    assert planner.main(["--config", toy, "--devices", "8", "--device-memory", "1GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: toy_gpt, ") and "fits" in out


def test_plan_devices_are_capped(capsys):
    from meshtrain import plan

    assert plan.main(["--config", TINY, "--devices", str(10 ** 12), "--device-memory", "80GB"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --devices: must be an integer in [1, 1,048,576], got 1,000,000,000,000"
