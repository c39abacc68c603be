import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tasks.config import ReleaseConfig, load_config
from tasks.release.stage_runner import PipelineError, ensure_dvc_repo, reproduce_stage, stage_names, write_params_file

REPO = Path(__file__).resolve().parents[2]
PARAMS = textwrap.dedent("""\
    # header comment stays
    data:
      month: "2026-11"              # release month
      seed: 1234                    # seeds everything

    gates:
      min_accuracy_new: 0.95        # floor
    """)


def test_params_file_is_rewritten_in_place_keeping_comments_and_untouched_lines(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    cfg = ReleaseConfig.model_validate({"data": {"month": "2026-12", "seed": 1234}, "gates": {"min_accuracy_new": 1.01},
                                        "publish": {"dry_run": True}})
    changed = write_params_file(cfg, path)
    assert changed == ["data.month", "gates.min_accuracy_new", "publish.dry_run"]
    # Only the values changed (the month keeps its quotes); a section the file lacked is appended.
    assert path.read_text() == PARAMS.replace('"2026-11"', '"2026-12"').replace("0.95 ", "1.01 ") + "publish:\n  dry_run: true\n"
    assert load_config(path) == cfg


def test_the_repository_params_file_changes_only_on_the_edited_lines(tmp_path):
    import difflib

    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())
    before = path.read_text().splitlines()
    cfg = ReleaseConfig.model_validate({"data": {"month": "2026-12"}, "gates": {"max_weight_accuracy_drop": {"int8": 0.01}},
                                        "engine": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}})
    assert write_params_file(cfg, path) == ["data.month", "engine.target_modules", "gates.max_weight_accuracy_drop.int8"]
    diff = [line for line in difflib.unified_diff(before, path.read_text().splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    month = next(line for line in before if line.startswith("  month:"))
    modules = next(line for line in before if line.startswith("  target_modules: [q_proj, k_proj, v_proj, o_proj]  #"))
    drop = next(line for line in before if line.startswith("  max_weight_accuracy_drop:"))
    # The comment of each edited line is kept byte for byte, at its column (a shorter value pads it,
    # a longer one pushes it right, one space after the value).
    assert diff == ["-" + month, "+" + month.replace("2026-11", "2026-12"),
                    "-" + modules, "+" + modules.replace("o_proj]  #", "o_proj, up_proj] #"),
                    "-" + drop, "+" + drop.replace("{int8: 0.005, int4: 0.02}  #", "{int8: 0.01, int4: 0.02}   #")]
    assert load_config(path) == cfg


BLOCK_LIST = textwrap.dedent("""\
    lora:
      r: 8                # rank
      target_modules:     # LoRA inputs
        - q_proj          # queries
        - k_proj
        - v_proj
      # lines after the list stay after it
    engine:
      target_modules:
        - q_proj
        - k_proj
        - v_proj
        - o_proj
    """)


@pytest.mark.parametrize("modules, expected", [
    (["q_proj", "v_proj", "k_proj"], "    - q_proj          # queries\n    - v_proj\n    - k_proj\n"),
    (["q_proj"], "    - q_proj          # queries\n"),
    (["q_proj", "k_proj", "v_proj", "o_proj"], "    - q_proj          # queries\n    - k_proj\n    - v_proj\n    - o_proj\n"),
], ids=["reordered", "shorter", "longer"])
def test_a_block_style_list_is_edited_item_by_item(tmp_path, modules, expected):
    path = tmp_path / "params.yaml"
    path.write_text(BLOCK_LIST)
    cfg = ReleaseConfig.model_validate({"lora": {"target_modules": modules}})
    assert write_params_file(cfg, path) == ["lora.target_modules"]
    old_items = "    - q_proj          # queries\n    - k_proj\n    - v_proj\n"
    assert path.read_text() == BLOCK_LIST.replace(old_items, expected)
    assert load_config(path) == cfg


def test_a_flow_style_list_stays_on_its_line(tmp_path):
    path = tmp_path / "params.yaml"
    text = "lora:\n  target_modules: [q_proj, k_proj]   # inline\n  r: 4\n"
    path.write_text(text)
    cfg = ReleaseConfig.model_validate({"lora": {"r": 4, "target_modules": ["v_proj", "o_proj"]}})
    assert write_params_file(cfg, path) == ["lora.target_modules"]
    assert path.read_text() == "lora:\n  target_modules: [v_proj, o_proj]   # inline\n  r: 4\n"


def test_a_missing_params_file_is_written_with_every_setting(tmp_path):
    path = tmp_path / "params.yaml"
    cfg = ReleaseConfig.model_validate({"data": {"month": "2026-12"}})
    assert "kv.k_bits" in write_params_file(cfg, path)
    assert load_config(path) == cfg and "jsonl_dir: null" in path.read_text()


def test_params_file_that_already_states_the_config_is_not_touched(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    before = path.stat().st_mtime_ns
    assert write_params_file(load_config(path), path) == []
    assert path.stat().st_mtime_ns == before and path.read_text() == PARAMS


def git_repo(path):
    path.mkdir(parents=True, exist_ok=True)
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"]):
        subprocess.run(cmd, cwd=path, check=True)
    return path


def test_a_stage_runs_once_then_is_up_to_date_until_its_params_change(tmp_path):
    repo = git_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text("greeting: hello\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "make": {"cmd": "python -c \"import yaml; open('out.txt','w').write(yaml.safe_load(open('params.yaml'))['greeting'])\"",
                 "params": ["greeting"], "outs": ["out.txt"]},
        "shout": {"cmd": "python -c \"open('loud.txt','w').write(open('out.txt').read().upper())\"",
                  "deps": ["out.txt"], "outs": ["loud.txt"]},
    }}, sort_keys=False))
    remote = ensure_dvc_repo(repo, tmp_path / "remote")
    assert Path(remote).is_dir() and remote in (repo / ".dvc" / "config.local").read_text()
    assert stage_names(repo) == ["make", "shout"]
    first = [reproduce_stage(repo, s) for s in ("make", "shout")]
    assert [(r.reproduced, r.outputs) for r in first] == [(True, ("out.txt",)), (True, ("loud.txt",))]
    assert (repo / "loud.txt").read_text() == "HELLO"
    again = [reproduce_stage(repo, s) for s in ("make", "shout")]
    assert [(r.reproduced, r.outputs) for r in again] == [(False, ()), (False, ())]
    assert again[0].describe() == f"make: up to date ({again[0].seconds:.1f} s)"
    (repo / "params.yaml").write_text("greeting: bye\n")
    assert [reproduce_stage(repo, s).reproduced for s in ("make", "shout")] == [True, True]
    assert (repo / "loud.txt").read_text() == "BYE"


