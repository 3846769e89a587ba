"""The Makefile's variables as `make -n` plans them: the commands it would run, nothing run (STAMP= skips the setup).

Found in a review (2026-12-03): `$(if $(PUSH),--push)` read PUSH=0 as on, so `make export ... PUSH=0` pushed to the
Hub and OVERWRITE=0 replaced an export; `make eval` and `make export` dropped ARGS without a word; and
`make test TEST_WORKERS=0` (or auto) stopped in the shell's arithmetic (division by 0) before pytest ran.
"""

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SWITCHES = {"FORCE": ("features", "--force"), "SPECULATORS": ("export", "--speculators"),
            "OVERWRITE": ("export", "--overwrite"), "ALLOW_ENGINE_MISMATCH": ("export", "--allow-engine-mismatch"),
            "PUSH": ("export", "--push"), "PRIVATE": ("export", "--private"),
            "REPLACE_REPO": ("export", "--replace-repo")}
TARGET_VARIABLES = {"features": [], "export": ["RUN=outputs/tiny/r", "OUT=exports/x", "REPO=you/x"]}


def make_plan(*variables: str) -> subprocess.CompletedProcess:
    # under `make test` the parent make's MAKELEVEL/MAKEFLAGS would add "Entering/Leaving directory" lines; a switch
    # or ARGS in the caller's environment would be read as given
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "ARGS", *SWITCHES)}
    return subprocess.run(["make", "-n", "--no-print-directory", "STAMP=", *variables], cwd=REPO, env=env,
                          capture_output=True, text=True)


def planned_words(*variables: str) -> list[str]:
    planned = make_plan(*variables)
    assert planned.returncode == 0 and not planned.stderr, planned
    return planned.stdout.replace("\\\n", " ").split()


@pytest.mark.parametrize("variable", SWITCHES)
def test_a_switch_is_on_for_1_off_when_left_out_and_any_other_value_is_one_error_line(variable):
    target, flag = SWITCHES[variable]
    assert flag in planned_words(target, *TARGET_VARIABLES[target], f"{variable}=1")
    assert flag not in planned_words(target, *TARGET_VARIABLES[target])
    assert flag not in planned_words(target, *TARGET_VARIABLES[target], f"{variable}=")
    for value in ("0", "no", "true"):
        refused = make_plan(target, *TARGET_VARIABLES[target], f"{variable}={value}")
        assert refused.returncode != 0 and flag not in refused.stdout, refused
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{variable}={value}: give {variable}=1 to turn it on or leave it out" in lines[0]


@pytest.mark.parametrize("target, variables", [("eval", []), ("export", TARGET_VARIABLES["export"]), ("train", []),
                                               ("train", ["NODES=2"])])
def test_make_eval_export_and_train_pass_args_through_a_quoted_word_whole(target, variables):
    """`make train`'s ARGS are the recipe overrides and the run's name (README's `ARGS="--trainer.max_steps=100
    --run-name try1"`): the node launch's plan prints them back as ARGS='...', for make to hand the shell as given."""
    planned = make_plan(target, *variables, "ARGS=--limit 40 --run-name 'try 1'")
    assert planned.returncode == 0 and not planned.stderr, planned
    words = shlex.split(planned.stdout.replace("\\\n", " "))  # as the shell reads it
    assert words[-4:] == ["--limit", "40", "--run-name", "try 1"], words


