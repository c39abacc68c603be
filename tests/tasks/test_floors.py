"""tasks/ in floors (docs/architecture.md): what the stages share sits below them, no stage imports another,
and nothing below the stages imports one.

Floors, lowest first; a module may import its own package and the floors below its own:
- the shared modules, directly in tasks/ (records, models, KV statistics, config, layout, training, ...);
- tasks.weights, tasks.checks and tasks.real_model, each standing on the shared modules alone;
- tasks.stages, the eight stages, each on its own: a stage never imports another stage;
- tasks.release, the flow's steps after the stages: it reads their outputs from disk, never their code.

The scan is the AST one of the other layering tests (``import_graph_testkit``): lazy and type-only
imports count.
"""

from __future__ import annotations

from import_graph_testkit import ROOT, imports, module_name, source_modules

SHARED = "tasks"
LIBRARIES = ("tasks.weights", "tasks.checks", "tasks.real_model")
STAGES = "tasks.stages"
RELEASE = "tasks.release"
STAGE_NAMES = ("data", "base_model", "compile", "finetune", "calibrate", "evaluate", "gates", "package")


def floor_of(module: str) -> str | None:
    """The package a tasks module lives in: one of LIBRARIES, STAGES or RELEASE, or SHARED; None outside tasks."""
    if module != "tasks" and not module.startswith("tasks."):
        return None
    return next((pkg for pkg in (*LIBRARIES, STAGES, RELEASE) if module == pkg or module.startswith(pkg + ".")),
                SHARED)


# What each floor may import of tasks/, besides the module itself and, except for the stages, its own package.
MAY_IMPORT = {
    SHARED: {SHARED},
    **{library: {SHARED} for library in LIBRARIES},
    STAGES: {SHARED, *LIBRARIES},
    RELEASE: {SHARED},
}


def floor_offences(root=ROOT) -> list[str]:
    offenders = []
    for path in source_modules(root, ("tasks",)):
        here = module_name(path, root)
        mine = floor_of(here)
        for line, module, names in imports(path, root):
            targets = [f"{module}.{n}" if module in ("tasks", *LIBRARIES, STAGES, RELEASE) else module
                       for n, _ in names] or [module]
            for target in targets:
                theirs = floor_of(target)
                if theirs is None or target == here:
                    continue
                own_package = theirs == mine and mine not in (SHARED, STAGES)
                if not own_package and theirs not in MAY_IMPORT[mine]:
                    offenders.append(f"{path.relative_to(root)}:{line} ({mine}) imports {target} ({theirs})")
    return offenders


def test_no_stage_imports_another_and_nothing_below_the_stages_imports_one():
    assert floor_offences() == []


def test_the_stages_are_the_eight_of_dvc_yaml_each_in_tasks_stages():
    stages = sorted(p.stem for p in (ROOT / "tasks" / "stages").glob("*.py") if p.stem != "__init__")
    assert stages == sorted(STAGE_NAMES)
    dvc_yaml = (ROOT / "dvc.yaml").read_text()
    assert all(f"python -m tasks.stages.{name} --params params.yaml" in dvc_yaml for name in STAGE_NAMES)


def test_the_check_names_a_stage_importing_another_and_a_shared_module_importing_a_stage(tmp_path):
    for package in ("tasks", "tasks/stages", "tasks/checks"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tasks" / "records.py").write_text("def f():\n    from tasks.stages import data\n")
    (tmp_path / "tasks" / "stages" / "data.py").write_text("from tasks.records import f\n")
    (tmp_path / "tasks" / "stages" / "evaluate.py").write_text("from tasks.stages.data import f\nimport tasks.checks.x\n")
    (tmp_path / "tasks" / "checks" / "x.py").write_text("from ..records import f\n")
    assert floor_offences(tmp_path) == [
        "tasks/records.py:2 (tasks) imports tasks.stages.data (tasks.stages)",
        "tasks/stages/evaluate.py:1 (tasks.stages) imports tasks.stages.data (tasks.stages)",
    ]