def test_a_failing_stage_names_itself(tmp_path):
    repo = git_repo(tmp_path / "repo")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"broken": {"cmd": "exit 3", "outs": ["never.txt"]}}}))
    ensure_dvc_repo(repo, tmp_path / "remote")
    with pytest.raises(PipelineError, match="DVC stage 'broken' failed"):
        reproduce_stage(repo, "broken")


def test_a_url_remote_is_taken_as_is_and_a_folder_is_made_absolute(tmp_path):
    from tasks.release.stage_runner import remote_url

    assert remote_url(tmp_path, "s3://bucket/releases") == "s3://bucket/releases"
    assert remote_url(tmp_path, "store") == str(tmp_path / "store") and (tmp_path / "store").is_dir()


def test_dvc_needs_a_git_repository(tmp_path):
    with pytest.raises(PipelineError, match="not a git repository"):
        ensure_dvc_repo(tmp_path, tmp_path / "remote")


def test_a_run_with_other_parameters_puts_the_params_file_back_when_it_ends(tmp_path):
    from tasks.release.stage_runner import params_for_run

    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    cfg = ReleaseConfig.model_validate({"data": {"month": "2026-12"}, "publish": {"dry_run": True}})
    with pytest.raises(RuntimeError):
        with params_for_run(cfg, path) as changed:
            assert changed == ["data.month", "publish.dry_run"]
            assert load_config(path).publish.dry_run is True
            raise RuntimeError("the run failed")
    assert path.read_text() == PARAMS


def test_a_killed_run_leaves_the_params_file_to_be_restored_by_the_next(tmp_path):
    from tasks.release.stage_runner import params_for_run

    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    killed = params_for_run(ReleaseConfig.model_validate({"data": {"month": "2026-12"}}), path)
    killed.__enter__()  # the run dies here: no __exit__
    assert load_config(path).data.month == "2026-12"
    with params_for_run(load_config(tmp_path / ".params.yaml.before-run"), path) as changed:
        assert changed == []
    assert path.read_text() == PARAMS and not (tmp_path / ".params.yaml.before-run").exists()