# 4096 workers, more than the cores: one thread each (OMP_NUM_THREADS=0 had each worker's libgomp print that it is invalid)
@pytest.mark.parametrize("workers, threads", [("2", lambda cores: max(1, cores // 2)), ("0", lambda cores: cores),
                                              ("auto", lambda cores: 1), ("logical", lambda cores: 1),
                                              ("4096", lambda cores: 1)])
def test_make_test_runs_pytest_for_each_of_xdists_worker_counts(workers, threads, tmp_path):
    """The suite's command as `make test` runs it, with a stand-in for the venv's python that prints what it got."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "threads=$OMP_NUM_THREADS args=$*"\n')
    fake_python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "TEST_WORKERS", "OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    ran = subprocess.run(["make", "-s", "--no-print-directory", "test", "STAMP=", f"PY={fake_python}",
                          f"TEST_WORKERS={workers}"], cwd=REPO, env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and not ran.stderr, ran
    cores = int(subprocess.run(["nproc"], env=env, capture_output=True, text=True, check=True).stdout)
    assert ran.stdout.split() == [f"threads={threads(cores)}", "args=-m", "pytest", "-q", "-n", workers, "--dist",
                                  "loadfile"]


@pytest.mark.parametrize("recipe", ["smollm2-135m", "/somewhere/my-recipe.yaml"])
def test_make_data_hands_the_recipe_to_regenerate_as_given(recipe):
    """data/regenerate.py takes a recipe's name or its file, as `make features` and `make train` pass it; `make data`
    used to wrap it in recipes/<RECIPE>.yaml, so RECIPE=/path/x.yaml asked for recipes//path/x.yaml.yaml."""
    words = planned_words("data", f"RECIPE={recipe}")
    assert words[words.index("--recipe") + 1] == f"'{recipe}'", words  # quoted for the shell


@pytest.mark.parametrize("variable, flag", [("REPO", "--repo"), ("BASE_MODEL", "--base-model"), ("LICENSE", "--license")])
def test_make_export_passes_the_cards_values_as_one_word_each(variable, flag):
    """They went to the shell unquoted: BASE_MODEL="not a/hub id" was split, and argparse named its stray words
    (`unrecognized arguments: a/hub id`) where publish.py's own check names the value (found in a review)."""
    planned = make_plan("export", "RUN=outputs/tiny/r", "OUT=exports/x", f"{variable}=not a/hub id")
    assert planned.returncode == 0 and not planned.stderr, planned
    words = shlex.split(planned.stdout.replace("\\\n", " "))  # as the shell reads it
    assert words[words.index(flag) + 1] == "not a/hub id", words


@pytest.mark.parametrize("target, variables", [("export", ["RUN=outputs/tiny/r", "OUT=exports/x"]), ("train", []),
                                               ("eval", []), ("features", []), ("data", []), ("ablate", [])])
def test_make_echoes_each_command_as_one_line(target, variables):
    """`make export` with no options echoed its command over five lines, four of them a lone backslash (one for each
    line of unset options); what make shows is what a user copies to run again."""
    planned = make_plan(target, *variables)
    assert planned.returncode == 0 and not planned.stderr, planned
    lines = planned.stdout.splitlines()
    assert len(lines) == 1 and "\\" not in lines[0], lines


def test_make_coverage_runs_make_tests_suite_under_coverage_with_its_pins():
    """The suite as `make test` runs it (same workers, same threads), with branch coverage of the project's own packages
    and the commands the tests start followed: a run that leaves out data/ or the CLI's subprocesses calls their
    lines untested."""
    plan = make_plan("coverage", "TEST_WORKERS=2").stdout.replace("\\\n", " ").splitlines()
    test_plan = make_plan("test", "TEST_WORKERS=2").stdout.strip()
    assert plan[0].split()[-4:] == ["install", "-q", "coverage==7.18.0", "pytest-cov==7.1.0"], plan
    assert plan[-1].startswith(test_plan + " --cov "), (plan, test_plan)
    assert "--cov-report=json:outputs/coverage/coverage.json" in plan[-1].split()
    # the earlier run's files alone go: `rm -rf outputs/coverage` took a recipe named coverage's runs with them
    assert plan[1] == "rm -f outputs/coverage/.coverage outputs/coverage/.coverage.* outputs/coverage/coverage.json"
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["coverage"]["run"]
    assert settings["source"] == ["ddtree", "training", "data"]
    assert settings["branch"] is True and settings["patch"] == ["subprocess"]


@pytest.mark.parametrize("target", ["test", "test-all", "coverage"])
@pytest.mark.parametrize("workers", ["abc", "", "-1", "2 3"])
def test_make_test_refuses_a_worker_count_xdist_cannot_take_in_one_line(target, workers):
    """pytest-xdist's -n takes a count, auto or logical: TEST_WORKERS=abc (or empty) stopped in pytest's usage lines
    about `-n/--numprocesses`, which the user never typed, and TEST_WORKERS=-1 ran the suite in one process on one
    thread, as no value README names does."""
    refused = make_plan(target, f"TEST_WORKERS={workers}")
    assert refused.returncode != 0 and "pytest" not in refused.stdout, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"TEST_WORKERS={workers}: give the number of worker processes" in lines[0], lines


def help_paragraphs() -> dict[str, str]:
    """`make help`'s text, one paragraph per "make <target>" line that starts one, keyed by that target."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    shown = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=REPO, env=env, capture_output=True,
                           text=True, check=True).stdout
    return {paragraph.split()[0].rstrip(":"): paragraph
            for paragraph in re.split(r"^make ", shown.split("\n", 1)[1], flags=re.MULTILINE) if paragraph}


def test_make_help_names_each_variable_under_each_target_that_reads_it():
    """`make help` said nothing of `make setup` or of PYTHON and VENV, which make the venv every target runs in, and
    `make features` passed ARGS (its --dtype, the recipe overrides) that its line did not name. A variable the
    Makefile reads and never sets itself (or sets with ?=) is the user's: each shows as VAR= in the paragraph of
    every target whose command it reaches."""
    makefile = (REPO / "Makefile").read_text()
    switches = set(re.findall(r"\$\(call switch,([A-Z_]+),", makefile))
    assert switches == set(SWITCHES)  # each one's target is known
    read = set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", makefile)) - {"MAKEFILE_LIST"}
    set_here = {name for name, how in re.findall(r"^([A-Z][A-Z0-9_]*)\s*([:?]?=)", makefile, re.MULTILINE)
                if how != "?="}
    users = read - set_here - switches
    paragraphs = help_paragraphs()
    for name in ("PYTHON", "VENV"):  # every target's (make setup's venv)
        assert name in users and f"{name}=" in paragraphs.get("setup", ""), (name, paragraphs.get("setup"))
    markers = {name: "913" if name == "TEST_WORKERS" else f"zq{name}" for name in users - {"PYTHON", "VENV"}}
    for target in re.search(r"^\.PHONY: (.*)$", makefile, re.MULTILINE).group(1).split():
        paragraph = paragraphs.get(target) or next(text for text in paragraphs.values() if f"make {target} " in text)
        plan = make_plan(target, *(f"{name}={marker}" for name, marker in markers.items()))
        assert plan.returncode == 0 and not plan.stderr, (target, plan)
        for name, marker in markers.items():
            assert marker not in plan.stdout or f"{name}=" in paragraph, (target, name, paragraph)
        for name in switches:
            assert SWITCHES[name][0] != target or f"{name}=1" in paragraph, (target, name, paragraph)


@pytest.mark.parametrize("has_pip", [True, False])
def test_make_setup_makes_the_venv_again_where_an_earlier_one_has_no_pip(has_pip, tmp_path):
    """Without python3-venv (Debian, Ubuntu) `python3 -m venv` stops after writing bin/python, before pip, and says to
    install the package and make the venv again: `make setup` then took the venv for made and failed at every run on
    "No module named pip". Stand-ins for PYTHON and the venv's python log what make ran."""
    log, venv = tmp_path / "log", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python, venv_python = tmp_path / "python3", venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "python $*" >> {log}\n')
    venv_python.write_text(f'#!/bin/sh\necho "venv python $*" >> {log}\n'
                           + ("" if has_pip else '[ "$*" != "-m pip --version" ]\n'))
    for script in (python, venv_python):
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    ran = subprocess.run(["make", "-s", "--no-print-directory", "setup", f"VENV={venv}", f"PYTHON={python}"], cwd=REPO,
                         env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and (venv / ".installed").exists(), ran
    made = f"python -m venv {venv}" in log.read_text().splitlines()
    assert made is not has_pip, log.read_text()


@pytest.mark.parametrize("nodes", [[], ["NODES=2"]])
def test_make_train_refuses_an_empty_resume_where_it_started_a_new_run(nodes):
    """`make train RECIPE=x RESUME="$RUN"` with RUN unset dropped the empty RESUME and trained a new run from step 0
    in a new folder (the CPU recipe's half hour), where the run meant to go on was never named."""
    refused = make_plan("train", "RECIPE=tiny", "RESUME=", *nodes)
    assert refused.returncode != 0 and not refused.stdout, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "RESUME is empty (an unset shell variable?)" in lines[0], lines
    assert "--resume" not in planned_words("train", "RECIPE=tiny", *nodes)  # left out: a new run
